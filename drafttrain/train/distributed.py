"""How the training loop meets accelerate and DeepSpeed: process group, DeepSpeed config, ZeRO-3 export.

One loop (:mod:`drafttrain.train`) runs unchanged on one CPU process, several CPU processes (DDP over
gloo), GPUs (DDP over NCCL) and DeepSpeed ZeRO-2/3 on either. The launcher decides which
(``accelerate launch --config_file conf/accelerate/NAME.yaml``); this module turns that choice into
the right :class:`accelerate.Accelerator` and keeps the DeepSpeed config consistent with the trainer
config. Decisions, each seen to matter on these machines (docs/design.md, "Platform notes"):

- ``Accelerator(cpu=True)`` on a machine without CUDA, or several launched processes each train
  alone; but ``cpu=True`` also turns DeepSpeed off, so under a DeepSpeed launch it stays False and
  ``InitProcessGroupKwargs(backend="gloo")`` picks the CPU backend (without it DeepSpeed fails with a
  misleading ``train_batch_size is not equal to ...``).
- ``step_scheduler_with_optimizer=False``: accelerate otherwise steps the LR scheduler once *per
  process* at every optimizer step, so a 2-process run would warm up and decay twice as fast as a
  1-process run with the same global batch.
- Gradient accumulation goes through ``Accelerator(gradient_accumulation_steps=...)`` and
  ``accelerator.accumulate``: accelerate divides the loss by the number of micro-steps (DeepSpeed's
  engine does it itself, by its own ``gradient_accumulation_steps``) and DeepSpeed steps its engine
  only at the accumulation boundary.
- The DeepSpeed JSON presets (``conf/deepspeed/*.json``) say ``"auto"`` for micro batch size,
  accumulation, clipping and precision; :func:`configure_deepspeed` fills them from the trainer
  config and refuses explicit values that disagree with it, so a run's batch and clipping never
  depend on which launcher started it.
- The frozen target is never given to DeepSpeed: every rank loads it whole (with ZeRO-3's
  ``zero.Init`` switched off while it loads, :func:`frozen_target_context`) and runs it forward-only.
  It has no gradients or optimizer state for ZeRO to shard, and the drafter reads its embedding
  and LM head by reference at every step. Only the drafter's parameters, gradients and optimizer
  state are partitioned.
- Under ZeRO-3 a rank holds only a shard of each drafter parameter, so evaluation and the
  ``drafter.safetensors`` export use a full copy gathered on rank 0 by
  ``accelerator.get_state_dict`` (:func:`full_drafter`; needs
  ``stage3_gather_16bit_weights_on_model_save``, which the presets set).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
from typing import Any

import torch
from torch import nn

from drafttrain.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

# DeepSpeed keys that the trainer config owns (the JSON presets leave them "auto").
_ZERO_HIDDEN_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def deepspeed_requested() -> bool:
    """True when the process was started by ``accelerate launch`` with a DeepSpeed config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")


def make_accelerator(c: TrainConfig, project_dir: str):
    """The run's :class:`accelerate.Accelerator` (see the module docstring for each argument's reason).

    Raises:
        ConfigError: the launcher forced a gradient-accumulation count other than
            ``trainer.grad_accum_steps`` (e.g. ``--gradient_accumulation_steps`` on the command line).
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    distributed = deepspeed_requested() or int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not cuda else []
    accelerator = Accelerator(
        cpu=not cuda and not deepspeed_requested(),
        mixed_precision=c.trainer.mixed_precision,
        gradient_accumulation_steps=c.trainer.grad_accum_steps,
        step_scheduler_with_optimizer=False,
        log_with="wandb" if c.logging.wandb else None,
        project_dir=project_dir,
        kwargs_handlers=handlers,
    )
    if accelerator.gradient_accumulation_steps != c.trainer.grad_accum_steps:
        raise ConfigError(
            f"the launcher set gradient accumulation to {accelerator.gradient_accumulation_steps} but "
            f"trainer.grad_accum_steps={c.trainer.grad_accum_steps}: set it with trainer.grad_accum_steps only"
        )
    return accelerator


def zero_stage(accelerator) -> int | None:
    """The DeepSpeed ZeRO stage of this run (None without DeepSpeed)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


@contextlib.contextmanager
def frozen_target_context(accelerator):
    """Context in which to load the frozen target so that every rank holds all of it.

    Under a DeepSpeed launch accelerate registers its DeepSpeed config with transformers, and
    ``from_pretrained`` then builds the model inside ZeRO-3's ``zero.Init`` (partitioned) whenever
    the config is ZeRO-3, whatever ``zero3_init_flag`` says (seen: the real target's LM head came
    out with 0 rows). The registration is lifted while the target loads and restored after.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if getattr(plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(plugin.dschf)


def configure_deepspeed(accelerator, c: TrainConfig, hidden_size: int) -> dict[str, Any] | None:
    """Fill the DeepSpeed config's ``"auto"`` entries from the trainer config; call before ``prepare``.

    Sets ``train_micro_batch_size_per_gpu`` = trainer.micro_batch_size, ``gradient_accumulation_steps``
    = trainer.grad_accum_steps, ``train_batch_size`` = their product x world size, ``gradient_clipping``
    = optim.max_grad_norm, the ZeRO bucket sizes from ``hidden_size`` (as accelerate does for HF
    models; our drafters' ``config`` is a plain dict, which accelerate cannot read) and, under ZeRO-3,
    ``stage3_gather_16bit_weights_on_model_save`` = true (needed to export the drafter).

    Returns:
        the DeepSpeed config dict (None without DeepSpeed).

    Raises:
        ConfigError: the DeepSpeed config sets one of these to a different value, or its bf16/fp16
            switch disagrees with trainer.mixed_precision.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    ds = plugin.deepspeed_config
    source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "the DeepSpeed config")
    mbs, accum = c.trainer.micro_batch_size, c.trainer.grad_accum_steps
    want = {
        "train_micro_batch_size_per_gpu": (mbs, "trainer.micro_batch_size"),
        "gradient_accumulation_steps": (accum, "trainer.grad_accum_steps"),
        "train_batch_size": (mbs * accum * accelerator.num_processes, "micro batch x accumulation x processes"),
        "gradient_clipping": (float(c.optim.max_grad_norm), "optim.max_grad_norm"),
    }
    problems = []
    for key, (value, owner) in want.items():
        have = ds.get(key, "auto")
        if have == "auto" or have is None:
            ds[key] = value
        elif float(have) != float(value):
            problems.append(f"{key}={have} (the trainer config gives {value} from {owner})")
    zero = ds.setdefault("zero_optimization", {})
    for key, fn in _ZERO_HIDDEN_KEYS.items():
        if zero.get(key) == "auto":
            zero[key] = fn(hidden_size)
    if int(zero.get("stage", 0)) == 3:
        if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
            problems.append("zero_optimization.stage3_gather_16bit_weights_on_model_save=false (the drafter "
                            "export and evaluation under ZeRO-3 gather the full weights: set it to true)")
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    mp = c.trainer.mixed_precision
    for kind in ("bf16", "fp16"):
        enabled = ds.get(kind, {}).get("enabled", False)
        if enabled != "auto" and bool(enabled) != (mp == kind):
            problems.append(f"{kind}.enabled={enabled} (trainer.mixed_precision={mp})")
    if problems:
        raise ConfigError(
            f"{source} disagrees with the trainer config: " + "; ".join(problems)
            + '. Set these to "auto" in the DeepSpeed JSON; the trainer config decides them.'
        )
    return ds


class Zero3LossOutput(dict):
    """A drafter's :class:`~drafttrain.drafters.base.LossOutput` as ZeRO-3 needs to see it.

    ZeRO-3 frees a module's own parameters after its forward and gathers them again just before its
    backward through a hook that it attaches to the tensors the forward returned, but only to
    tensors inside a tensor, tuple, list or dict: the dataclass LossOutput hides the loss, so the
    drafter's direct parameters (e.g. ParallelSpec's ``mask_embed``) reached backward freed (seen:
    ``The size of tensor a (0) must match the size of tensor b (64)``). This dict holds only the loss
    (the one tensor that is backpropagated) and keeps ``sums``/``num_tokens`` as attributes, so the
    loop's ``out.loss``/``out.sums``/``out.num_tokens`` work unchanged.
    """

    def __init__(self, out):
        super().__init__(loss=out.loss)
        self.sums, self.num_tokens = out.sums, out.num_tokens

    @property
    def loss(self) -> torch.Tensor:
        return self["loss"]


def _zero3_output_hook(module, args, output):
    from drafttrain.drafters.base import LossOutput

    return Zero3LossOutput(output) if isinstance(output, LossOutput) else output


def prepare(accelerator, c: TrainConfig, drafter: nn.Module, optimizer, scheduler, hidden_size: int):
    """``accelerator.prepare`` for the drafter, its optimizer and LR scheduler, after
    :func:`configure_deepspeed` and, under ZeRO-3, a forward hook turning the drafter's output into a
    :class:`Zero3LossOutput` (registered before DeepSpeed's own hooks, so it runs first)."""
    configure_deepspeed(accelerator, c, hidden_size)
    if zero_stage(accelerator) == 3:
        drafter.register_forward_hook(_zero3_output_hook)
    return accelerator.prepare(drafter, optimizer, scheduler)


@torch.no_grad()
def full_drafter(accelerator, drafter) -> nn.Module | None:
    """The drafter with all its weights, for evaluation and export. Call on EVERY rank (collective
    under ZeRO-3).

    Without ZeRO-3 this is the unwrapped module itself (shared, not a copy). Under ZeRO-3 it is a
    new module of the same class built on rank 0 from ``accelerator.get_state_dict`` (the other
    ranks get None); it shares the target's frozen modules like the original.
    """
    model = accelerator.unwrap_model(drafter)
    if zero_stage(accelerator) != 3:
        return model
    state = accelerator.get_state_dict(drafter)  # gathered on rank 0 only
    if not accelerator.is_main_process:
        return None
    copy = type(model)(dict(model.config), model.shared, init_weights=False)
    copy.load_state_dict(state)
    copy.train(model.training)
    return copy


def close_file_logs() -> None:
    """Remove the root logger's file handlers (Hydra's ``train.log`` in the run folder): called on
    ranks other than 0, so that only rank 0 writes into the run folder. Their console output stays."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler):
            root.removeHandler(h)
            h.close()


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: CUDA max allocated on a GPU, else peak resident set size
    (``ru_maxrss``, which on Linux counts the whole process: Python, torch, the target and the data)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def per_rank(accelerator, value: float) -> list[float]:
    """``value`` from every rank, in rank order (collective)."""
    t = torch.tensor([float(value)], device=accelerator.device)
    return [float(x) for x in accelerator.gather(t).cpu()]


def launch_info(accelerator) -> dict[str, Any]:
    """What the launcher chose: world size, machines, distributed type, device, ZeRO stage, and the
    DeepSpeed config file and resolved config (call after ``prepare``; JSON-safe)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    ds = json.loads(json.dumps(plugin.deepspeed_config, default=str).replace("Infinity", '"inf"')) if plugin else None
    return {
        "world_size": accelerator.num_processes,
        "num_machines": max(1, accelerator.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))),
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "device": accelerator.device.type,
        "zero_stage": zero_stage(accelerator),
        "deepspeed_config_file": os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
        "deepspeed_config": ds,
    }
