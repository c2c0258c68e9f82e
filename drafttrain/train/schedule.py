"""The learning-rate schedule: linear warm-up, then a cosine over steps or over training minutes.

Sources: the warm-up + cosine decay of EAGLE's and Medusa's released training code (per optimizer step);
``optim.decay_over=minutes`` lets a run bounded by ``trainer.max_minutes`` end its decay with its budget.
"""

from __future__ import annotations

import math

from drafttrain.config import TrainConfig


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_factor(step: int, train_seconds: float, c: TrainConfig) -> float:
    """The lr factor for optimizer step ``step`` (0-based) of run ``c``: :func:`lr_lambda` over
    ``trainer.max_steps`` (``optim.decay_over=steps``), or, with ``decay_over=minutes``, the same warm-up
    (steps) and a cosine whose progress is the training time spent, ``train_seconds / (60 * max_minutes)``:
    a run bounded by its time budget ends its decay when the budget ends, whatever its step rate."""
    o = c.optim
    if o.decay_over != "minutes" or step < o.warmup_steps:
        return lr_lambda(step, o.warmup_steps, c.trainer.max_steps, o.min_lr_ratio)
    progress = min(1.0, train_seconds / (60.0 * c.trainer.max_minutes))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_schedule_lr(optimizer, base_lrs: list[float], step: int, c: TrainConfig, train_seconds: float = 0.0) -> None:
    """Set every param group's lr to the schedule's value for the next step (after a resume, and after
    every step under ``optim.decay_over=minutes``): :func:`schedule_factor` of the *current*
    ``trainer.max_steps`` / ``max_minutes``, which a resume may have changed."""
    factor = schedule_factor(step, train_seconds, c)
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * factor
