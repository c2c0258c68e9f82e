"""Config values are checked, not only keys.

Why: ``trainer.log_every=0`` used to pass validation and raise ZeroDivisionError after ~10 minutes of
self-distillation; ``trainer.keep_checkpoints=0`` silently kept every checkpoint; negative sizes
failed deep inside a model. Every numeric key of every schema now has a range
(:data:`drafttrain.config.NUMERIC_RANGES`), enforced before any model loads. The table-driven test
walks the dataclasses, so a new numeric key without a range fails here.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from drafttrain import config as C
from drafttrain import validation as V
from drafttrain.drafters import DRAFTERS

# evaluate: EvalConfig plus every registered decoding method's section (their ranges live in their modules)
SCHEMAS = {"train": C.TrainConfig, "generate": C.GenerateConfig, "cache_features": C.CacheFeaturesConfig,
           "evaluate": V.eval_schema()}  # fmt: skip


def numeric_keys(cls, prefix=""):
    """(dotted key, owning class, field name, is_list, is_int) for every numeric field under ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from numeric_keys(t, f"{prefix}{f.name}.")
            continue
        args = set(typing.get_args(t)) | {t}
        is_list = any(typing.get_origin(a) is list for a in args)
        inner = {x for a in args for x in ((typing.get_args(a) or (a,)) if typing.get_origin(a) is list else (a,))}
        if inner & {int, float} and bool not in inner:
            yield f"{prefix}{f.name}", cls, f.name, is_list, float not in inner


ALL = [(schema, *k) for schema, cls in SCHEMAS.items() for k in numeric_keys(cls)]
# a drafter's keys live on its class (``defaults``); its schema (``config.drafter_schema``, a DrafterConfig
# subclass) takes DrafterConfig's ranges: (drafter name, dotted key, field name, is_list, is_int)
DRAFTER_KEYS = [(name, key, f, is_list, is_int) for name in sorted(DRAFTERS)
                for key, _, f, is_list, is_int in numeric_keys(V.drafter_schema(name), "drafter.")]  # fmt: skip


def bad_value(rule: C.Range, is_int: bool):
    """A value just outside ``rule`` (below its low bound, else above its high bound)."""
    if rule.low is not None:
        return (rule.low if not rule.low_inclusive else rule.low - 1) if is_int else rule.low - (0 if not rule.low_inclusive else 0.5)
    return rule.high + 1 if is_int else rule.high + (0 if not rule.high_inclusive else 0.5)


def nested(key: str, value) -> dict:
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def validate(schema: str, key: str, value):
    d = nested(key, value)
    if schema == "evaluate":
        return V.validate_eval({"untrained_drafter": True, **d})
    return V.validate(d, SCHEMAS[schema])


def test_every_numeric_key_has_a_range():
    missing = [f"{schema}: {key} ({cls.__name__}.{name})" for schema, key, cls, name, *_ in ALL
               if name not in C.numeric_ranges(cls)]  # fmt: skip
    missing += [f"drafter {name}: {key}" for name, key, f, *_ in DRAFTER_KEYS if f not in C.NUMERIC_RANGES["DrafterConfig"]]
    assert not missing, f"numeric config keys without a range in drafttrain.config.NUMERIC_RANGES: {missing}"
    assert len(ALL) + len({k for _, k, *_ in DRAFTER_KEYS}) > 80


@pytest.mark.parametrize("name,key,field,is_list,is_int", DRAFTER_KEYS, ids=[f"{a[0]}:{a[1]}" for a in DRAFTER_KEYS])
def test_out_of_range_drafter_value_fails_naming_the_key(name, key, field, is_list, is_int):
    bad = bad_value(C.NUMERIC_RANGES["DrafterConfig"][field], is_int)
    with pytest.raises(C.ConfigError, match=rf"\b{key} must be"):
        V.validate({"drafter": {"name": name, field: [bad] if is_list else bad}})


@pytest.mark.parametrize("schema,key,cls,name,is_list,is_int", ALL, ids=[f"{a[0]}:{a[1]}" for a in ALL])
def test_out_of_range_value_fails_naming_the_key(schema, key, cls, name, is_list, is_int):
    rule = C.numeric_ranges(cls)[name]
    bad = bad_value(rule, is_int)
    with pytest.raises(C.ConfigError, match=rf"\b{key} must be"):
        validate(schema, key, [bad] if is_list else bad)


@pytest.mark.parametrize("override", ["trainer.log_every=0", "trainer.keep_checkpoints=0", "trainer.save_every=-5",
                                      "trainer.micro_batch_size=0", "trainer.max_steps=0", "drafter.num_mask_tokens=-1",
                                      "drafter.draft_vocab_size=-1", "data.heldout=-1", "optim.lr=0"])  # fmt: skip
def test_bad_values_fail_before_any_model_loads(override, monkeypatch, tmp_path):
    """``train.run`` on the composed config raises ConfigError naming the key before the target loads."""
    from helpers import compose_dict

    import drafttrain.target
    from drafttrain.train import run

    def boom(*a, **k):
        raise AssertionError("the target was loaded before the config was checked")

    monkeypatch.setattr(drafttrain.target, "load_target", boom)
    cfg = compose_dict("train", ["+recipe=parallelspec", "target=tiny", override, f"output_dir={tmp_path}"])
    with pytest.raises(C.ConfigError, match=override.split("=")[0]):
        run(cfg)
    assert not any(tmp_path.iterdir())  # nothing written either
