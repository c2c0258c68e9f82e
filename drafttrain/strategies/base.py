"""The training-strategy protocol (:mod:`drafttrain.strategies`): rows -> batch -> loss."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from drafttrain.drafters.base import LossOutput, Objective


class TrainingStrategy:
    """Base class: how the loop's rows become a batch and a batch a loss.

    Subclasses set ``name`` (the ``trainer.strategy`` value) and implement :meth:`loss`; :meth:`make_batch`
    defaults to the dataset's rows with the target features the drafter declares.

    Args:
        c: the validated :class:`~drafttrain.config.TrainConfig`.
        target: the frozen :class:`~drafttrain.target.Target`.
        feature_layers: the target layer ids the drafter reads (``Drafter.layers_for``).
    """

    name: ClassVar[str] = "base"
    #: What the strategy needs of the drafter, read by :func:`drafttrain.strategies.strategy_problems`
    #: before any model loads: drafter objective (``Drafter.objectives``) -> what a drafter without it cannot do
    #: (the refusal's words, followed by the drafter's ``objective_refusal``).
    requires: ClassVar[dict[str, str]] = {}
    #: The strategy's own keys: a dataclass (each field with its default; ``numeric_ranges`` beside the fields, as
    #: a decoding method's section declares them), validated as ``trainer.<config_section>`` before any model
    #: loads (:func:`drafttrain.validation.train_schema` adds one field per registered section); None = no keys.
    config: ClassVar[type | None] = None
    #: The key of that section under ``trainer`` (strategies that share their keys name the same section and class).
    config_section: ClassVar[str | None] = None

    def __init__(self, c, target, feature_layers):
        self.c, self.target, self.feature_layers = c, target, feature_layers
        #: rows -> batch, ``get_batch(ds, target, indices, device, feature_layers)``: the data pipeline's collator,
        #: handed in by :func:`drafttrain.strategies.build_strategy` (strategies sit below the data package)
        self.get_batch = None

    @property
    def options(self):
        """The run's ``trainer.<config_section>`` (an instance of :attr:`config`; its defaults where the config
        object was built by hand without the section). Raises ``AttributeError`` for a strategy without keys."""
        if self.config is None or self.config_section is None:
            raise AttributeError(f"strategy '{self.name}' declares no config section")
        return getattr(self.c.trainer, self.config_section, None) or self.config()

    def objective(self, **extra: Any) -> Objective | None:
        """The run's ``loss.*`` as an :class:`~drafttrain.drafters.base.Objective` with ``extra`` fields; None
        when everything is at the recipe's default (so drafters without objective support train as before)."""
        lc = self.c.loss
        if lc.divergence == "forward_kl" and not lc.cut_at_first_miss and not extra:
            return None
        return Objective(divergence=lc.divergence, cut_at_first_miss=lc.cut_at_first_miss, cut_weight=lc.cut_weight,
                         **extra)  # fmt: skip

    def make_batch(self, ds, indices: list[int], device) -> dict[str, torch.Tensor]:
        """Rows ``indices`` of ``ds`` as a training batch (:func:`drafttrain.data.batches.get_batch`, handed in as
        :attr:`get_batch`).

        Raises:
            RuntimeError: the strategy was not built by :func:`~drafttrain.strategies.build_strategy` (no collator).
        """
        if self.get_batch is None:
            raise RuntimeError(f"strategy '{self.name}' has no collator: build it with drafttrain.strategies.build_strategy")
        return self.get_batch(ds, self.target, indices, device, self.feature_layers)

    def loss(self, drafter, batch: dict[str, torch.Tensor], generator: torch.Generator, step: int,
             micro: int) -> LossOutput:  # fmt: skip
        """The loss of one micro-batch at optimizer step ``step`` (0-based), micro-batch ``micro`` (global
        index within the step). ``generator`` seeds the drafter's anchor draws (the loop's)."""
        raise NotImplementedError

    def window_metrics(self) -> dict[str, float]:
        """The strategy's own figures since the last call (logged as ``train/*``), then reset."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own state that a resumed run must find again (JSON-serialisable), saved in every
        checkpoint (``strategy_state`` in its ``trainer_state.json``); none by default: the built-in strategies'
        choices are pure functions of the seed and the step."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, when a run resumes from a checkpoint."""
