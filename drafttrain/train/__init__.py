"""Training a drafter: the loop, its schedule, checkpoints, tracking, distribution, and training strategies.

- :mod:`drafttrain.train.loop`: :func:`run` (what ``train.py`` calls), the run's stages and the step loop;
- :mod:`drafttrain.strategies`: how a batch becomes a loss (``trainer.strategy``: offline rows, the
  drafter's own drafts labelled by the target, or a mix); the loop calls a strategy and nothing else;
- :mod:`drafttrain.train.schedule`, :mod:`drafttrain.train.checkpoint`: lr schedule; saves, resume checks;
- :mod:`drafttrain.train.distributed`, :mod:`drafttrain.train.tracking`, :mod:`drafttrain.eval.wandb_offline`:
  accelerate / DeepSpeed set-up, W&B tables, reading offline W&B runs;
- :mod:`drafttrain.train.decision_model`: the MCSD decision model's own small training job.

The trainer's evaluation is :mod:`drafttrain.eval.in_training` (train calls eval, never the reverse).
"""

from drafttrain.train.checkpoint import (
    CHECKPOINTS,
    COMPLETE,
    RESUME_MAY_CHANGE,
    TrainState,
    check_resume,
    fault_point,
    latest_checkpoint,
    remove_incomplete_checkpoints,
    replace_dir,
    resume_mismatch,
    save_checkpoint,
)
from drafttrain.train.loop import budget_line, compose_config, export_for_serving, run
from drafttrain.train.schedule import lr_lambda, schedule_factor, set_schedule_lr

__all__ = [
    "CHECKPOINTS",
    "COMPLETE",
    "RESUME_MAY_CHANGE",
    "TrainState",
    "budget_line",
    "check_resume",
    "compose_config",
    "export_for_serving",
    "fault_point",
    "latest_checkpoint",
    "lr_lambda",
    "remove_incomplete_checkpoints",
    "replace_dir",
    "resume_mismatch",
    "run",
    "save_checkpoint",
    "schedule_factor",
    "set_schedule_lr",
]
