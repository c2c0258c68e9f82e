"""ParallelSpec [MASK]-token parallel drafter, Medusa integration (ParallelSpec paper section 4.1, 4.3, Eq. 3).

One decoder layer with the target's hyper-parameters reads the items u_i = fc([e(x_{i+1}); f_i])
(DESIGN.md section 3) and K learned [MASK] input vectors; the target's final norm and LM head,
shared and frozen, turn its outputs into distributions. One forward pass over the context items plus
K mask slots drafts K + 1 tokens: the anchor item's output guesses x_{n+1}, mask slot j guesses
x_{n+1+j} (Fig. 2 left). Training uses the group-wise layout (:mod:`drafttrain.layout`) and Eq. 3.

Shape letters: b batch, t items, s layout slots, k mask tokens, d hidden, v vocab.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from drafttrain import layout as L
from drafttrain.drafters.base import Drafter, LossOutput, SharedTargetModules
from drafttrain.losses import group_position_weights, parallel_group_loss
from drafttrain.metrics import group_acceptance_sums


class ParallelSpecDrafter(Drafter):
    """ParallelSpec drafter (Medusa integration).

    Config keys: ``num_mask_tokens`` (K, default 4), ``loss_decay`` (lambda_k = decay**k, default 0.8),
    ``anchor_ratio`` (training anchor subsample, default 1.0), ``init_from_target_layer`` (copy the
    target's last decoder layer as the starting point), ``fc_bias``, ``draft_vocab_size`` (0 = the
    target's full vocabulary; N > 0 = the drafter only proposes the N token ids in buffer ``d2t``, a
    row subset of the frozen LM head, as in EAGLE-3; set them with :meth:`set_draft_vocab`),
    ``kd_weight`` (mix of the target's soft distribution into Eq. 3's CE; the target's logits for the
    token at position t are LM head(f_{t-1}), read from the batch's features, so they cost no target
    forward).

    Trainable parameters: fc (2d x d [+ d]), one decoder layer, K mask vectors [K, d].
    """

    name = "parallelspec"

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        config = {
            "num_mask_tokens": 4,
            "loss_decay": 0.8,
            "anchor_ratio": 1.0,
            "init_from_target_layer": True,
            "fc_bias": True,
            "draft_vocab_size": 0,
            "kd_weight": 0.0,
            **config,
        }
        super().__init__(config, shared)
        mcfg = copy.deepcopy(shared.model_config)
        if getattr(mcfg, "_attn_implementation", None) not in ("sdpa", "eager"):
            mcfg._attn_implementation = "sdpa"  # float 4D masks: sdpa or eager only (PLATFORM.md)
        d = mcfg.hidden_size
        self.num_mask_tokens = int(config["num_mask_tokens"])
        self.fc = nn.Linear(2 * d, d, bias=bool(config["fc_bias"]))
        layer_cls = type(shared.decoder_layer)
        self.layer = layer_cls(mcfg, layer_idx=0)
        self.rotary = type(shared.rotary_emb)(config=mcfg)
        self.mask_embed = nn.Parameter(torch.zeros(self.num_mask_tokens, d))  # [k, d]
        self.weights = group_position_weights(self.num_mask_tokens, float(config["loss_decay"]))
        v = shared.lm_head.weight.shape[0]
        n_draft = int(config["draft_vocab_size"]) or v
        if n_draft > v:
            raise ValueError(f"draft_vocab_size {n_draft} exceeds the target vocabulary {v}")
        self.register_buffer("d2t", torch.arange(n_draft), persistent=True)  # draft id -> target id
        if init_weights:
            self.reset_parameters(from_target=bool(config["init_from_target_layer"]))
        dtype = shared.embed_tokens.weight.dtype
        self.to(dtype=dtype, device=shared.embed_tokens.weight.device)

    @property
    def restricted_vocab(self) -> bool:
        return self.d2t.numel() < self.shared.lm_head.weight.shape[0]

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Use the given target token ids ([N] int64, distinct, N = draft_vocab_size) as the draft vocabulary."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if token_ids.numel() != self.d2t.numel() or token_ids.unique().numel() != token_ids.numel():
            raise ValueError(f"need {self.d2t.numel()} distinct token ids, got {token_ids.numel()}")
        self.d2t.copy_(token_ids.to(self.d2t.device))

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Map target token ids [...] to draft ids (-1 where the id is outside the draft vocabulary)."""
        if not self.restricted_vocab:
            return ids
        t2d = torch.full((self.shared.lm_head.weight.shape[0],), -1, dtype=torch.long, device=ids.device)
        t2d[self.d2t] = torch.arange(self.d2t.numel(), device=ids.device)
        return t2d[ids.clamp_min(0)].masked_fill(ids < 0, -1)

    @torch.no_grad()
    def reset_parameters(self, from_target: bool) -> None:
        """fc starts as [0 | I] (u_i = f_i, the EAGLE-style identity on the feature) plus small noise on
        the embedding half; the layer is a copy of the target's last decoder layer or a fresh init."""
        std = getattr(self.shared.model_config, "initializer_range", 0.02)
        d = self.fc.out_features
        self.fc.weight.normal_(0.0, std)
        self.fc.weight[:, d:] += torch.eye(d, dtype=self.fc.weight.dtype)
        if self.fc.bias is not None:
            self.fc.bias.zero_()
        self.mask_embed.normal_(0.0, std)
        if from_target:
            self.layer.load_state_dict(self.shared.decoder_layer.state_dict())
        else:
            for m in self.layer.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std)

    # -- building blocks ------------------------------------------------------------------------
    def items(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """u = fc([e(x_{i+1}); f_i]).

        Args:
            next_ids: [b, t] int64, x_{i+1} for each item.
            features: [b, t, d] the target's last hidden states f_i.

        Returns:
            [b, t, d] items in the drafter's dtype.
        """
        e = self.shared.embed_tokens(next_ids).to(self.fc.weight.dtype)
        return self.fc(torch.cat([e, features.to(self.fc.weight.dtype)], dim=-1))

    def decode(self, x, attention_mask, position_ids, past_key_values=None, use_cache=False) -> torch.Tensor:
        """The decoder layer over inputs x [b, q, d] with an additive mask [b, 1, q, kv] and positions [b, q]."""
        pos_emb = self.rotary(x, position_ids)
        return self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=pos_emb,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shared frozen final norm + LM head rows of the draft vocabulary: [..., d] -> [..., N] float32."""
        h = self.shared.final_norm(hidden)
        if not self.restricted_vocab:
            return self.shared.lm_head(h).float()
        head = self.shared.lm_head
        w = head.weight[self.d2t]  # [N, d] frozen rows (gather is cheap next to the matmul)
        b = head.bias[self.d2t] if getattr(head, "bias", None) is not None else None
        return torch.nn.functional.linear(h, w.to(h.dtype), None if b is None else b.to(h.dtype)).float()

    @torch.no_grad()
    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary from its (post-norm) features: [m, d] -> [m, N]."""
        head = self.shared.lm_head
        w = head.weight if not self.restricted_vocab else head.weight[self.d2t]
        b = getattr(head, "bias", None)
        if b is not None and self.restricted_vocab:
            b = b[self.d2t]
        return torch.nn.functional.linear(features.to(w.dtype), w, b).float()

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits [..., N] into the target vocabulary [..., v] (-inf elsewhere)."""
        if not self.restricted_vocab:
            return logits
        v = self.shared.lm_head.weight.shape[0]
        full = logits.new_full((*logits.shape[:-1], v), float("-inf"))
        full[..., self.d2t] = logits
        return full

    # -- training -------------------------------------------------------------------------------
    def layouts(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> L.BatchLayout:
        """Group-wise layouts of a batch (labels from ``input_ids``/``loss_mask``, anchors subsampled)."""
        per_seq = []
        for i in range(batch["input_ids"].shape[0]):
            n = int(batch["lengths"][i])
            labels = L.item_labels(batch["input_ids"][i, :n], batch["loss_mask"][i, :n])
            anchors = L.select_anchors(labels, self.num_mask_tokens, float(self.config["anchor_ratio"]), generator)
            per_seq.append(L.build_group_layout(labels, anchors, self.num_mask_tokens))
        return L.collate_layouts(per_seq, dtype=self.fc.weight.dtype)

    def forward_layout(self, items: torch.Tensor, lay: L.BatchLayout) -> torch.Tensor:
        """Drafter hidden states over a batch layout.

        Args:
            items: [b, t, d] context items.
            lay: the batch's :class:`~drafttrain.layout.BatchLayout` (s slots).

        Returns:
            [b, s, d] hidden states (before the shared norm + head).
        """
        b, t, d = items.shape
        idx = lay.slot_anchor.clamp(max=t - 1)  # [b, s]
        x = torch.gather(items, 1, idx[..., None].expand(-1, -1, d))  # [b, s, d] items in place
        masks = self.mask_embed[(lay.slot_kind - 1).clamp(min=0)]  # [b, s, d]
        x = torch.where((lay.slot_kind > 0)[..., None], masks.to(x.dtype), x)
        return self.decode(x, lay.attention_mask.to(x.dtype), lay.position_ids)

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        """Eq. 3 over the group-wise layout of a batch.

        Batch keys: ``input_ids`` [b, L] int64 (right-padded), ``loss_mask`` [b, L], ``lengths`` [b],
        ``features`` [b, L-1, d] (f_0..f_{L-2}).
        """
        ids, feats = batch["input_ids"], batch["features"]
        t = ids.shape[1] - 1
        items = self.items(ids[:, 1:], feats[:, :t])  # [b, t, d]
        lay = self.layouts(batch, generator)
        hidden = self.forward_layout(items, lay)  # [b, s, d]
        valid = lay.labels != L.IGNORE_INDEX  # [b, s] slots with a label
        draft_labels = self.target_to_draft(lay.labels)  # -1: label outside the draft vocabulary
        sel = valid & (draft_labels >= 0)  # slots that enter the loss
        logits = self.logits(hidden[sel])  # [m, N]
        labels = draft_labels[sel]
        kind = lay.slot_kind[sel]
        kd = float(self.config["kd_weight"])
        t_logits = None
        if kd > 0:
            # slot guessing x_{a+j+2} (item: j = 0) <- the target's distribution LM head(f_{a+j+1})
            fidx = (lay.slot_anchor + lay.slot_kind.clamp_min(0) + 1)[sel]  # [m]
            bidx = torch.arange(sel.shape[0], device=sel.device)[:, None].expand_as(sel)[sel]  # [m]
            t_logits = self.target_logits(feats[bidx, fidx])
        loss, ce_sum, ce_count = parallel_group_loss(logits, labels, kind, self.weights, t_logits, kd)
        sums = {"ce_sum": ce_sum, "ce_count": ce_count}
        # out-of-vocabulary labels stay valid for the metrics: the drafter can never propose them
        correct = torch.zeros_like(lay.labels, dtype=torch.bool)
        correct[sel] = logits.argmax(-1) == labels
        sums.update(self._group_sums(lay, correct, valid))
        return LossOutput(loss=loss, sums=sums, num_tokens=int((lay.slot_kind >= 0).sum()))

    def _group_sums(self, lay: L.BatchLayout, correct: torch.Tensor, valid: torch.Tensor) -> dict:
        """Gather each anchor group's [anchor item, mask 1..K] slots and sum acceptance statistics."""
        k = self.num_mask_tokens
        rows_c, rows_v = [], []
        for i in range(lay.slot_kind.shape[0]):
            t = int(lay.num_items[i])
            n_masks = int((lay.slot_kind[i] > 0).sum())
            n = n_masks // k if k else 0
            if n == 0:
                continue
            anchors = lay.slot_anchor[i, t : t + n * k : k]  # [n]
            c = torch.cat([correct[i, anchors][:, None], correct[i, t : t + n * k].view(n, k)], dim=1)
            v = torch.cat([valid[i, anchors][:, None], valid[i, t : t + n * k].view(n, k)], dim=1)
            rows_c.append(c)
            rows_v.append(v)
        if not rows_c:
            z = torch.zeros(k + 1)
            return {"acc_num": z, "acc_den": z.clone(), "cond_num": z.clone(), "cond_den": z.clone(),
                    "tau_len_sum": torch.zeros(()), "tau_groups": torch.zeros(())}
        return group_acceptance_sums(torch.cat(rows_c), torch.cat(rows_v))

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """One drafting step (ParallelSpec Fig. 2 left, Algorithm 1's single drafter call).

        Appends the new items to the drafter's KV cache, runs them plus the K mask inputs in one
        forward pass, then crops the mask slots back out of the cache.

        Args:
            next_ids: [1, n] int64 x_{i+1} of the n new items (the accepted tokens and the bonus token).
            features: [1, n, d] target features f_i of those items.
            cache: a transformers ``DynamicCache`` holding the drafter's past items (updated in place).

        Returns:
            [1, K + 1, v] float32 logits over the target vocabulary (-inf outside a restricted draft
            vocabulary): position 0 guesses the token after the last item's x_{i+1}, position j the
            j-th token after that.
        """
        n = next_ids.shape[1]
        past = cache.get_seq_length()
        u = self.items(next_ids, features)  # [1, n, d]
        x = torch.cat([u, self.mask_embed[None].to(u.dtype)], dim=1)  # [1, n + k, d]
        pos, mask = L.inference_layout(n, self.num_mask_tokens, dtype=u.dtype, past=past)
        h = self.decode(x, mask.to(u.device), pos.to(u.device), past_key_values=cache, use_cache=True)
        cache.crop(-self.num_mask_tokens)  # transformers 5: negative = tokens to remove
        return self.full_vocab_logits(self.logits(h[:, n - 1 :]))
