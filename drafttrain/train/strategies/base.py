"""The training-strategy protocol (:mod:`drafttrain.train.strategies`): rows -> batch -> loss."""

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
    #: What the strategy needs of the drafter, read by :func:`drafttrain.train.strategies.strategy_problems`
    #: before any model loads: drafter objective (``Drafter.objectives``) -> what a drafter without it cannot do
    #: (the refusal's words, followed by the drafter's ``objective_refusal``).
    requires: ClassVar[dict[str, str]] = {}
    #: The config section the strategy reads besides ``loss.*`` (for messages and docs), or None.
    config_section: ClassVar[str | None] = None

    def __init__(self, c, target, feature_layers):
        self.c, self.target, self.feature_layers = c, target, feature_layers

    def objective(self, **extra: Any) -> Objective | None:
        """The run's ``loss.*`` as an :class:`~drafttrain.drafters.base.Objective` with ``extra`` fields; None
        when everything is at the recipe's default (so drafters without objective support train as before)."""
        lc = self.c.loss
        if lc.divergence == "forward_kl" and not lc.cut_at_first_miss and not extra:
            return None
        return Objective(divergence=lc.divergence, cut_at_first_miss=lc.cut_at_first_miss, cut_weight=lc.cut_weight,
                         **extra)  # fmt: skip

    def make_batch(self, ds, indices: list[int], device) -> dict[str, torch.Tensor]:
        """Rows ``indices`` of ``ds`` as a training batch (:func:`drafttrain.data.batches.get_batch`)."""
        from drafttrain.data.batches import get_batch

        return get_batch(ds, self.target, indices, device, self.feature_layers)

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
