"""ParallelSpec's parallel drafting on the EAGLE-3 network (ParallelSpec paper sections 4.1 and 4.3;
the serving engines call it parallel drafting / P-EAGLE).

The network is EAGLE-3's (:mod:`drafttrain.drafters.eagle3`: fc over three target layers, one decoder
layer on cat(input_norm(e), hidden_norm(g)), own head over the draft vocabulary). It is made parallel
the way vLLM's parallel drafting runs an EAGLE-3 model: **one** [MASK] token id and **one** learned mask
hidden state ``mask_hidden`` of the fc input size (3d). Every mask slot's input is the same

    m = cat(e(mask_token_id), fc(mask_hidden))     (2d, like an item's cat(e(x), g)),

told apart only by its RoPE position: after the last item at position n - 1, mask slot j sits at
n - 1 + j and guesses the (j + 1)-th token after the item's own guess, so one forward pass over the
new items + K mask slots drafts K + 1 tokens (ParallelSpec Fig. 2 left, Algorithm 1). The [MASK]
embedding is the target's (shared, frozen) row of ``mask_token_id``: the learned part is
``mask_hidden``; -1 picks the last id of the target vocabulary.

Training: ParallelSpec's group-wise parallel layout (:mod:`drafttrain.layout`; docs/design.md, "Definitions"):
items first, then K mask slots per anchor (mask slot j of anchor a at position a + j, seeing items <= a
and mask slots 1..j of the same anchor). Loss = the paper's EAGLE integration ("the sum of EAGLE
losses over the tokens within the same group", section 4.3) with EAGLE-3's objective in place of
EAGLE's: for group position k (0 = the anchor item, k = mask slot k),

    L = sum_{k=0..K} loss_decay^k * mean_{slots at k} KL( p || q ),

p = the target's distribution LM head(f_{a+k+1}) of the slot's label y_{a+k}, renormalised over the
draft vocabulary; slots whose label is loss-masked or whose target argmax lies outside the draft
vocabulary are left out (as in EAGLE-3's TTT). ``loss_decay`` = 1.0 is the paper's plain sum.

Shape letters: b batch, t items, s layout slots, k mask tokens, d hidden, N draft vocab, v vocab.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from drafttrain import layout as L
from drafttrain.attention import layout_mask
from drafttrain.drafters.base import LAST_LAYER, DrafterSpec, LossOutput, Objective, SharedTargetModules
from drafttrain.drafters.eagle3 import NUM_AUX, Eagle3Drafter
from drafttrain.drafters.groups import cut_weights, label_own_drafts, parallel_group_slots
from drafttrain.drafters.parallelspec import ParallelSpecDrafter
from drafttrain.drafters.target_argmax import memo_of
from drafttrain.losses import divergence, group_position_weights, weighted_position_mean


class ParallelSpecEagle3Drafter(Eagle3Drafter):
    """EAGLE-3 network + one [MASK] token + one learned mask hidden state; one pass drafts K + 1 tokens.

    Config keys: ``num_mask_tokens`` (K, 4), ``mask_token_id`` (the [MASK] token's target id whose frozen
    embedding the slots read; -1 = v - 1), ``loss_decay`` (position weights decay**k; 1.0 = the paper's
    plain sum), ``anchor_ratio`` (training anchor subsample; eval scores every anchor), ``aux_layer_ids``,
    ``init_from_target_layer``, ``draft_vocab_size`` (see :class:`~drafttrain.drafters.eagle3.Eagle3Drafter`).

    Trainable parameters: EAGLE-3's + ``mask_hidden`` [3d].

    Inference: :meth:`propose` (one forward, K + 1 rows); for the batched proposer, the items +
    :meth:`draft_inputs` (K copies of the mask input) in :func:`drafttrain.layout.inference_layout`.

    The group layout, its per-group metric sums and the slots' target features are ParallelSpec's own
    functions (:class:`~drafttrain.drafters.parallelspec.ParallelSpecDrafter`), reused as they are.
    """

    name = "parallelspec_eagle3"
    # vLLM drafts it in parallel (speculators' P-EAGLE); SGLang runs the same network as a plain EAGLE-3 chain
    serving_formats = {"speculators": "peagle", "sglang": "eagle3"}
    spec = DrafterSpec(drafting="parallel", feature_layers=(LAST_LAYER,), step_input="items", batched=True)
    objectives = frozenset({"divergence", "cut_at_first_miss", "on_policy"})
    defaults = {
        "num_mask_tokens": 4,
        "mask_token_id": -1,
        "loss_decay": 1.0,
        "anchor_ratio": 1.0,
        "aux_layer_ids": None,
        "init_from_target_layer": True,
        "draft_vocab_size": 0,
        "draft_layer": "llama",
        "fc_norm": False,
        "norm_output": False,
    }

    layouts = ParallelSpecDrafter.layouts
    _group_sums = ParallelSpecDrafter._group_sums
    slot_target_features = ParallelSpecDrafter.slot_target_features

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        super().__init__(config, shared, init_weights=False)
        d = self.hidden_size
        self.num_mask_tokens = int(self.config["num_mask_tokens"])
        if self.num_mask_tokens < 1:
            raise ValueError(f"drafter.num_mask_tokens must be >= 1, got {self.num_mask_tokens}")
        v = self.vocab_size
        mid = int(self.config["mask_token_id"])
        self.mask_token_id = v - 1 if mid == -1 else mid
        if not 0 <= self.mask_token_id < v:
            raise ValueError(f"drafter.mask_token_id must be -1 or in [0, {v}), got {mid}")
        self.mask_hidden = nn.Parameter(torch.zeros(NUM_AUX * d))  # [3d]: the fc input of every mask slot
        self.weights = group_position_weights(self.num_mask_tokens, float(self.config["loss_decay"]))
        if init_weights:
            self.reset_parameters(from_target=bool(self.config["init_from_target_layer"]))
        self._finish()

    @property
    def draft_depth(self) -> int:
        """K + 1: the last item's own guess and the K mask slots (one forward pass)."""
        return self.num_mask_tokens + 1

    @torch.no_grad()
    def reset_parameters(self, from_target: bool) -> None:
        """EAGLE-3's init (:meth:`Eagle3Drafter.reset_parameters`) and ``mask_hidden`` ~ N(0, 0.02)."""
        super().reset_parameters(from_target)
        self.mask_hidden.normal_(0.0, getattr(self.shared.model_config, "initializer_range", 0.02))

    def draft_inputs(self) -> torch.Tensor:
        """The K mask-slot inputs, all the same cat(e(mask_token_id), fc(mask_hidden)): [K, 2d]."""
        tok = torch.tensor([self.mask_token_id], device=self.mask_hidden.device)
        e = self.embed(tok).to(self.fc.weight.dtype)  # [1, d]
        g = self.combine(self.mask_hidden[None].to(self.fc.weight.dtype))  # [1, d]: mask_hidden is fc's input itself
        return torch.cat([e, g], dim=-1).expand(self.num_mask_tokens, -1)

    # -- training -------------------------------------------------------------------------------
    def forward_layout(self, items: torch.Tensor, lay: L.BatchLayout) -> torch.Tensor:
        """Hidden states h [b, s, d] over a batch layout: items [b, t, 2d] in place, the mask input in
        every mask slot."""
        b, t, w = items.shape
        idx = lay.slot_anchor.clamp(max=t - 1)  # [b, s]
        x = torch.gather(items, 1, idx[..., None].expand(-1, -1, w))  # [b, s, 2d]
        x = torch.where((lay.slot_kind > 0)[..., None], self.draft_inputs()[0].to(x.dtype), x)
        return self.decode(x, layout_mask(lay, x.dtype), lay.position_ids)

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                      objective: Objective | None = None) -> LossOutput:  # fmt: skip
        """The group loss (module docstring) over ParallelSpec's layout; metrics per parallel group.

        Batch keys: ``input_ids`` [b, L], ``loss_mask`` [b, L], ``lengths`` [b], ``features`` [b, L-1, F]
        (the layers :attr:`feature_layer_ids`). In eval mode every anchor is scored.

        ``objective`` (:class:`~drafttrain.drafters.base.Objective`; None = offline, forward KL): the divergence,
        Spec-AUF's cut after a group's first miss, and on-policy labels for the drafter's own drafts
        (:mod:`drafttrain.drafters.groups`; training mode only).
        """
        obj = objective or Objective()
        ids, feats = batch["input_ids"], batch["features"]
        t = ids.shape[1] - 1
        items = self.items(ids[:, 1:], feats[:, :t])  # [b, t, 2d]
        lay = self.layouts(batch, generator, ratio=None if self.training else 1.0)
        h = self.forward_layout(items, lay)  # [b, s, d]
        labels = lay.labels.clone()  # [b, s] target ids; on-policy relabels group positions 1..K
        valid = labels != L.IGNORE_INDEX  # [b, s]
        row, slots = parallel_group_slots(lay.slot_kind, lay.slot_anchor, lay.num_items, self.num_mask_tokens)
        with torch.no_grad():
            final_all = self.final_features(feats[:, :t])  # [b, t, d]
            final = final_all.new_zeros((*valid.shape, final_all.shape[-1]))  # [b, s, d] f_{a+k+1} per slot
            final[valid] = self.slot_target_features(lay, final_all, valid)
            scored = torch.zeros_like(valid)  # the label's full-vocabulary argmax is a draft id
            scored[valid] = self._argmax_in_vocab(final[valid], lay, valid, batch, final_all)
        sums: dict[str, torch.Tensor] = {}
        if obj.on_policy and self.training:
            anchor = lay.slot_anchor[row, slots[:, 0]] if row.numel() else row
            sums.update(label_own_drafts(self, h, row, slots, anchor, labels, valid, final, scored, obj, generator))
        sel = valid & scored  # slots that enter the loss
        logits = self.vocab_logits(self.predict_features(h[sel]))  # [m, N]
        div = divergence(logits, self.target_logits(final[sel]), obj.divergence)
        draft = self.target_to_draft(labels)
        correct = torch.zeros_like(valid)
        correct[sel] = logits.detach().argmax(-1) == draft[sel]
        slot_w = None
        if obj.cut_at_first_miss:
            slot_w = cut_weights(row, slots, correct, valid, scored, obj.cut_weight)[sel]
        loss, kl_sum, kl_count = weighted_position_mean(div, lay.slot_kind[sel], self.weights, slot_w)
        sums.update({"kl_sum": kl_sum, "kl_count": kl_count, **self._group_sums(lay, correct, valid)})
        return LossOutput(loss=loss, sums=sums, num_tokens=int((lay.slot_kind >= 0).sum()))

    @torch.no_grad()
    def _argmax_in_vocab(self, final: torch.Tensor, lay: L.BatchLayout, valid: torch.Tensor,
                         batch: dict[str, torch.Tensor], final_all: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """[m, d] the slots' target post-norm features f_{a+k+1} -> [m] bool: the target's full-vocabulary
        argmax is a draft id. The argmax is taken per item position, once per training row
        (:mod:`drafttrain.drafters.target_argmax`), and read at each slot's position a + k + 1."""
        if not self.restricted_vocab or not final.shape[0]:
            return torch.ones(final.shape[0], dtype=torch.bool, device=final.device)
        top_p = memo_of(self)(self.shared.lm_head, batch["input_ids"], batch["lengths"], final_all)  # [b, t]
        fidx = (lay.slot_anchor + lay.slot_kind.clamp_min(0) + 1)[valid]  # as slot_target_features
        bidx = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)[valid]
        return self.t2d.to(top_p.device)[top_p[bidx, fidx]]

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """One drafting forward: the n new items (appended to the cache) + K mask slots (cropped again).

        Args:
            next_ids: [1, n] int64 x_{i+1} of the new items; features: [1, n, F] their target features;
            cache: a transformers ``DynamicCache`` of the drafter's real items (updated in place).

        Returns:
            [1, K + 1, v] float32 logits over the target vocabulary (-inf outside the draft vocabulary):
            row 0 from the last item, row j from mask slot j.
        """
        n = next_ids.shape[1]
        x = torch.cat([self.items(next_ids, features), self.draft_inputs()[None]], dim=1)  # [1, n + K, 2d]
        pos, mask = L.inference_layout(n, self.num_mask_tokens, dtype=x.dtype, past=cache.get_seq_length(),
                                       device=x.device)  # fmt: skip
        h = self.decode(x, mask, pos, cache=cache, use_cache=True)
        cache.crop(-self.num_mask_tokens)
        return self.full_vocab_logits(self.vocab_logits(self.predict_features(h[:, n - 1 :])))
