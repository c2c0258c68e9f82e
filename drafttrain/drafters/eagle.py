"""EAGLE feature regressor (Li et al. 2024, "EAGLE: Speculative sampling requires rethinking feature
uncertainty", sections 4.1-4.2; ParallelSpec paper Eq. 4).

Items u_i = fc([e(x_{i+1}); f_i]) run causally through one decoder layer of the target's class
(:mod:`drafttrain.drafters.feature_layer`); its output, through the target's frozen final norm, is the
predicted next feature f^_i ~ f_{i+1}, and the frozen LM head on f^_i gives the distribution of
x_{i+2} = y_i. Training (teacher forcing, inputs f_i + U(-0.1, 0.1) noise):

    L = w_reg * SmoothL1(f_{i+1}, f^_i) + w_cls * CE(LM head(f^_i), x_{i+2}),   w_reg = 1, w_cls = 0.1.

Drafting is autoregressive: after the items of a verification step, each further token comes from
feeding (draft token, predicted feature) back in as the next item, so a chain of depth D costs D
drafter forwards (the cost ParallelSpec removes).

Metrics: acc_k / cond_acc_k / tau_sim are those of the greedy chain the drafter would really draft,
measured by a rollout (EAGLE's released code measures its k-step accuracy the same way): from each
scored anchor a, step j feeds the true token x_{a+j+1} (the draft token whenever the chain is still
right, which is all tau_sim needs) with the drafter's own predicted feature from step j - 1, batched
over anchors with :func:`drafttrain.layout.chain_rollout_layout`. The rollout is forward-only on a
random ``anchor_ratio`` share of the positions in training and on every position in eval mode.

Shape letters: b batch, t items, n anchors, D draft depth, d hidden, v vocab, N draft vocab.
"""

from __future__ import annotations

from typing import Any

import torch

from drafttrain import layout as L
from drafttrain.drafters.base import LAST_LAYER, DrafterSpec, LossOutput, SharedTargetModules
from drafttrain.drafters.feature_layer import FeatureLayerDrafter
from drafttrain.losses import eagle_group_loss
from drafttrain.metrics import empty_group_sums, group_acceptance_sums


class EagleDrafter(FeatureLayerDrafter):
    """EAGLE(-1) drafter: fc + one decoder layer, feature regression + classification, chain drafting.

    Config keys: ``draft_depth`` (D, tokens drafted per verification step, default 5), ``reg_weight``
    (w_reg, 1.0), ``cls_weight`` (w_cls, 0.1), ``feature_noise`` (a of the U(-a, a) training noise on the
    input features, 0.1), ``anchor_ratio`` (share of positions the training-time metric rollout starts
    from; it does not change the loss), ``init_from_target_layer``, ``fc_bias``, ``draft_vocab_size``,
    ``kd_weight`` (mix of the target's soft distribution LM head(f_{i+1}) into the CE; EAGLE's released
    code uses the soft form only, i.e. 1.0; the paper's Eq. 4 writes the hard label, 0.0).

    Trainable parameters: fc (2d x d [+ d]) and one decoder layer.

    Inference: :meth:`propose` (greedy chain, D rows). Lower level, for tree proposers:
    :meth:`draft_step` (items -> draft-vocabulary logits + predicted features with explicit positions,
    4D mask and cache) to expand a tree level by level, feeding each node's (token, predicted feature).
    """

    name = "eagle"
    serving_formats = {"vllm_eagle": "eagle"}  # only the variant vLLM's EAGLE-1 network computes (checked on export)
    objective_refusal = ("EAGLE regresses the target's next feature; on its own drafts it would need the target's "
                         "features along every draft chain, which its loss does not read yet (eagle3, parallelspec and "
                         "dflash train on-policy)")
    spec = DrafterSpec(drafting="autoregressive", feature_layers=(LAST_LAYER,), step_input="items", batched=True)
    defaults = {
        "draft_depth": 5,
        "reg_weight": 1.0,
        "cls_weight": 0.1,
        "feature_noise": 0.1,
        "anchor_ratio": 1.0,
        "init_from_target_layer": True,
        "fc_bias": True,
        "draft_vocab_size": 0,
        "kd_weight": 0.0,
    }

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        super().__init__(config, shared)
        if int(self.config["draft_depth"]) < 1:
            raise ValueError(f"draft_depth must be >= 1, got {self.config['draft_depth']}")
        self._init_draft_vocab(self.config["draft_vocab_size"])
        if init_weights:
            self.reset_parameters(from_target=bool(self.config["init_from_target_layer"]))
        self._finish()

    @property
    def draft_depth(self) -> int:
        """D: the chain :meth:`propose` drafts (D drafter forwards)."""
        return int(self.config["draft_depth"])

    @torch.no_grad()
    def reset_parameters(self, from_target: bool) -> None:
        """fc = [noise | I], layer = the target's last layer (or a fresh init)."""
        self._reset_fc()
        self._reset_layer(from_target)

    # -- training -------------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        """Eq. 4 over every labelled item (teacher forcing), plus the rollout metrics.

        Batch keys: ``input_ids`` [b, L] int64 (right-padded), ``loss_mask`` [b, L], ``lengths`` [b],
        ``features`` [b, L-1, d] (f_0..f_{L-2}). Item i is scored where its label y_i = x_{i+2} has the
        loss mask on; its regression target is f_{i+1} (then i + 1 < t).
        """
        from transformers import DynamicCache

        ids, feats = batch["input_ids"], batch["features"]
        b, t = ids.shape[0], ids.shape[1] - 1
        labels = L.batch_item_labels(ids, batch["loss_mask"], batch["lengths"])  # [b, t]
        u = self.items(ids[:, 1:], self.noisy(feats[:, :t], generator))  # [b, t, d]
        pos, mask = L.inference_layout(t, 0, dtype=u.dtype, device=u.device)  # causal; padding never seen
        cache = DynamicCache()  # keeps the items' keys/values for the metric rollout
        h = self.decode(u, mask.expand(b, -1, -1, -1), pos.expand(b, -1), cache=cache, use_cache=True)
        fhat = self.predict_features(h)  # [b, t, d]
        valid = labels != L.IGNORE_INDEX
        draft = self.target_to_draft(labels)
        sel = valid & (draft >= 0)
        f_next = torch.cat([feats[:, 1:t], feats.new_zeros((b, 1, feats.shape[-1]))], dim=1)  # [b, t, d] f_{i+1}
        logits = self.vocab_logits(fhat[sel])  # [m, N]
        kd = float(self.config["kd_weight"])
        zeros_v = torch.zeros(int(valid.sum()), dtype=torch.long, device=ids.device)
        loss, sums = eagle_group_loss(
            fhat[valid], f_next[valid].to(fhat.dtype), zeros_v, logits, draft[sel], zeros_v[: logits.shape[0]],
            [1.0], float(self.config["reg_weight"]), float(self.config["cls_weight"]),
            self.target_logits(f_next[sel]) if kd > 0 else None, kd,
        )  # fmt: skip
        with torch.no_grad():
            sums.update(self._rollout_sums(fhat.detach(), cache, labels, generator))
        return LossOutput(loss=loss, sums=sums, num_tokens=int((batch["lengths"] - 1).clamp_min(0).sum()))

    def _rollout_sums(self, fhat, cache, labels, generator) -> dict[str, torch.Tensor]:
        """acc_k / cond_acc_k / tau_sim sums of the greedy chains from the scored anchors (module docstring)."""
        ratio = float(self.config["anchor_ratio"]) if self.training else 1.0
        per_seq = [L.subsample(torch.nonzero(labels[i] != L.IGNORE_INDEX).flatten(), ratio, generator)
                   for i in range(labels.shape[0])]  # fmt: skip
        n = max((a.numel() for a in per_seq), default=0)
        if n == 0:
            return empty_group_sums(self.draft_depth, device=labels.device)
        anchors = torch.full((labels.shape[0], n), -1, dtype=torch.long, device=labels.device)
        for i, a in enumerate(per_seq):
            anchors[i, : a.numel()] = a
        group = L.shifted_labels(labels, self.draft_depth)  # [b, t, D]
        glabels = torch.gather(group, 1, anchors.clamp_min(0)[..., None].expand(-1, -1, self.draft_depth))
        glabels = glabels.masked_fill((anchors < 0)[..., None], L.IGNORE_INDEX)  # [b, n, D]
        logits = self.rollout_logits(fhat, cache, anchors, glabels[..., :-1].clamp_min(0))  # [b, n, D, N]
        draft = self.target_to_draft(glabels)
        valid = glabels != L.IGNORE_INDEX
        correct = (logits.argmax(-1) == draft) & (draft >= 0)
        real = anchors >= 0
        return group_acceptance_sums(correct[real], valid[real])

    def rollout_logits(self, fhat, cache, anchors: torch.Tensor, feed: torch.Tensor) -> torch.Tensor:
        """Chain rollout from many anchors at once (the batched form of :meth:`propose`'s loop).

        Args:
            fhat: [b, t, d] predicted features of the t items (their keys/values are in ``cache``).
            cache: a transformers ``Cache`` holding exactly the t items (extended here by n per step).
            anchors: [b, n] int64 anchor items, right-padded with -1.
            feed: [b, n, D-1] int64 target token ids fed at steps 1..D-1 (step j's item is
                (feed[..., j-1], f^ of step j-1)); the true tokens for metrics, the greedy drafts to
                reproduce :meth:`propose`.

        Returns:
            [b, n, D, N] float32 draft-vocabulary logits: step 0 from the anchor item, step j from the
            j-th fed item.
        """
        b, t, d = fhat.shape
        f = torch.gather(fhat, 1, anchors.clamp_min(0)[..., None].expand(-1, -1, d))  # [b, n, d]
        out = [self.vocab_logits(f)]
        for j in range(1, feed.shape[-1] + 1):
            pos, mask = L.chain_rollout_layout(anchors, t, j, dtype=f.dtype)
            logits, f = self.draft_step(feed[..., j - 1], f, pos, mask, cache)
            out.append(logits)
        return torch.stack(out, dim=2)

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """Greedy chain drafting (EAGLE's autoregressive drafting with a chain instead of a tree).

        Appends the n new items to the drafter's KV cache, then drafts D tokens one drafter forward at a
        time: step j's item is (argmax token of step j - 1, predicted feature of step j - 1). The D - 1
        speculative items are cropped from the cache before returning, so the cache again holds exactly
        the real items (the next call brings the accepted tokens with the target's true features).

        Args:
            next_ids: [1, n] int64 x_{i+1} of the n new items (the accepted tokens and the bonus token).
            features: [1, n, d] target features f_i of those items.
            cache: a transformers ``DynamicCache`` holding the drafter's past items (updated in place).

        Returns:
            [1, D, v] float32 logits over the target vocabulary (-inf outside a restricted draft
            vocabulary): row j guesses the (j + 1)-th token after the last item's x_{i+1}; row j + 1 is
            conditioned on row j's argmax.
        """
        n = next_ids.shape[1]
        past = cache.get_seq_length()
        dtype, device = self.dtype, next_ids.device
        pos, mask = L.inference_layout(n, 0, dtype=dtype, past=past, device=device)
        logits, f = self.draft_step(next_ids, features, pos, mask, cache)
        rows = [self.full_vocab_logits(logits[:, -1])]  # [1, v]
        f = f[:, -1:]
        for _ in range(1, self.draft_depth):
            token = rows[-1].argmax(-1, keepdim=True)  # [1, 1] target id
            pos, mask = L.inference_layout(1, 0, dtype=dtype, past=cache.get_seq_length(), device=device)
            logits, f = self.draft_step(token, f, pos, mask, cache)
            rows.append(self.full_vocab_logits(logits[:, -1]))
        cache.crop(-(self.draft_depth - 1))  # drop the speculative items (crop(0) is a no-op)
        return torch.stack(rows, dim=1)

