"""Validation: the one composition root that checks a composed config against the schemas and the registries.

:mod:`drafttrain.config` holds the schemas (dataclasses, value ranges, moved keys) and imports nothing of
drafttrain's but the CLI helpers. This module is where the schemas meet what is registered at run time:
each drafter's keys (:data:`drafttrain.drafters.DRAFTERS`), each decoding method's config section and
checks (:data:`drafttrain.verify.methods.METHODS`), the engine's modes, the vLLM backend's venv, the
target family's support by the engine (:mod:`drafttrain.target.families`) and the host's native bf16
(:mod:`drafttrain.host`). ``train.run``, the evaluator and every script validate through it, before
any model loads: a typo'd key or a bad value is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import functools
import json
from dataclasses import field, fields, make_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafttrain.target import families
from drafttrain.cliconfig import ConfigError, validate_into
from drafttrain.config import (
    BACKENDS,
    FAST_LINEAR_MODES,
    LEGACY_DRAFTER_KEYS,
    MOVED_KEYS,
    CacheFeaturesConfig,
    DecisionModelConfig,
    DrafterConfig,
    EvalConfig,
    GenerateConfig,
    TargetConfig,
    TrainConfig,
    numeric_problems,
)
from drafttrain.drafters import DRAFTERS
from drafttrain.generation.vllm_client import vllm_python
from drafttrain.host import native_bf16
from drafttrain.strategies import STRATEGIES, strategy_problems, strategy_sections
from drafttrain.verify.engine import MODES
from drafttrain.verify.methods import METHODS, config_sections

__all__ = ["ConfigError", "drafter_schema", "eval_schema", "resolve_mixed_precision", "target_model_config",
           "train_schema", "validate", "validate_eval"]  # fmt: skip


_SCHEMAS: dict[type, type] = {}


def drafter_schema(name: str) -> type:
    """The config dataclass of drafter ``name``: :class:`DrafterConfig` (``name``) plus one field per key of
    the class's ``defaults``, typed by its default value (bool, int, float, str; a list or None: any).

    Raises:
        ConfigError: no drafter of that name is registered.
    """
    if name not in DRAFTERS:
        raise ConfigError(f"drafter.name '{name}' is not one of {sorted(DRAFTERS)} (a drafter defined elsewhere "
                          f"must be registered with drafttrain.drafters.register_drafter before validation)")  # fmt: skip
    cls = DRAFTERS[name]
    if cls not in _SCHEMAS:
        cols = []
        for key, value in cls.defaults.items():
            typ = type(value) if isinstance(value, (bool, int, float, str)) else Any
            default = field(default_factory=lambda v=value: list(v)) if isinstance(value, list) else field(default=value)
            cols.append((key, typ, default))
        _SCHEMAS[cls] = make_dataclass(f"{cls.__name__}Config", cols, bases=(DrafterConfig,))
        _SCHEMAS[cls].__module__ = __name__
    return _SCHEMAS[cls]


def _validate_drafter(section: dict[str, Any]) -> DrafterConfig:
    """The ``drafter`` section merged into its drafter's schema (unknown keys and wrong types name the key)."""
    section = dict(section or {})
    name = section.get("name", DrafterConfig.name)
    schema = drafter_schema(name)
    own = {f.name for f in fields(schema)}
    section = {k: v for k, v in section.items() if k in own or LEGACY_DRAFTER_KEYS.get(k, object()) != v}
    wrapper = make_dataclass("DrafterSection", [("drafter", schema, field(default_factory=schema))])  # keys: drafter.*
    try:
        out = validate_into(wrapper, {"drafter": section}).drafter
    except ConfigError as e:
        raise ConfigError(f"{e} (drafter {name} reads {sorted(own - {'name'})})") from None
    out.name = name
    return out


def train_schema() -> type:
    """:class:`TrainConfig` whose ``trainer`` holds one more field per registered strategy's config section
    (``trainer.<config_section>``, its dataclass: :func:`drafttrain.strategies.strategy_sections`; built once per
    set of sections), as :func:`eval_schema` does for the decoding methods' sections."""
    return _train_schema(tuple(strategy_sections().items()))


@functools.lru_cache(maxsize=None)
def _train_schema(sections: tuple[tuple[str, type], ...]) -> type:
    from drafttrain.config import TrainerConfig

    ns = {"__module__": __name__}
    cols = [(key, cls, field(default_factory=cls)) for key, cls in sections]
    trainer = make_dataclass("TrainerConfig", cols, bases=(TrainerConfig,), namespace=ns)
    return make_dataclass("TrainConfig", [("trainer", trainer, field(default_factory=trainer))], bases=(TrainConfig,),
                          namespace=ns)  # fmt: skip


def validate(cfg: DictConfig | dict[str, Any], schema: type = TrainConfig):
    """Merge a composed config into ``schema`` (default :class:`TrainConfig`, with the registered strategies'
    sections: :func:`train_schema`).

    Hydra's own ``hydra`` node is ignored. Raises:
        ConfigError: a key is unknown (the message names it with its full path), a value has the
            wrong type, or a value is out of range.
    """
    drafter = None
    if schema is TrainConfig and not isinstance(cfg, TrainConfig):  # the drafter section: against its own class
        if isinstance(cfg, DictConfig):
            try:
                cfg = OmegaConf.to_container(cfg, resolve=True)
            except OmegaConfBaseException as e:  # e.g. a mandatory value (???) left unset
                raise ConfigError(f"config key '{getattr(e, 'full_key', '?')}': {getattr(e, 'msg', e)}") from None
        cfg = dict(cfg)
        drafter = cfg.pop("drafter", None) or {}
    training = schema is TrainConfig
    out = validate_into(train_schema() if training else schema, cfg, MOVED_KEYS if training else None)
    if drafter is not None:
        out.drafter = _validate_drafter(drafter)
    problems = numeric_problems(out)
    if problems:
        raise ConfigError("; ".join(problems))
    _CHECKS[schema](out)
    return out


def _check_values(c: TrainConfig) -> None:
    problems = []
    if c.trainer.mixed_precision not in ("no", "bf16", "fp16", "auto"):
        problems.append("trainer.mixed_precision must be one of no|bf16|fp16|auto")
    if c.trainer.attention not in ("dense", "flex"):
        problems.append(f"trainer.attention must be one of dense|flex, got {c.trainer.attention!r}")
    if c.trainer.micro_batch_size < 1 or c.trainer.grad_accum_steps < 1:
        problems.append("trainer.micro_batch_size and trainer.grad_accum_steps must be >= 1")
    se = c.trainer.spec_eval
    tw, tb = se.tree.widths, se.tree.budget
    if (tw is not None or tb is not None) and se.batch_size == 1:
        problems.append("trainer.spec_eval.tree.widths/budget need trainer.spec_eval.batch_size > 1 (the batch-1 "
                        "evaluation decodes a chain); set them to null")
    if tw is not None and not tw:
        problems.append("trainer.spec_eval.tree.widths must be a non-empty list of positive ints (or null)")
    if se.compile_target and (se.batch_size == 1 or se.latency_prompts == 0):
        problems.append("trainer.spec_eval.compile_target applies to the batch-1 latency runs: it needs "
                        "trainer.spec_eval.batch_size > 1 and latency_prompts > 0")
    if se.sssd.source not in ("none", "input", "data"):
        problems.append(f"trainer.spec_eval.sssd.source must be none|input|data, got {se.sssd.source!r}")
    if se.num_prompts is None:
        problems.append("trainer.spec_eval.num_prompts must be an int (0 = no speculative evaluation), got null")
    problems += _unread_eval_keys(se)
    uses_engine = (se.num_prompts or 0) > 0 or (c.data.self_distill and c.data.generation.backend == "engine")
    problems += _check_target(c.target, uses_engine=uses_engine)
    problems += _check_drafter_layers(c)
    problems += _check_strategy(c)
    problems += _check_backend("data.generation", c.data.generation, c.target)
    if c.optim.decay_over not in ("steps", "minutes"):
        problems.append(f"optim.decay_over must be steps|minutes, got {c.optim.decay_over!r}")
    elif c.optim.decay_over == "minutes" and c.trainer.max_minutes is None:
        problems.append("optim.decay_over=minutes needs trainer.max_minutes (the time the cosine runs over)")
    if c.data.features not in ("auto", "live", "cache"):
        problems.append("data.features must be auto|live|cache")
    if c.data.features == "cache" and not c.data.feature_cache:
        problems.append("data.features=cache needs data.feature_cache=<folder written by scripts.cache_features> "
                        "or data.feature_cache=auto (the run labels its rows itself)")
    if c.data.feature_cache == "auto" and c.data.features != "cache":
        problems.append(f"data.feature_cache=auto labels the rows into a cache that only data.features=cache reads "
                        f"(data.features={c.data.features}): add data.features=cache")
    if c.data.heldout_split not in ("random", "head"):
        problems.append(f"data.heldout_split must be random|head, got {c.data.heldout_split!r}")
    if c.data.feature_cache_dtype not in ("float16", "bfloat16"):
        problems.append(f"data.feature_cache_dtype must be float16|bfloat16, got {c.data.feature_cache_dtype!r}")
    if c.data.dataset_share > 0 and not c.data.self_distill:
        problems.append("data.dataset_share mixes self-distilled and dataset rows: it needs data.self_distill=true")
    if c.data.source == "generated" and not c.data.path:
        problems.append("data.source=generated needs data.path=<folder written by scripts.generate_data>")
    if problems:
        raise ConfigError("; ".join(problems))


def _unread_eval_keys(se) -> list[str]:
    """``trainer.spec_eval``'s ``tree.*`` and ``sssd.*`` keys that only ``scripts.evaluate`` reads
    (:data:`drafttrain.config.EVAL_ONLY_KEYS`), set to another value than the schema's default: one problem each."""
    from drafttrain.config import EVAL_ONLY_KEYS, SSSDEvalConfig, TreeConfig

    out = []
    for section, default in (("tree", TreeConfig()), ("sssd", SSSDEvalConfig())):
        for key in EVAL_ONLY_KEYS[section][0]:
            if getattr(getattr(se, section), key) != getattr(default, key):
                out.append(f"trainer.spec_eval.{section}.{key} is read by scripts.evaluate only, not by the in-training "
                           f"evaluation: leave it unset (or evaluate the run with python -m scripts.evaluate)")  # fmt: skip
    return out


def _check_target(t: TargetConfig, uses_engine: bool = False) -> list[str]:
    """Problems with the target's ``dtype``, ``fast_linear`` and family (train, generate and evaluate share
    them). ``uses_engine``: the job decodes with drafttrain's engine, so a family the engine cannot run
    exactly (:func:`drafttrain.target.families.check_engine_support`: attention sinks, soft-capping, MLA attention) is
    refused here, before any model loads, naming ``target.path`` and the architecture."""
    problems = []
    if t.dtype not in ("float32", "bfloat16", "float16", "auto"):
        problems.append("target.dtype must be float32|bfloat16|float16|auto")
    if t.fast_linear not in FAST_LINEAR_MODES:
        problems.append(f"target.fast_linear must be {'|'.join(FAST_LINEAR_MODES)}, got {t.fast_linear!r}")
    if t.random_init and t.family not in families.FAMILIES:
        problems.append(f"target.family must be one of {'|'.join(families.FAMILIES)}, got {t.family!r}")
        return problems
    model_config = target_model_config(t)
    if uses_engine and model_config is not None:
        try:
            families.check_engine_support(model_config)  # sinks, soft-capping, MLA: refused by name
        except ValueError as err:
            problems.append(f"target.path={t.path}: {err}" if t.path and not t.random_init else str(err))
    return problems


def _check_drafter_layers(c: TrainConfig) -> list[str]:
    """Problems with the target layers the drafter would read (``Drafter.layers_for``: e.g. EAGLE-3's
    ``aux_layer_ids``, the rule its exports hold too), where the target's depth is known before it loads
    (``target.num_hidden_layers`` of a tiny target, ``num_hidden_layers`` in ``target.path``'s config.json)."""
    from dataclasses import asdict

    from drafttrain.drafters import drafter_config

    t = c.target
    depth = t.num_hidden_layers if t.random_init else (target_model_config(t) or {}).get("num_hidden_layers")
    if not isinstance(depth, int) or c.drafter.name not in DRAFTERS:
        return []
    try:
        DRAFTERS[c.drafter.name].layers_for(drafter_config(c.drafter.name, asdict(c.drafter)), depth)
    except ValueError as err:
        return [f"{err} (target: {depth} decoder layers)"]
    return []


def _check_strategy(c: TrainConfig) -> list[str]:
    """Problems with ``trainer.strategy`` and ``loss``: a registered strategy and a known divergence, a drafter
    that has what the strategy declares it needs (:func:`drafttrain.strategies.strategy_problems`) and whose
    training loss honours what ``loss.*`` asks (``Drafter.objectives``; the refusal names the drafter and its
    reason). The strategy's own section's values: its dataclass's ``numeric_ranges``."""
    from drafttrain.config import DIVERGENCES

    out = []
    st, lc = c.trainer.strategy, c.loss  # value ranges: config.NUMERIC_RANGES
    if st not in STRATEGIES:
        out.append(f"trainer.strategy must be one of {'|'.join(sorted(STRATEGIES))}, got {st!r}")
    else:
        out += strategy_problems(c)
    if lc.divergence not in DIVERGENCES:
        out.append(f"loss.divergence must be one of {'|'.join(DIVERGENCES)}, got {lc.divergence!r}")
    cls = DRAFTERS.get(c.drafter.name)
    if cls is None:
        return out
    # what the strategy needs of the drafter: above, from its declaration; here the loss.* keys
    wants = {"cut_at_first_miss": lc.cut_at_first_miss, "divergence": lc.divergence != "forward_kl"}
    for what, asked in wants.items():
        if asked and what not in cls.objectives:
            key = "loss.cut_at_first_miss" if what == "cut_at_first_miss" else f"loss.divergence={lc.divergence}"
            out.append(f"{key}: drafter '{c.drafter.name}' does not support it (its loss supports: "
                       f"{sorted(cls.objectives) or 'none of loss.*'})")  # fmt: skip
    return out


def target_model_config(t: TargetConfig) -> dict | None:
    """What is known of the target's model config before it loads: ``{"model_type"}`` of a tiny target's
    family, the ``config.json`` of ``target.path``; None for the packaged model (a Llama) or a missing folder."""
    if t.random_init:
        return {"model_type": families.by_name(t.family).model_types[0]}
    if t.path:
        f = Path(t.path).expanduser() / "config.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError):
                return None
    return None


#: Below this many parameters (estimated from ``target.path``'s config.json) a target is a test model: the
#: main job's data and evaluation sizes (hundreds of conversations, 16 x 128-token prompts) make no sense for it.
SMALL_TARGET_PARAMS = 50_000_000
#: The smoke-run sizes ``target=tiny`` gets (conf/target_sizes/tiny.yaml), as overrides.
SMOKE_SIZES = ("data.max_conversations=24", "data.heldout=4", "data.generation.max_new_tokens=16",
               "trainer.spec_eval.num_prompts=4", "trainer.spec_eval.max_new_tokens=16",
               "trainer.spec_eval.latency_prompts=2")  # fmt: skip


def estimated_params(model_config: dict) -> int | None:
    """Parameters of a decoder-only transformer from its config.json keys (embeddings, attention and MLP
    weights per layer, an untied head): an estimate for sizing data, not an exact count. None when a key is
    missing."""
    try:
        d, layers, v = int(model_config["hidden_size"]), int(model_config["num_hidden_layers"]), int(model_config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    inter = int(model_config.get("intermediate_size") or 4 * d)
    tied = bool(model_config.get("tie_word_embeddings", False))
    return v * d * (1 if tied else 2) + layers * (4 * d * d + 3 * d * inter)


def smoke_size_hint(c: TrainConfig) -> str | None:
    """One line for a ``target.path`` model far smaller than a real target run at the main job's sizes: its
    estimated size and the overrides that give it ``target=tiny``'s smoke sizes. None otherwise."""
    if c.target.random_init or not c.target.path:
        return None
    n = estimated_params(target_model_config(c.target) or {})
    if n is None or n >= SMALL_TARGET_PARAMS or c.data.max_conversations <= 64:
        return None
    return (f"target.path={c.target.path} has ~{n / 1e6:.1f}M parameters but this run uses the main job's sizes "
            f"(data.max_conversations={c.data.max_conversations}); for a smoke run add: {' '.join(SMOKE_SIZES)}")


def _check_backend(key: str, g, target: TargetConfig) -> list[str]:
    """Problems of ``g.backend`` (a GenerationConfig or DistillConfig at ``key``); for ``vllm``, the ones that would
    otherwise fail after the target has loaded: no vLLM python, no HF folder of the target for vLLM to load."""
    if g.backend not in BACKENDS:
        return [f"{key}.backend must be {'|'.join(BACKENDS)}, got {g.backend!r}"]
    if g.backend != "vllm":
        return []
    problems, v = [], g.vllm
    if vllm_python(v.python) is None:
        where = f"{key}.vllm.python={v.python} is not a file" if v.python else "no .venv-vllm/bin/python (nor $DRAFTTRAIN_VLLM_PYTHON)"
        problems.append(f"{key}.backend=vllm needs vLLM's venv: {where}; run `bash scripts/install_vllm.sh` "
                        f"(creates .venv-vllm) or set {key}.vllm.python=<its python>")
    if target.random_init:
        problems.append(f"{key}.backend=vllm loads the target from its Hugging Face folder, and a random target "
                        "(target.random_init=true) has none: save it (save_pretrained) and pass target.path=<folder>")
    if v.kv_cache_gb < 1 or not 0 < v.memory_utilization <= 1 or v.timeout_s < 1:
        problems.append(f"{key}.vllm.kv_cache_gb and timeout_s must be >= 1, memory_utilization in (0, 1]")
    return problems


def _check_generate(c: GenerateConfig) -> None:
    g, problems = c.generation, []
    if g.max_new_tokens < 1 or g.max_length < 2 or g.batch_size < 1:
        problems.append("generation.max_new_tokens, generation.batch_size must be >= 1 and generation.max_length >= 2")
    if g.max_batch_tokens is not None and g.max_batch_tokens < 1:
        problems.append("generation.max_batch_tokens must be >= 1 or null")
    if g.shard_size is not None and g.shard_size < 1:
        problems.append("generation.shard_size must be >= 1")
    if g.max_turns is not None and g.max_turns < 1:
        problems.append("generation.max_turns must be >= 1 or null")
    if g.on_length not in ("close", "stop"):
        problems.append("generation.on_length must be close|stop")
    problems += _check_backend("generation", g, c.target)
    if g.backend == "vllm" and g.sampling.temperature > 0:
        problems.append("generation.backend=vllm is greedy only (generation.sampling.temperature=0): sampled rows draw "
                        "from a generator seeded per conversation and turn (generation.sampling.seed), which vLLM "
                        "cannot reproduce; sample with generation.backend=hf")
    if g.sampling.temperature < 0 or not 0 < g.sampling.top_p <= 1:
        problems.append("generation.sampling.temperature must be >= 0 (0 = greedy) and top_p in (0, 1]")
    problems += _check_target(c.target, uses_engine=g.backend == "engine")
    if not c.output_dir:
        problems.append("output_dir must be set")
    if problems:
        raise ConfigError("; ".join(problems))


def _check_cache(c: CacheFeaturesConfig) -> None:
    problems = []
    if not c.dataset:
        problems.append("dataset=<folder> is required (a scripts.generate_data output_dir or a saved dataset)")
    if c.dtype not in ("float16", "bfloat16"):
        problems.append("dtype must be float16|bfloat16")
    if c.top_k < 0 or c.batch_size < 1 or c.shard_size < 1:
        problems.append("top_k must be >= 0, batch_size and shard_size >= 1")
    if problems:
        raise ConfigError("; ".join(problems))


def _check_decision(c: DecisionModelConfig) -> None:
    if not c.data:
        raise ConfigError("data=[<decision log>.jsonl, ...] is required (scripts.evaluate mcsd.decisions_out=... writes them)")


_CHECKS = {TrainConfig: _check_values, GenerateConfig: _check_generate, CacheFeaturesConfig: _check_cache,
           DecisionModelConfig: _check_decision}  # fmt: skip


def resolve_mixed_precision(setting: str) -> str:
    """``auto`` -> ``bf16`` where the device computes bf16 natively (:func:`drafttrain.host.native_bf16`: a
    CUDA GPU with bf16, a CPU with AVX512_BF16 / AMX / Arm BF16, or a probe where the flags cannot be read),
    else ``no``. Other settings are returned as they are.

    Not oneDNN's ``_is_mkldnn_bf16_supported()``: it is true on any AVX-512 CPU, also where bf16 is
    emulated and a training step runs several times slower than in fp32 (AVX2-only CPUs are far worse).
    """
    if setting != "auto":
        return setting
    return "bf16" if native_bf16()[0] else "no"


def eval_schema() -> type:
    """:class:`EvalConfig` plus one field per registered decoding method's config section (read from
    :data:`drafttrain.verify.methods.METHODS`; built once per set of sections)."""
    return _eval_schema(tuple(config_sections().items()))


@functools.lru_cache(maxsize=None)
def _eval_schema(sections: tuple[tuple[str, type], ...]) -> type:
    fields_ = [(key, cls, field(default_factory=cls)) for key, cls in sections]
    return make_dataclass("EvalConfig", fields_, bases=(EvalConfig,), namespace={"__module__": __name__})


def validate_eval(cfg: DictConfig | dict[str, Any]) -> EvalConfig:
    """Merge a composed ``conf/evaluate.yaml`` into :func:`eval_schema` (as :func:`validate` does for training).

    Method names, whether a checkpoint is needed and each method's value checks come from the method
    registry (:mod:`drafttrain.verify.methods`).

    Raises:
        ConfigError: unknown key, wrong type, or a bad value (before any model loads).
    """
    c: EvalConfig = validate_into(eval_schema(), cfg)
    problems = numeric_problems(c)
    if c.preset not in (None, "training"):
        problems.append(f"preset must be training or null, got {c.preset!r}")
    elif c.preset == "training" and not (c.checkpoint and (Path(c.checkpoint) / "config.json").is_file()):
        problems.append("preset=training needs checkpoint=<a training run folder> (config.json + drafter/)")
    if not c.batch_sizes or any(b < 1 for b in c.batch_sizes):
        problems.append("batch_sizes must be a non-empty list of ints >= 1")
    bad = [m for m in list(c.modes) + [c.plain_mode] if m not in MODES]
    if bad:
        problems.append(f"unknown engine mode(s) {bad}; choose from {list(MODES)}")
    if c.pack_inputs not in ("auto", "always"):
        problems.append("pack_inputs must be auto or always")
    if c.max_new_tokens < 1:
        problems.append("max_new_tokens must be >= 1")
    if c.temperature < 0 or not 0 < c.top_p <= 1:
        problems.append("temperature must be >= 0 and top_p in (0, 1]")
    if c.proposer not in METHODS:
        problems.append(f"proposer must be a registered decoding method {sorted(METHODS)}, got {c.proposer!r}")
    methods = c.method_names()
    if not methods or any(m not in METHODS for m in methods) or len(set(methods)) != len(methods):
        problems.append(f"methods must be distinct names from {sorted(METHODS)}, got {methods}")
    else:
        if len({METHODS[m].name for m in methods}) != len(methods):
            problems.append(f"methods {methods} name one method twice (an alias and its name)")
        if c.checkpoint is None and not c.untrained_drafter and any(METHODS[m].needs_drafter for m in methods):
            problems.append("checkpoint=PATH is required (or untrained_drafter=true to time a fresh drafter)")
        for m in dict.fromkeys(METHODS[m] for m in methods):
            problems += m.check(c) if m.check is not None else []
    problems += _check_target(c.target, uses_engine=True)
    if problems:
        raise ConfigError("; ".join(problems))
    return c

