"""Losses, one function per paper equation.

- :func:`parallel_group_loss`: ParallelSpec Eq. 3 (and, with the anchor weight left out, Medusa's Eq. 2);
- :func:`forward_kl`: EAGLE-3's training-time-test term, per TTT step;
- :func:`reverse_kl`, :func:`js_divergence` (:func:`divergence` picks one by ``loss.divergence``);
- :func:`after_first_miss`: Spec-AUF's cut of a group's positions after its first predicted miss;
- :func:`eagle_group_loss`: EAGLE's objective (ParallelSpec Eq. 4) summed over group positions
  (ParallelSpec section 4.3, EAGLE integration; a single position is plain EAGLE).

Every loss averages per-slot terms within a group position k and sums the positions with weights, so
a position's weight does not depend on how many slots it has in a batch.

Shape letters: m labelled slots, d hidden, v vocab, k group position (0 = the anchor item, 1..K = [MASK]
slots; for Medusa, k = head index - 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_position_weights(num_mask_tokens: int, decay: float) -> list[float]:
    """Weights of ParallelSpec Eq. 3: 1 for the anchor item (k = 0) and lambda_k = decay**k for mask k.

    Medusa's Eq. 2 weights (lambda_k = 0.8**k for heads k = 1..K, Cai et al. 2024 section 2.3.1) are
    this list without its first entry.

    Example: K = 2, decay = 0.8 -> [1.0, 0.8, 0.64].
    """
    return [1.0] + [decay**k for k in range(1, num_mask_tokens + 1)]


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """-sum_x p(x) log q(x) per row, p = softmax(target_logits), q = softmax(logits): [m, v] x2 -> [m].

    The distillation term of ParallelSpec section 4.1 ("training a parallel drafter is a process of
    knowledge distillation", with access to the target's output distributions p(y_t)); DistillSpec
    (Zhou et al. 2024) for the forward-KL form. Equals KL(p || q) + H(p), so its gradient is KL's.
    EAGLE's released training code uses this soft form for its classification loss.
    """
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def forward_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_x p(x) (log p(x) - log q(x)) per row, p = softmax(target_logits), q = softmax(logits):
    [m, v] x2 -> [m] float32 (0 where p == q).

    EAGLE-3's training-time-test objective (Li et al. 2025, section 3.2; the peers' ``kl_div_loss``): the
    soft cross-entropy of :func:`soft_cross_entropy` minus the target's entropy, so the value reads as a
    distance and its gradient in ``logits`` is the soft CE's.
    """
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    return (logp.exp() * (logp - torch.log_softmax(logits.float(), dim=-1))).sum(-1)


def reverse_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(q || p) = sum_x q(x) (log q(x) - log p(x)) per row: [m, v] x2 -> [m] float32 (q = the drafter's).

    Mode-seeking: the drafter puts its mass where the target's is, and is not pulled toward covering the
    target's tail (the reverse-KL objective of on-policy distillation, Gu et al. 2024, "MiniLLM"; DistillSpec,
    Zhou et al. 2024, compares the directions for drafters).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    return (logq.exp() * (logq - torch.log_softmax(target_logits.float(), dim=-1))).sum(-1)


def js_divergence(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2, per row: [m, v] x2 -> [m]
    float32, in nats, bounded by log 2 (one of the divergences DistillSpec, Zhou et al. 2024, compares)."""
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    logq = torch.log_softmax(logits.float(), dim=-1)
    logm = torch.logsumexp(torch.stack([logp, logq]), dim=0) - torch.log(torch.tensor(2.0, device=logp.device))
    return 0.5 * (logp.exp() * (logp - logm)).sum(-1) + 0.5 * (logq.exp() * (logq - logm)).sum(-1)


#: ``loss.divergence`` name -> per-row distance between the drafter's logits and the target's.
DIVERGENCE_FNS = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "js": js_divergence}


def divergence(logits: torch.Tensor, target_logits: torch.Tensor, name: str = "forward_kl") -> torch.Tensor:
    """The ``loss.divergence`` ``name`` between the target's p = softmax(target_logits) and the drafter's q:
    [m, v] x2 -> [m] float32 (:func:`forward_kl`, :func:`reverse_kl` or :func:`js_divergence`).

    Raises:
        ValueError: an unknown name.
    """
    fn = DIVERGENCE_FNS.get(name)
    if fn is None:
        raise ValueError(f"unknown divergence {name!r}; known: {sorted(DIVERGENCE_FNS)}")
    return fn(logits, target_logits)


def after_first_miss(correct: torch.Tensor, valid: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Spec-AUF's cut (arXiv 2607.01893: the loss stops after the drafter's first predicted miss in a group,
    since chain verification never accepts a draft after a rejected one): which group positions lie after a miss.

    Args:
        correct: [g, P] bool, the drafter's argmax equals the position's label.
        valid: [g, P] bool, the position has a label (unlabelled positions are neither hits nor misses).
        scored: [g, P] bool, the position's label can be drafted at all (inside the draft vocabulary); a
            labelled position that cannot be drafted is a miss.

    Returns:
        [g, P] bool: True at position k when some labelled position < k is a miss. The first miss itself is
        never cut: it is the position the drafter must learn.

    Example: correct [[1, 0, 1, 0]], all valid and scored -> [[False, False, True, True]].
    """
    miss = valid & ~(correct & scored)
    before = torch.cumsum(miss.long(), dim=1) - miss.long()  # misses strictly before k
    return before > 0


def weighted_position_mean(
    values: torch.Tensor, position: torch.Tensor, weights: list[float], slot_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_k w_k * mean{values of the slots at position k} (positions with no slot add 0, not NaN).

    Args:
        values: [m] float per-slot loss terms.
        position: [m] int64 group position of each slot, in [0, len(weights)).
        weights: one weight per position.
        slot_weights: [m] float per-slot weights (Spec-AUF's cut: :func:`after_first_miss`); the mean at a
            position is then sum(w_slot * value) / sum(w_slot), so a slot of weight 0 leaves the mean.

    Returns:
        (loss scalar, per-position (weighted) sums [P] (detached), per-position (weighted) counts [P]).
    """
    num_pos = len(weights)
    sw = torch.ones_like(values) if slot_weights is None else slot_weights.to(values.dtype)
    total = torch.zeros(num_pos, dtype=values.dtype, device=values.device).index_add_(0, position, values * sw)
    count = torch.zeros(num_pos, dtype=values.dtype, device=values.device).index_add_(0, position, sw)
    w = torch.tensor(weights, dtype=values.dtype, device=values.device)
    loss = (w * total / count.clamp_min(1)).sum()
    return loss, total.detach(), count.detach()


def parallel_group_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position: torch.Tensor,
    weights: list[float],
    target_logits: torch.Tensor | None = None,
    kd_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ParallelSpec Eq. 3 (Medusa integration): -log q(y_{t+1}) - sum_k lambda_k log q(y_{t+k+1} | ..., MASK_1..k).

    Each group position's loss is averaged over its labelled slots, then the positions are summed
    with their weights (positions with no labelled slot add 0). With ``kd_weight`` = a > 0 and the
    target's logits for the same slots, each slot's term is (1 - a) * CE(label) + a * soft CE against
    the target's distribution (:func:`soft_cross_entropy`). With positions = Medusa heads and weights
    lambda_1..lambda_K this is Medusa's Eq. 2.

    Args:
        logits: [m, v] float logits of the labelled slots.
        labels: [m] int64 (no -100 here: select labelled slots first).
        position: [m] int64 group position k in 0..len(weights)-1 of each slot.
        weights: one weight per position, e.g. K + 1 from :func:`group_position_weights`.
        target_logits: [m, v] the target's logits for the token each slot guesses (or None).
        kd_weight: a in [0, 1].

    Returns:
        (loss scalar, ce_sum [P] per-position summed hard CE (detached), count [P] slots per position).
    """
    ce = F.cross_entropy(logits.float(), labels, reduction="none")  # [m]
    per_slot = ce
    if target_logits is not None and kd_weight > 0:
        per_slot = (1 - kd_weight) * ce + kd_weight * soft_cross_entropy(logits, target_logits)
    loss, _, count = weighted_position_mean(per_slot, position, weights)
    ce_sum = torch.zeros(len(weights), dtype=ce.dtype, device=ce.device).index_add_(0, position, ce.detach())
    return loss, ce_sum, count


def feature_regression(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """EAGLE's L_reg per slot: SmoothL1(f_{t+1}, f^_t) (beta = 1) averaged over the hidden dimension: [m, d] x2 -> [m].

    ParallelSpec Eq. 4 (first line); Li et al. 2024 (EAGLE) section 4.2. The mean over d and then over
    slots is the reduction of EAGLE's released training code.
    """
    return F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)


def eagle_group_loss(
    predicted: torch.Tensor,
    target: torch.Tensor,
    reg_position: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    cls_position: torch.Tensor,
    weights: list[float],
    reg_weight: float = 1.0,
    cls_weight: float = 0.1,
    target_logits: torch.Tensor | None = None,
    kd_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE's loss w_reg * L_reg + w_cls * L_cls (ParallelSpec Eq. 4), summed over group positions.

    Plain EAGLE (Li et al. 2024) has one position (weights [1.0]); the EAGLE integration of ParallelSpec
    (section 4.3) sums "the EAGLE losses over the tokens within the same group", i.e. one position per
    group slot, weights all 1. L_reg is averaged over the slots with a regression target, L_cls over
    the slots whose label is inside the draft vocabulary (the two sets differ only under a restricted
    draft vocabulary). Defaults w_reg = 1.0, w_cls = 0.1 are EAGLE's (its released ``v_w``, ``p_w``).

    Args:
        predicted: [m, d] predicted features f^ (post-norm).
        target: [m, d] the target's next features f_{t+1}.
        reg_position: [m] int64 group position of each regression slot.
        logits: [m', v] LM-head logits of the predicted features of the classification slots.
        labels: [m'] int64 labels (no -100).
        cls_position: [m'] int64 group positions of the classification slots.
        weights: one weight per group position.
        reg_weight, cls_weight: w_reg, w_cls.
        target_logits: [m', v] the target's logits for the same tokens, for ``kd_weight`` (see
            :func:`parallel_group_loss`); EAGLE's released code uses kd_weight = 1 (soft CE only).
        kd_weight: a in [0, 1].

    Returns:
        (loss scalar, dict with ``ce_sum``/``ce_count`` and ``reg_sum``/``reg_count``, each [P], detached).
    """
    reg = feature_regression(predicted, target)  # [m]
    reg_loss, reg_sum, reg_count = weighted_position_mean(reg, reg_position, weights)
    cls_loss, ce_sum, ce_count = parallel_group_loss(logits, labels, cls_position, weights, target_logits, kd_weight)
    loss = reg_weight * reg_loss + cls_weight * cls_loss
    return loss, {"ce_sum": ce_sum, "ce_count": ce_count, "reg_sum": reg_sum, "reg_count": reg_count}
