"""Losses, one function per paper equation.

Shape letters: m labelled slots, v vocab, k group position (0 = the anchor item, 1..K = [MASK] slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_position_weights(num_mask_tokens: int, decay: float) -> list[float]:
    """Weights of ParallelSpec Eq. 3: 1 for the anchor item (k = 0) and lambda_k = decay**k for mask k.

    Example: K = 2, decay = 0.8 -> [1.0, 0.8, 0.64].
    """
    return [1.0] + [decay**k for k in range(1, num_mask_tokens + 1)]


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """-sum_x p(x) log q(x) per row, p = softmax(target_logits), q = softmax(logits): [m, v] x2 -> [m].

    The distillation term of ParallelSpec section 4.1 ("training a parallel drafter is a process of
    knowledge distillation", with access to the target's output distributions p(y_t)); DistillSpec
    (Zhou et al. 2024) for the forward-KL form. Equals KL(p || q) + H(p), so its gradient is KL's.
    """
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


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
    the target's distribution (:func:`soft_cross_entropy`).

    Args:
        logits: [m, v] float logits of the labelled slots.
        labels: [m] int64 (no -100 here: select labelled slots first).
        position: [m] int64 group position k in 0..K of each slot.
        weights: K + 1 weights from :func:`group_position_weights`.
        target_logits: [m, v] the target's logits for the token each slot guesses (or None).
        kd_weight: a in [0, 1].

    Returns:
        (loss scalar, ce_sum [K+1] per-position summed hard CE (detached), count [K+1] slots per position).
    """
    ce = F.cross_entropy(logits.float(), labels, reduction="none")  # [m]
    per_slot = ce
    if target_logits is not None and kd_weight > 0:
        per_slot = (1 - kd_weight) * ce + kd_weight * soft_cross_entropy(logits, target_logits)
    num_pos = len(weights)
    ce_sum = torch.zeros(num_pos, dtype=ce.dtype, device=ce.device).index_add_(0, position, ce.detach())
    loss_sum = torch.zeros(num_pos, dtype=ce.dtype, device=ce.device).index_add_(0, position, per_slot)
    count = torch.zeros(num_pos, dtype=ce.dtype, device=ce.device).index_add_(0, position, torch.ones_like(ce))
    w = torch.tensor(weights, dtype=ce.dtype, device=ce.device)
    loss = (w * loss_sum / count.clamp_min(1)).sum()
    return loss, ce_sum, count.detach()
