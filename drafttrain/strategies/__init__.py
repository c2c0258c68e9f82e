"""Training strategies: how a micro-batch of rows becomes a loss (``trainer.strategy``).

The loop (:mod:`drafttrain.train.loop`) draws the rows of every micro-batch (data order: a pure function of
the seed and the sample counter), then hands them to its strategy and back-propagates what it returns:

- ``strategy.make_batch(ds, indices, device)``: the rows as a training batch (the offline strategies: the
  dataset's rows with their target features; a strategy may make rows of its own);
- ``strategy.loss(drafter, batch, generator, step, micro)``: a :class:`~drafttrain.drafters.base.LossOutput`.
  ``drafter`` is the prepared (DDP / DeepSpeed-wrapped) module: call it as ``drafter(batch, generator,
  objective)`` so the wrappers see the forward;
- ``strategy.window_metrics()``: the strategy's own figures since the last log line (e.g. seconds spent
  labelling), merged into the loop's ``train/*`` metrics.

The library's strategies: :class:`~drafttrain.strategies.offline.OfflineStrategy` (``offline``: the
dataset's rows, the recipe's loss, ``loss.*``), :class:`~drafttrain.strategies.on_policy.OnPolicyStrategy`
(``on_policy``: the drafter's own drafts labelled by the frozen target in one forward through the group-wise
layout) and :class:`~drafttrain.strategies.on_policy.MixedStrategy` (``mixed``: a scheduled share of
on-policy micro-batches). A strategy defined elsewhere joins with :func:`register_strategy`.
"""

from __future__ import annotations

from drafttrain.strategies.base import TrainingStrategy
from drafttrain.strategies.offline import OfflineStrategy
from drafttrain.strategies.on_policy import MixedStrategy, OnPolicyConfig, OnPolicyStrategy, label_drafts

#: name -> strategy class (``trainer.strategy``).
STRATEGIES: dict[str, type[TrainingStrategy]] = {}


def register_strategy(cls: type[TrainingStrategy]) -> type[TrainingStrategy]:
    """Register a strategy class under its ``name`` (usable as a class decorator); validation then accepts
    ``trainer.strategy=NAME`` and, where the class declares ``config`` and ``config_section``, the keys
    ``trainer.<config_section>.*`` (validated against ``config``). Returns ``cls``.

    Raises:
        TypeError: not a :class:`TrainingStrategy` subclass, or ``config`` not a dataclass.
        ValueError: no name, the name taken by another class, only one of ``config`` / ``config_section``, a
            section that is a key of the trainer's own, or a section another strategy declares with another class.
    """
    from dataclasses import fields, is_dataclass

    from drafttrain.config import TrainerConfig

    if not (isinstance(cls, type) and issubclass(cls, TrainingStrategy)):
        raise TypeError(f"register_strategy needs a TrainingStrategy subclass, got {cls!r}")
    name = getattr(cls, "name", "")
    if not name or name == "base":
        raise ValueError(f"{cls.__qualname__} needs a class attribute name (the trainer.strategy value)")
    old = STRATEGIES.get(name)
    if old is not None and old is not cls and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"training strategy '{name}' is already registered by {old.__module__}.{old.__qualname__}")
    section, schema = cls.config_section, cls.config
    if (section is None) != (schema is None):
        raise ValueError(f"{cls.__qualname__} declares config_section={section!r} and config={schema!r}: both or neither")
    if schema is not None:
        if not is_dataclass(schema):
            raise TypeError(f"{cls.__qualname__}.config must be a dataclass, got {schema!r}")
        if section in {f.name for f in fields(TrainerConfig)}:
            raise ValueError(f"{cls.__qualname__}.config_section '{section}' is a key of the trainer's own")
        other = strategy_sections().get(section)
        if other is not None and other is not schema and other.__qualname__ != schema.__qualname__:
            raise ValueError(f"trainer.{section} is declared by another strategy with {other.__qualname__}, "
                             f"not {schema.__qualname__}")  # fmt: skip
    STRATEGIES[name] = cls
    return cls


def strategy_sections() -> dict[str, type]:
    """``{section key under trainer: its dataclass}`` of every registered strategy with keys of its own."""
    return {c.config_section: c.config for c in STRATEGIES.values() if c.config is not None}


for _cls in (OfflineStrategy, OnPolicyStrategy, MixedStrategy):
    register_strategy(_cls)


def strategy_problems(c) -> list[str]:
    """What the chosen strategy needs that the chosen drafter lacks, read from the declarations
    (``TrainingStrategy.requires`` against ``Drafter.objectives``), one message per need naming both and the
    drafter's reason; checked with the config, before any model loads (by :func:`drafttrain.validation.validate`)."""
    from drafttrain.drafters import DRAFTERS

    cls, drafter = STRATEGIES.get(c.trainer.strategy), DRAFTERS.get(c.drafter.name)
    if cls is None or drafter is None:
        return []  # an unknown name: validation already says so
    return [f"trainer.strategy={cls.name}: drafter '{c.drafter.name}' {cannot}: {drafter.objective_refusal}"
            for need, cannot in cls.requires.items() if need not in drafter.objectives]


def build_strategy(c, target, feature_layers, get_batch) -> TrainingStrategy:
    """The strategy ``c.trainer.strategy`` of a validated :class:`~drafttrain.config.TrainConfig`, with the data
    pipeline's collator ``get_batch`` (:func:`drafttrain.data.batches.get_batch`) for its rows.

    Raises:
        ValueError: an unregistered name.
    """
    name = c.trainer.strategy
    if name not in STRATEGIES:
        raise ValueError(f"unknown trainer.strategy '{name}'; known: {sorted(STRATEGIES)}")
    strategy = STRATEGIES[name](c, target, feature_layers)
    strategy.get_batch = get_batch
    return strategy


__all__ = ["STRATEGIES", "MixedStrategy", "OfflineStrategy", "OnPolicyConfig", "OnPolicyStrategy", "TrainingStrategy",
           "build_strategy", "label_drafts", "register_strategy", "strategy_problems", "strategy_sections"]  # fmt: skip
