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

The library's strategies: :class:`~drafttrain.train.strategies.offline.OfflineStrategy` (``offline``: the
dataset's rows, the recipe's loss, ``loss.*``), :class:`~drafttrain.train.strategies.on_policy.OnPolicyStrategy`
(``on_policy``: the drafter's own drafts labelled by the frozen target in one forward through the group-wise
layout) and :class:`~drafttrain.train.strategies.on_policy.MixedStrategy` (``mixed``: a scheduled share of
on-policy micro-batches). A strategy defined elsewhere joins with :func:`register_strategy`.
"""

from __future__ import annotations

from drafttrain.config import TRAINING_STRATEGIES
from drafttrain.train.strategies.base import TrainingStrategy
from drafttrain.train.strategies.offline import OfflineStrategy
from drafttrain.train.strategies.on_policy import MixedStrategy, OnPolicyStrategy, label_drafts

#: name -> strategy class (``trainer.strategy``).
STRATEGIES: dict[str, type[TrainingStrategy]] = {}


def register_strategy(cls: type[TrainingStrategy]) -> type[TrainingStrategy]:
    """Register a strategy class under its ``name`` (usable as a class decorator); validation then accepts
    ``trainer.strategy=NAME``. Returns ``cls``.

    Raises:
        TypeError: not a :class:`TrainingStrategy` subclass.
        ValueError: no name, or the name is taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, TrainingStrategy)):
        raise TypeError(f"register_strategy needs a TrainingStrategy subclass, got {cls!r}")
    name = getattr(cls, "name", "")
    if not name or name == "base":
        raise ValueError(f"{cls.__qualname__} needs a class attribute name (the trainer.strategy value)")
    old = STRATEGIES.get(name)
    if old is not None and old is not cls and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"training strategy '{name}' is already registered by {old.__module__}.{old.__qualname__}")
    STRATEGIES[name] = cls
    TRAINING_STRATEGIES.add(name)
    return cls


for _cls in (OfflineStrategy, OnPolicyStrategy, MixedStrategy):
    register_strategy(_cls)


def strategy_problems(c) -> list[str]:
    """What the chosen strategy needs that the chosen drafter lacks, read from the declarations
    (``TrainingStrategy.requires`` against ``Drafter.objectives``), one message per need naming both and the
    drafter's reason; checked with the config, before any model loads (:func:`drafttrain.train.loop.validate_run`)."""
    from drafttrain.drafters import DRAFTERS

    cls, drafter = STRATEGIES.get(c.trainer.strategy), DRAFTERS.get(c.drafter.name)
    if cls is None or drafter is None:
        return []  # an unknown name: validation already says so
    return [f"trainer.strategy={cls.name}: drafter '{c.drafter.name}' {cannot}: {drafter.objective_refusal}"
            for need, cannot in cls.requires.items() if need not in drafter.objectives]


def build_strategy(c, target, feature_layers) -> TrainingStrategy:
    """The strategy ``c.trainer.strategy`` of a validated :class:`~drafttrain.config.TrainConfig`.

    Raises:
        ValueError: an unregistered name.
    """
    name = c.trainer.strategy
    if name not in STRATEGIES:
        raise ValueError(f"unknown trainer.strategy '{name}'; known: {sorted(STRATEGIES)}")
    return STRATEGIES[name](c, target, feature_layers)


__all__ = ["STRATEGIES", "MixedStrategy", "OfflineStrategy", "OnPolicyStrategy", "TrainingStrategy",
           "build_strategy", "label_drafts", "register_strategy", "strategy_problems"]  # fmt: skip
