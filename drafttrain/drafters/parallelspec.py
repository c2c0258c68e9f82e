"""ParallelSpec [MASK]-token parallel drafter, Medusa integration (ParallelSpec paper section 4.1, 4.3, Eq. 3).

One decoder layer with the target's hyper-parameters reads the items u_i = fc([e(x_{i+1}); f_i])
(docs/design.md, "Definitions"; :mod:`drafttrain.drafters.feature_layer`) and K learned [MASK] input vectors; the
target's final norm and LM head, shared and frozen, turn its outputs into distributions. One forward
pass over the context items plus K mask slots drafts K + 1 tokens: the anchor item's output guesses
x_{n+1}, mask slot j guesses x_{n+1+j} (Fig. 2 left). Training uses the group-wise layout
(:mod:`drafttrain.layout`) and Eq. 3.

Shape letters: b batch, t items, s layout slots, k mask tokens, d hidden, v vocab, N draft vocab.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from drafttrain import layout as L
from drafttrain.attention import layout_mask
from drafttrain.drafters.base import LAST_LAYER, DrafterSpec, LossOutput, SharedTargetModules
from drafttrain.drafters.feature_layer import FeatureLayerDrafter
from drafttrain.losses import group_position_weights, parallel_group_loss
from drafttrain.metrics import empty_group_sums, group_acceptance_sums


class ParallelSpecDrafter(FeatureLayerDrafter):
    """ParallelSpec drafter (Medusa integration).

    Config keys: ``num_mask_tokens`` (K, default 4), ``loss_decay`` (lambda_k = decay**k, default 0.8),
    ``anchor_ratio`` (training anchor subsample, default 1.0; eval mode scores every anchor),
    ``init_from_target_layer`` (copy the target's last decoder layer as the starting point),
    ``fc_bias``, ``draft_vocab_size`` (0 = the target's full vocabulary; N > 0 = the drafter only
    proposes the N token ids ``draft_token_ids`` (buffers ``d2t`` / ``t2d``), a row subset of the frozen LM head, as in EAGLE-3; set
    them with :meth:`set_draft_vocab`), ``kd_weight`` (mix of the target's soft distribution into Eq. 3's
    CE; the target's logits for the token at position t are LM head(f_{t-1}), read from the batch's
    features, so they cost no target forward).

    Trainable parameters: fc (2d x d [+ d]), one decoder layer, K mask vectors [K, d].

    Inference: :meth:`propose` (one forward pass, K + 1 draft rows) for chains. Lower level, for tree /
    batched proposers: :meth:`forward_inputs` over ``torch.cat([self.items(ids, f), self.mask_embed[None]], 1)``
    with positions and mask from :func:`drafttrain.layout.inference_layout` (or any explicit ones).
    """

    name = "parallelspec"
    serving_formats = {}  # no engine runs mask-token drafting over its fc([e; f]) item layer
    objective_refusal = ("ParallelSpec's Medusa integration (Eq. 3) has no group objective path yet; the main job's "
                         "parallelspec recipe (the EAGLE-3 network) and dflash train on-policy")
    spec = DrafterSpec(drafting="parallel", feature_layers=(LAST_LAYER,), step_input="items", batched=True)
    defaults = {
        "num_mask_tokens": 4,
        "loss_decay": 0.8,
        "anchor_ratio": 1.0,
        "init_from_target_layer": True,
        "fc_bias": True,
        "draft_vocab_size": 0,
        "kd_weight": 0.0,
    }

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        super().__init__(config, shared)
        d = self.fc.out_features
        self.num_mask_tokens = int(self.config["num_mask_tokens"])
        self.mask_embed = nn.Parameter(torch.zeros(self.num_mask_tokens, d))  # [k, d]
        self.weights = self.position_weights()
        self._init_draft_vocab(self.config["draft_vocab_size"])
        if init_weights:
            self.reset_parameters(from_target=bool(self.config["init_from_target_layer"]))
        self._finish()

    @property
    def draft_depth(self) -> int:
        """K + 1: the anchor's own next token and the K mask slots (one forward pass)."""
        return self.num_mask_tokens + 1

    def draft_inputs(self) -> torch.Tensor:
        """The K learned [MASK] inputs that follow the items in a drafting forward: [K, d]."""
        return self.mask_embed

    def position_weights(self) -> list[float]:
        """Weights of the K + 1 group positions in the loss (Eq. 3: 1, lambda_1..lambda_K)."""
        return group_position_weights(self.num_mask_tokens, float(self.config["loss_decay"]))

    @torch.no_grad()
    def reset_parameters(self, from_target: bool) -> None:
        """fc = [noise | I], mask vectors ~ N(0, 0.02), layer = the target's last layer (or a fresh init)."""
        std = getattr(self.shared.model_config, "initializer_range", 0.02)
        self._reset_fc()
        self.mask_embed.normal_(0.0, std)
        self._reset_layer(from_target)

    # -- training -------------------------------------------------------------------------------
    def layouts(
        self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None, ratio: float | None = None
    ) -> L.BatchLayout:
        """Group-wise layouts of a batch (labels from ``input_ids``/``loss_mask``, anchors subsampled with
        ``ratio``, default the config's ``anchor_ratio``)."""
        ratio = float(self.config["anchor_ratio"]) if ratio is None else ratio
        per_seq = []
        for i in range(batch["input_ids"].shape[0]):
            n = int(batch["lengths"][i])
            labels = L.item_labels(batch["input_ids"][i, :n], batch["loss_mask"][i, :n])
            anchors = L.select_anchors(labels, self.num_mask_tokens, ratio, generator)
            per_seq.append(L.build_group_layout(labels, anchors, self.num_mask_tokens))
        return L.collate_layouts(per_seq, dtype=self.fc.weight.dtype, dense=self.attention == "dense")

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
        return self.decode(x, layout_mask(lay, x.dtype), lay.position_ids)

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        """The group loss (:meth:`group_loss`) over the group-wise layout of a batch.

        Batch keys: ``input_ids`` [b, L] int64 (right-padded), ``loss_mask`` [b, L], ``lengths`` [b],
        ``features`` [b, L-1, d] (f_0..f_{L-2}). In eval mode every anchor is scored (held-out metrics).
        """
        ids, feats = batch["input_ids"], batch["features"]
        t = ids.shape[1] - 1
        items = self.items(ids[:, 1:], self.noisy(feats[:, :t], generator))  # [b, t, d]
        lay = self.layouts(batch, generator, ratio=None if self.training else 1.0)
        hidden = self.forward_layout(items, lay)  # [b, s, d]
        valid = lay.labels != L.IGNORE_INDEX  # [b, s] slots with a label
        draft_labels = self.target_to_draft(lay.labels)  # -1: label outside the draft vocabulary
        sel = valid & (draft_labels >= 0)  # slots that enter the CE
        loss, logits, sums = self.group_loss(hidden, lay, feats, valid, sel, draft_labels)
        # out-of-vocabulary labels stay valid for the metrics: the drafter can never propose them
        correct = torch.zeros_like(lay.labels, dtype=torch.bool)
        correct[sel] = logits.argmax(-1) == draft_labels[sel]
        sums.update(self._group_sums(lay, correct, valid))
        return LossOutput(loss=loss, sums=sums, num_tokens=int((lay.slot_kind >= 0).sum()))

    def slot_target_features(self, lay: L.BatchLayout, feats: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """The target's features f_{a+j+1} of the selected slots (mask j of anchor a; items: j = 0): [m, d].

        f_{a+j+1} is the feature whose LM head gives the slot's label x_{a+j+2}: the target's soft
        distribution (``kd_weight``) and EAGLE's regression target. Valid labels keep the index < t.
        """
        fidx = (lay.slot_anchor + lay.slot_kind.clamp_min(0) + 1)[sel]  # [m]
        bidx = torch.arange(sel.shape[0], device=sel.device)[:, None].expand_as(sel)[sel]  # [m]
        return feats[bidx, fidx]

    def group_loss(self, hidden, lay: L.BatchLayout, feats, valid, sel, draft_labels):
        """Eq. 3 on the selected slots. Returns (loss, logits of the ``sel`` slots [m, N], sums dict)."""
        logits = self.logits(hidden[sel])  # [m, N]
        kd = float(self.config["kd_weight"])
        t_logits = self.target_logits(self.slot_target_features(lay, feats, sel)) if kd > 0 else None
        loss, ce_sum, ce_count = parallel_group_loss(logits, draft_labels[sel], lay.slot_kind[sel], self.weights,
                                                     t_logits, kd)  # fmt: skip
        return loss, logits, {"ce_sum": ce_sum, "ce_count": ce_count}

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
            return empty_group_sums(k + 1, device=valid.device)
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
        pos, mask = L.inference_layout(n, self.num_mask_tokens, dtype=u.dtype, past=past, device=u.device)
        h = self.decode(x, mask, pos, cache=cache, use_cache=True)
        cache.crop(-self.num_mask_tokens)  # transformers 5: negative = tokens to remove
        return self.full_vocab_logits(self.logits(h[:, n - 1 :]))
