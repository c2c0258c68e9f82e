"""Typed configuration: one dataclass per Hydra group, validated at start-up.

Library code never sees a DictConfig: :func:`validate` merges the composed Hydra config into these
dataclasses (OmegaConf structured merge), so a typo'd key or a wrong type fails with a message naming
the key before any model loads (DESIGN.md section 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class TargetConfig:
    """The frozen target. ``path`` = a local HF folder; null = the packaged GGUF, converted once."""

    name: str = "smollm2-135m-instruct"
    path: str | None = None
    gguf_file: str | None = None  # a GGUF file to convert instead of the packaged one
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    # tiny random target for tests: a LlamaConfig built from these (only when random_init is true)
    random_init: bool = False
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seed: int = 0


@dataclass
class DataConfig:
    """Training data: a source of conversations and how answers are produced."""

    source: str = "sharegpt"  # sharegpt | path to a .jsonl of conversations
    max_conversations: int = 512  # conversations read from the source (kept ones)
    first_turn_only: bool = True
    max_length: int = 512  # tokens per training sequence
    # self-distillation: the target regenerates every answer (greedy) before training
    self_distill: bool = True
    max_new_tokens: int = 192
    max_prompt_length: int | None = 256  # longer prompts are skipped (counted) by self-distillation
    distill_batch_size: int = 16
    heldout: int = 16  # sequences held out for eval/tau_sim
    cache_dir: str | None = None  # default: <cache_root>/data


@dataclass
class DrafterConfig:
    """A drafter. ``name`` selects the class (medusa | eagle | parallelspec | parallelspec_eagle).

    Each drafter reads a subset of these keys (its ``defaults``, see ``drafttrain/drafters``); setting a
    key the chosen drafter does not read to anything but its default here is an error (e.g.
    ``drafter.num_mask_tokens=3`` with Medusa, whose K is ``num_heads``).
    """

    name: str = "parallelspec"
    num_mask_tokens: int = 4  # parallelspec*: K [MASK] tokens; a parallel group has K + 1 positions
    num_heads: int = 4  # medusa: K heads, head k predicts x_{t+k+1}
    draft_depth: int = 5  # eagle: tokens drafted autoregressively per verification step
    loss_decay: float = 0.8  # lambda_k = loss_decay ** k (ParallelSpec Eq. 3 / Medusa Eq. 2)
    anchor_ratio: float = 0.25  # fraction of candidate anchors kept per sequence (eagle: of metric rollouts)
    init_from_target_layer: bool = True  # copy the target's last decoder layer into the drafter layer
    fc_bias: bool = True
    draft_vocab_size: int = 0  # 0 = full target vocabulary; N = the N most frequent answer tokens
    kd_weight: float = 0.0  # weight of the soft target-distribution term in the CE (0 = the papers' hard CE)
    reg_weight: float = 1.0  # eagle*: w_reg of the SmoothL1 feature regression (EAGLE)
    cls_weight: float = 0.1  # eagle*: w_cls of the classification loss (EAGLE)
    feature_noise: float = 0.1  # eagle*: a of the U(-a, a) noise added to input features in training (EAGLE)


@dataclass
class OptimConfig:
    lr: float = 5e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    max_minutes: float | None = None  # stop (and checkpoint) once this much training time has passed
    micro_batch_size: int = 4  # sequences per process per forward
    grad_accum_steps: int = 1
    length_group_steps: int = 8  # sort each run of this many steps' samples by length (less padding); 1 = off
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto (bf16 where the hardware runs it fast, else no)
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 100
    keep_checkpoints: int = 2
    num_threads: int | None = None  # torch intra-op threads per process (None = torch default)
    # in-training speculative evaluation (greedy chain) on held-out prompts
    spec_eval_every: int = 0  # also run it every N steps (0 = only at the end)
    spec_eval_prompts: str = "mt_bench"
    spec_eval_num_prompts: int = 10
    spec_eval_offset: int = 0
    spec_eval_max_new_tokens: int = 128
    progress: bool = True


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_project: str = "drafttrain"
    wandb_mode: str = "offline"  # used when WANDB_MODE is not set in the environment


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_name: str = "run"
    output_dir: str = "outputs/run"
    seed: int = 0
    resume: bool = False


class ConfigError(ValueError):
    """The composed config does not match the schema (unknown key, wrong type, bad value)."""


def validate(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Merge a composed config into :class:`TrainConfig`.

    Hydra's own ``hydra`` node is ignored. Raises:
        ConfigError: a key is unknown (the message names it with its full path), a value has the
            wrong type, or a value is out of range.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {k: v for k, v in dict(cfg).items() if k != "hydra"}
    schema = OmegaConf.structured(TrainConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except OmegaConfBaseException as e:  # unknown key / type mismatch
        key = getattr(e, "full_key", None)
        raise ConfigError(f"invalid config key '{key}': {e.msg if hasattr(e, 'msg') else e}") from None
    out: TrainConfig = OmegaConf.to_object(merged)
    _check_values(out)
    return out


def _check_values(c: TrainConfig) -> None:
    problems = []
    dr = c.drafter
    if dr.num_mask_tokens < 0:
        problems.append("drafter.num_mask_tokens must be >= 0")
    if dr.num_heads < 1 or dr.draft_depth < 1:
        problems.append("drafter.num_heads and drafter.draft_depth must be >= 1")
    if not 0 < dr.anchor_ratio <= 1:
        problems.append("drafter.anchor_ratio must be in (0, 1]")
    if not 0 <= dr.kd_weight <= 1:
        problems.append("drafter.kd_weight must be in [0, 1]")
    if dr.loss_decay <= 0 or dr.reg_weight < 0 or dr.cls_weight < 0 or dr.feature_noise < 0 or dr.draft_vocab_size < 0:
        problems.append("drafter.loss_decay must be > 0; reg_weight, cls_weight, feature_noise, draft_vocab_size >= 0")
    problems += _drafter_key_problems(dr)
    if c.trainer.mixed_precision not in ("no", "bf16", "fp16", "auto"):
        problems.append("trainer.mixed_precision must be one of no|bf16|fp16|auto")
    if c.trainer.micro_batch_size < 1 or c.trainer.grad_accum_steps < 1:
        problems.append("trainer.micro_batch_size and trainer.grad_accum_steps must be >= 1")
    if c.target.dtype not in ("float32", "bfloat16", "float16"):
        problems.append("target.dtype must be float32|bfloat16|float16")
    if problems:
        raise ConfigError("; ".join(problems))


def _drafter_key_problems(dr: DrafterConfig) -> list[str]:
    """An unknown drafter name, or a key set (away from its default) that the chosen drafter never reads."""
    from drafttrain.drafters import DRAFTERS  # torch, no model: still before anything loads

    if dr.name not in DRAFTERS:
        return [f"drafter.name '{dr.name}' is not one of {sorted(DRAFTERS)}"]
    used = set(DRAFTERS[dr.name].defaults)
    default = DrafterConfig()
    unused = [f.name for f in fields(DrafterConfig)
              if f.name != "name" and f.name not in used and getattr(dr, f.name) != getattr(default, f.name)]  # fmt: skip
    if unused:
        return [f"drafter {dr.name} does not read {', '.join('drafter.' + k for k in unused)} (its keys: {sorted(used)})"]
    return []


def resolve_mixed_precision(setting: str) -> str:
    """``auto`` -> ``bf16`` where bf16 matmuls are fast (a CUDA GPU with bf16, or a CPU whose oneDNN
    has bf16 kernels: AVX-512 / AMX), else ``no``. Other settings are returned as they are.

    Measured on a 2-core AVX2-only EPYC (no bf16 kernels): a [2048, 576] x [576, 1536] bf16 matmul
    took 2835 ms against 35 ms in fp32, so bf16 there would make training ~80x slower.
    """
    if setting != "auto":
        return setting
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    try:
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    except (AttributeError, RuntimeError):
        return "no"


def to_dict(c: TrainConfig) -> dict[str, Any]:
    """Plain dict of a validated config (for saving next to checkpoints and logging)."""
    return OmegaConf.to_container(OmegaConf.structured(c), resolve=True)
