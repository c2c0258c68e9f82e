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


def parallel_group_loss(
    logits: torch.Tensor, labels: torch.Tensor, position: torch.Tensor, weights: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ParallelSpec Eq. 3 (Medusa integration): -log q(y_{t+1}) - sum_k lambda_k log q(y_{t+k+1} | ..., MASK_1..k).

    Each group position's cross-entropy is averaged over its labelled slots, then the positions are
    summed with their weights (positions with no labelled slot add 0).

    Args:
        logits: [m, v] float logits of the labelled slots.
        labels: [m] int64 (no -100 here: select labelled slots first).
        position: [m] int64 group position k in 0..K of each slot.
        weights: K + 1 weights from :func:`group_position_weights`.

    Returns:
        (loss scalar, ce_sum [K+1] per-position summed CE (detached), count [K+1] slots per position).
    """
    ce = F.cross_entropy(logits.float(), labels, reduction="none")  # [m]
    num_pos = len(weights)
    ce_sum = torch.zeros(num_pos, dtype=ce.dtype, device=ce.device).index_add_(0, position, ce)
    count = torch.zeros(num_pos, dtype=ce.dtype, device=ce.device).index_add_(0, position, torch.ones_like(ce))
    w = torch.tensor(weights, dtype=ce.dtype, device=ce.device)
    loss = (w * ce_sum / count.clamp_min(1)).sum()
    return loss, ce_sum.detach(), count.detach()
