"""DFlash: block-diffusion parallel drafting (Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding", sections 3.1-3.3), the successor of ParallelSpec's [MASK]-token drafting.

**Network.** A few decoder layers (``num_layers``, Qwen3-style: RMSNorm, attention with per-head q/k norms
and RoPE, SwiGLU MLP; sizes, heads, head_dim, norm epsilon and RoPE from the target) draft a whole block
of B = ``block_size`` positions in one forward pass. The target's hidden states at ``target_layer_ids``
(several layers, concatenated) are fused into one context feature per position,

    c_i = hidden_norm(fc([f_i^{l_1}; ...; f_i^{l_m}]))         fc.weight [d, m*d], no bias

and **injected into every draft layer's keys and values**: layer l attends over
``[k_proj(c_0..c_{a}) ; k_proj(block)]`` (its own k/v projections and k norm, RoPE at the context's
positions), while only the block's B positions make queries. The block holds the last committed token
(the bonus token at inference) at position a + 1 followed by B - 1 ``mask_token_id`` embeddings at
a + 2..a + B; it attends bidirectionally within itself and to the context up to the anchor item a.
Slot j >= 2 is the drafted token at its own position (denoising in place). The embedding, the final
LM head and (with a restricted draft vocabulary) its rows are the target's, shared and frozen; the
drafter owns ``fc``, ``hidden_norm``, the layers and a final ``norm``.

**Training.** The group-wise layout with ``block=True`` (:func:`drafttrain.layout.build_group_layout`:
the block is a group): per sequence up to ``num_anchors`` anchors drawn at random from the positions whose
block has a label (paper section 3.3, "random anchor sampling"), every block in one forward pass over
keys [context items | all blocks], masks from the same layout as ParallelSpec's. Loss: cross-entropy on
the self-distilled tokens (the target's own) at slots k = 1..B-1, weighted by the position decay

    w_k = exp(-(k - 1) / gamma)                                  (paper Eq. 4; gamma = ``loss_decay_gamma``)

as a weighted mean per position (:func:`drafttrain.losses.weighted_position_mean`). Metrics: acc_k /
cond_acc_k / tau_sim over the blocks (k = 0 is the first drafted token).

**Inference.** ``spec.drafting = "parallel"``: one :meth:`propose` per verification step appends the new
items' fused context keys/values to the drafter's cache (per layer) and drafts B - 1 tokens in one pass;
the block's own keys/values are never cached. The engine verifies them as any parallel drafter's
(a chain, or a tree from the per-position top-k).

Shape letters: b batch, t context items, B block size, n blocks, q block slots (n * B), d hidden,
F feature width (m * d), N draft vocab, v target vocab, h heads, hd head dim.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from drafttrain.target import families
from drafttrain import layout as L
from drafttrain import attention as A
from drafttrain.drafters.base import LAST_LAYER, Drafter, DrafterSpec, LossOutput, Objective, SharedTargetModules
from drafttrain.drafters.feature_layer import init_fresh_
from drafttrain.drafters.groups import cut_weights, label_own_drafts
from drafttrain.losses import weighted_position_mean
from drafttrain.metrics import empty_group_sums, group_acceptance_sums


def default_target_layer_ids(num_hidden_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread from low to high, in drafttrain's convention (id i = the hidden state
    entering decoder layer i): the reference code's ``round(1 + j * (L - 4) / (count - 1))`` output-of-layer
    ids (the middle layer for one) plus one, clamped into [1, L - 1] and deduplicated (a small target may
    give fewer). Example: L = 30, count = 3 -> (2, 15, 28); L = 2, count = 2 -> (1,)."""
    n = int(num_hidden_layers)
    if count <= 1:
        ids = [n // 2]
    else:
        ids = [round(1 + j * (n - 4) / (count - 1)) + 1 for j in range(count)]
    return tuple(dict.fromkeys(min(max(i, 1), max(n - 1, 1)) for i in ids))


class DFlashDrafter(Drafter):
    """DFlash (module docstring): fused multi-layer target context injected into every draft layer's keys and
    values, one block of B positions drafted per pass.

    Config keys: ``num_layers`` (draft layers, 2), ``block_size`` (B, 8: B - 1 drafts per pass),
    ``target_layer_ids`` (None = :func:`default_target_layer_ids` with ``num_target_layers``),
    ``num_target_layers`` (3), ``mask_token_id`` (-1 = the last vocabulary id), ``loss_decay_gamma`` (4.0),
    ``num_anchors`` (blocks per training sequence at most, 64), ``init_from_target_layer`` (start the layers'
    projections, MLP and norms from the target's last layers where they carry over), ``draft_vocab_size``
    (N; 0 = the full vocabulary).
    """

    name = "dflash"
    serving_formats = {"dflash": "dflash"}
    # feature_layers here is a placeholder: the real ids depend on the config and the target (layers_for)
    spec = DrafterSpec(drafting="parallel", feature_layers=(LAST_LAYER,), step_input="items", batched=False)
    objectives = frozenset({"cut_at_first_miss", "on_policy"})  # its loss is hard cross-entropy: no divergence
    defaults = {
        "num_layers": 2,
        "block_size": 8,
        "target_layer_ids": None,
        "num_target_layers": 3,
        "mask_token_id": -1,
        "loss_decay_gamma": 4.0,
        "num_anchors": 64,
        "init_from_target_layer": True,
        "draft_vocab_size": 0,
    }

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        super().__init__(config, shared)
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

        for key, low in (("num_layers", 1), ("block_size", 2), ("num_anchors", 1), ("num_target_layers", 1)):
            if int(self.config[key]) < low:
                raise ValueError(f"drafter.{key} must be >= {low}, got {self.config[key]}")
        if float(self.config["loss_decay_gamma"]) <= 0:
            raise ValueError(f"drafter.loss_decay_gamma must be > 0, got {self.config['loss_decay_gamma']}")
        mcfg = shared.model_config
        lcfg = families.draft_layer_config(mcfg)
        qcfg = Qwen3Config(**{k: v for k, v in lcfg.items() if k not in ("model_type", "mlp_bias", "num_hidden_layers")},
                           num_hidden_layers=int(self.config["num_layers"]))  # fmt: skip
        qcfg._attn_implementation = "sdpa"
        self.qwen3_config = qcfg
        d = int(mcfg.hidden_size)
        v = int(mcfg.vocab_size)
        mid = int(self.config["mask_token_id"])
        self.mask_token_id = v - 1 if mid == -1 else mid
        if not 0 <= self.mask_token_id < v:
            raise ValueError(f"drafter.mask_token_id must be -1 or in [0, {v}), got {mid}")
        self.fc = nn.Linear(self.feature_dim, d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, eps=qcfg.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(copy.deepcopy(qcfg), layer_idx=i) for i in range(qcfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(d, eps=qcfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config=qcfg)
        self._init_draft_vocab(self.config["draft_vocab_size"])
        if init_weights:
            self.reset_parameters(from_target=bool(self.config["init_from_target_layer"]))
        self.to(dtype=shared.embed_tokens.weight.dtype, device=shared.embed_tokens.weight.device)

    @classmethod
    def layers_for(cls, config: dict[str, Any], num_hidden_layers: int) -> tuple[int, ...]:
        """The target layers fused into the context: ``target_layer_ids``, or spread ones (module docstring).

        Raises:
            ValueError: an id outside [0, L - 1] or a repeated one.
        """
        n = int(num_hidden_layers)
        ids = config.get("target_layer_ids", cls.defaults["target_layer_ids"])
        if not ids:
            return default_target_layer_ids(n, int(config.get("num_target_layers", cls.defaults["num_target_layers"])))
        ids = tuple(int(i) for i in ids)
        if any(i < 0 or i >= n for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"drafter.target_layer_ids must be distinct ids in [0, {n - 1}] (id i = the hidden state "
                             f"entering decoder layer i), got {list(ids)}")  # fmt: skip
        return ids

    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def draft_depth(self) -> int:
        """B - 1: the tokens one pass drafts."""
        return self.block_size - 1

    # -- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, from_target: bool) -> None:
        """fc = N(0, 0.02) + [0 | ... | I] (the context starts as the highest fused layer), layers N(0, 0.02)
        (norms 1); with ``from_target`` layer l starts from the target's layer L - num_layers + l where the
        computation carries over (:func:`drafttrain.target.families.split_projections`; norms as Llama's x * w)."""
        std = float(getattr(self.shared.model_config, "initializer_range", 0.02) or 0.02)
        d = self.fc.out_features
        self.fc.weight.normal_(0.0, std)
        self.fc.weight[:, -d:] += torch.eye(d, dtype=self.fc.weight.dtype)
        for layer in self.layers:
            init_fresh_(layer, std)
        if not from_target:
            return
        target_layers = list(self.shared.decoder_layers or [self.shared.decoder_layer])
        for layer, src in zip(self.layers, target_layers[-len(self.layers):]):
            w = families.llama_init_weights(src, self.shared.model_config, d)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(w[name])
            for name in ("gate_proj", "up_proj", "down_proj"):
                if name in w:
                    getattr(layer.mlp, name).weight.copy_(w[name])
            layer.input_layernorm.weight.copy_(w["input_norm"])
            layer.post_attention_layernorm.weight.copy_(w["mlp_norm"])
        self.norm.weight.copy_(families.effective_norm_weight(self.shared.final_norm, d))

    # -- the network ----------------------------------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """c = hidden_norm(fc(features)): [b, t, F] -> [b, t, d] (the keys/values source of every layer)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_inputs(self, tokens: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        """Block slot inputs: the token's embedding for kind 1 (the given token), the [MASK] embedding for the
        rest. tokens [b, q] int64 (kind-1 slots), kinds [b, q] int64 -> [b, q, d]."""
        ids = torch.where(kinds == 1, tokens, torch.full_like(tokens, self.mask_token_id))
        return self.shared.embed_tokens(ids).to(self.fc.weight.dtype)

    def _attend(self, layer, h, ctx_k, ctx_v, pos_q, mask):
        """One layer's attention of the block (queries h [b, q, d], already input-normed) over the context's
        keys/values (ctx_k/ctx_v [b, h_kv, t, hd], RoPE applied) and the block's own."""
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        attn = layer.self_attn
        b, q, _ = h.shape
        hd = attn.head_dim
        cos, sin = self.rotary(h, pos_q)
        qs = attn.q_norm(attn.q_proj(h).view(b, q, -1, hd)).transpose(1, 2)  # [b, h, q, hd]
        ks = attn.k_norm(attn.k_proj(h).view(b, q, -1, hd)).transpose(1, 2)  # [b, h_kv, q, hd]
        vs = attn.v_proj(h).view(b, q, -1, hd).transpose(1, 2)
        qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
        k = torch.cat([ctx_k, ks], dim=2)
        v = torch.cat([ctx_v, vs], dim=2)
        if A.is_block_mask(mask):  # trainer.attention=flex: the same layout's block mask
            out = A.flex_attend(attn, qs, k, v, mask, attn.scaling)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=qs.shape[1] != k.shape[1])  # [b, h, q, hd]
        return attn.o_proj(out.transpose(1, 2).reshape(b, q, -1))

    def context_kv(self, layer, ctx: torch.Tensor, pos_ctx: torch.Tensor):
        """A layer's keys/values of the fused context c [b, t, d] at positions [b, t] (k norm, RoPE):
        ([b, h_kv, t, hd], [b, h_kv, t, hd]). The context skips the layer's input norm (``hidden_norm`` is its norm)."""
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        attn = layer.self_attn
        b, t, _ = ctx.shape
        hd = attn.head_dim
        k = attn.k_norm(attn.k_proj(ctx).view(b, t, -1, hd)).transpose(1, 2)
        v = attn.v_proj(ctx).view(b, t, -1, hd).transpose(1, 2)
        cos, sin = self.rotary(ctx, pos_ctx)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def blocks_forward(self, ctx_kv: list, x: torch.Tensor, pos_q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The draft layers over block inputs x [b, q, d] (positions [b, q]) given every layer's context
        keys/values (``ctx_kv[l]``) and the additive mask [b, 1, q, t + q]. Returns norm(h) [b, q, d]."""
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = x + self._attend(layer, layer.input_layernorm(x), ck, cv, pos_q, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    # -- training -------------------------------------------------------------------------------
    def _anchors(self, labels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Anchors a of one sequence whose block has a label (some y_{a..a+B-2}); at most ``num_anchors`` of
        them drawn at random in training (every one in eval mode). labels [t] -> [n] sorted int64."""
        t, k = labels.numel(), self.block_size - 1
        valid = labels != L.IGNORE_INDEX
        has = torch.zeros(t, dtype=torch.bool, device=labels.device)
        for j in range(k):
            has[: t - j] |= valid[j:]
        cand = torch.nonzero(has).flatten()
        cap = int(self.config["num_anchors"])
        if self.training and cand.numel() > cap:
            return L.subsample(cand, cap / cand.numel(), generator)[:cap]
        return cand

    def batch_layout(self, labels: torch.Tensor, lengths_items: torch.Tensor, generator=None, device=None):
        """Per-batch block layout: (block kinds [b, Q] (0 = padding), anchors [b, Q], positions [b, Q],
        labels [b, Q], mask) with T = the items' padded length and Q the most block slots of a row; padded
        query slots attend to themselves only (no NaN row). The mask is :func:`drafttrain.layout.group_rule`
        (``block=True``) over queries = the block slots and keys = [items | block slots]: an additive mask
        [b, 1, Q, T + Q] in the drafter's dtype, or with ``attention == "flex"`` the flex block mask of the
        same rule (:func:`drafttrain.attention.block_layout_mask_mod`)."""
        b, t_max = labels.shape
        bsz = self.block_size
        lays = []
        for i in range(b):
            t = int(lengths_items[i])
            y = labels[i, :t]
            lays.append(L.build_group_layout(y, self._anchors(y, generator), bsz - 1, block=True))
        q_max = max(1, max(int((lay.slot_kind > 0).sum()) for lay in lays))
        dev = labels.device
        kinds = torch.zeros((b, q_max), dtype=torch.long, device=dev)
        anchors = torch.zeros_like(kinds)
        pos = torch.zeros_like(kinds)
        lab = torch.full_like(kinds, L.IGNORE_INDEX)
        group = torch.full_like(kinds, -1)
        item_kind = torch.full((b, t_max), -1, dtype=torch.long, device=dev)  # 0 = a real item, -1 = padding
        for i, lay in enumerate(lays):
            blk = lay.slot_kind > 0
            q = int(blk.sum())
            kinds[i, :q], anchors[i, :q], group[i, :q] = lay.slot_kind[blk], lay.slot_anchor[blk], lay.slot_group[blk]
            pos[i, :q], lab[i, :q] = lay.position_ids[blk], lay.labels[blk]
            item_kind[i, : int(lengths_items[i])] = 0
        q_kind = kinds.masked_fill(kinds == 0, -1)  # padding query slots: kind -1 (group_rule's padding)
        if self.attention == "flex":
            mask_mod = A.block_layout_mask_mod(item_kind, q_kind, anchors, group)
            return kinds, anchors, pos, lab, A.block_mask(mask_mod, b, q_max, t_max + q_max, dev)
        k_kind = torch.cat([item_kind, q_kind], dim=1)  # [b, T + Q]
        k_anchor = torch.cat([torch.arange(t_max, device=dev).expand(b, -1), anchors], dim=1)
        k_group = torch.cat([torch.full_like(item_kind, -1), group], dim=1)
        allowed = L.group_rule(q_kind[:, :, None], anchors[:, :, None], group[:, :, None],
                               k_kind[:, None, :], k_anchor[:, None, :], k_group[:, None, :], True)  # fmt: skip
        own = torch.arange(t_max + q_max, device=dev)[None, :] == (t_max + torch.arange(q_max, device=dev))[:, None]
        allowed |= own & (q_kind < 0)[:, :, None]  # padding rows: themselves
        return kinds, anchors, pos, lab, L.additive_mask(allowed, self.fc.weight.dtype)[:, None]

    def block_hidden(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None):
        """Every block of the batch in one forward pass over keys [context items | blocks].

        Returns:
            (kinds [b, Q] int64 (0 = padding), anchors [b, Q] int64, labels [b, Q] int64 (-100 = none),
            norm(h) [b, Q, d]).
        """
        ids, feats = batch["input_ids"], batch["features"]
        t = ids.shape[1] - 1
        device = ids.device
        labels = L.batch_item_labels(ids, batch["loss_mask"], batch["lengths"])  # [b, t]: y_i = x_{i+2}
        n_items = (batch["lengths"] - 1).clamp_min(0)
        kinds, anchors, pos_q, lab, mask = self.batch_layout(labels, n_items, generator)
        tokens = ids.gather(1, (anchors + 1).clamp(max=ids.shape[1] - 1))  # kind-1 slot: x_{a+1}
        x = self.block_inputs(tokens, kinds)
        ctx = self.context(feats[:, :t])  # [b, t, d]
        pos_ctx = torch.arange(t, device=device)[None].expand(ids.shape[0], -1)
        ctx_kv = [self.context_kv(layer, ctx, pos_ctx) for layer in self.layers]
        mask = mask if A.is_block_mask(mask) else mask.to(x.dtype)
        return kinds, anchors, lab, self.blocks_forward(ctx_kv, x, pos_q, mask)

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                      objective: Objective | None = None) -> LossOutput:  # fmt: skip
        """Position-decayed cross-entropy over every block of the batch (module docstring; paper Eq. 4).

        Batch keys: ``input_ids`` [b, L] int64 right-padded, ``loss_mask`` [b, L], ``lengths`` [b],
        ``features`` [b, L-1, F] (the layers :attr:`feature_layers` of f_0..f_{L-2}).

        ``objective`` (None = offline): Spec-AUF's cut after a block's first miss, and on-policy labels (the
        target's argmax after the block's own drafts, :mod:`drafttrain.drafters.groups`; training mode only).
        A block's drafted slots (kinds 2..B) are its group positions 0..B-2.
        """
        obj = objective or Objective()
        kinds, anchors, lab, h = self.block_hidden(batch, generator)
        lab = lab.clone()
        bsz = self.block_size
        valid = lab != L.IGNORE_INDEX
        scored = valid & (self.target_to_draft(lab) >= 0)  # a label outside the draft vocabulary is not trained on
        row, slots = self._block_groups(kinds)
        sums: dict[str, torch.Tensor] = {}
        if obj.on_policy and self.training:
            final = h.new_zeros((*lab.shape, int(self.shared.model_config.hidden_size)), dtype=torch.float32)
            anchor = anchors[row, slots[:, 0]] if row.numel() else row
            sums.update(label_own_drafts(self, h, row, slots, anchor, lab, valid, final, scored, obj, generator))
        keep = valid & scored
        draft = self.target_to_draft(lab)
        logits = self.vocab_logits(h[keep])  # [m, N]
        ce = torch.nn.functional.cross_entropy(logits, draft[keep], reduction="none")
        k = (kinds[keep] - 1).clamp_min(0)  # k = 1..B-1 for the drafted slots
        gamma = float(self.config["loss_decay_gamma"])
        weights = [0.0] + [math.exp(-(j - 1) / gamma) for j in range(1, bsz)]
        correct = torch.zeros_like(valid)
        correct[keep] = logits.detach().argmax(-1) == draft[keep]
        slot_w = cut_weights(row, slots, correct, valid, scored, obj.cut_weight)[keep] if obj.cut_at_first_miss else None
        loss, ce_sum, ce_count = weighted_position_mean(ce, k, weights, slot_w)
        sums.update({"ce_sum": ce_sum[1:], "ce_count": ce_count[1:]})
        with torch.no_grad():  # per block: drafted slots k = 1..B-1 in order
            valid_d = valid & (kinds > 1)
            g = valid_d.shape[1] // bsz
            if g:
                cg = correct[:, : g * bsz].reshape(-1, bsz)[:, 1:]
                vg = valid_d[:, : g * bsz].reshape(-1, bsz)[:, 1:]
                groups = vg[:, 0]
                sums.update(group_acceptance_sums(cg[groups], vg[groups]) if groups.any()
                            else empty_group_sums(bsz - 1, device=valid.device))  # fmt: skip
            else:
                sums.update(empty_group_sums(bsz - 1, device=valid.device))
        return LossOutput(loss=loss, sums=sums, num_tokens=int(kinds.gt(0).sum()))

    def _block_groups(self, kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks as group tables (:mod:`drafttrain.drafters.groups`): (row [g], slots [g, B - 1]), slot p of a
        block = its kind p + 2 slot (the block slots of a row are laid out block by block, kinds 1..B in order)."""
        bsz = self.block_size
        rows, tables = [], []
        for i in range(kinds.shape[0]):
            nb = int((kinds[i] > 0).sum()) // bsz
            if nb:
                tables.append(torch.arange(nb * bsz, device=kinds.device).view(nb, bsz)[:, 1:])
                rows.append(torch.full((nb,), i, dtype=torch.long, device=kinds.device))
        if not rows:
            return (torch.zeros(0, dtype=torch.long, device=kinds.device),
                    torch.zeros((0, bsz - 1), dtype=torch.long, device=kinds.device))  # fmt: skip
        return torch.cat(rows), torch.cat(tables)

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """One drafting pass: append the n new items' context keys/values to every layer's cache, then draft
        the block anchored at the last item (its next id, the bonus token, then B - 1 masks).

        Args:
            next_ids: [1, n] int64 x_{i+1} of the new items (accepted tokens + bonus token).
            features: [1, n, F] their target features (layers :attr:`feature_layers`).
            cache: a transformers ``DynamicCache`` of the context keys/values (one entry per draft layer).

        Returns:
            [1, B - 1, v] float32 logits over the target vocabulary (-inf outside the draft vocabulary).
        """
        past = cache.get_seq_length()
        n = next_ids.shape[1]
        device = next_ids.device
        pos_ctx = torch.arange(past, past + n, device=device)[None]
        ctx = self.context(features)
        ctx_kv = []
        for i, layer in enumerate(self.layers):
            k, v = self.context_kv(layer, ctx, pos_ctx)
            ctx_kv.append(cache.update(k, v, i))  # the whole context so far
        a = past + n - 1  # anchor item: its next id is the bonus token
        bsz = self.block_size
        kinds = torch.arange(1, bsz + 1, device=device)[None]
        tokens = next_ids[:, -1:].expand(1, bsz)
        x = self.block_inputs(tokens, kinds)
        pos_q = a + kinds
        mask = torch.zeros((1, 1, bsz, a + 1 + bsz), dtype=x.dtype, device=device)  # sees all: context <= a, block
        h = self.blocks_forward(ctx_kv, x, pos_q, mask)
        return self.full_vocab_logits(self.vocab_logits(h[:, 1:]))
