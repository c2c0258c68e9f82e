"""``trainer.strategy=offline``: the dataset's rows, the recipe's loss (and ``loss.*``): what every recipe did
before strategies existed, step for step."""

from __future__ import annotations

from drafttrain.drafters.base import LossOutput
from drafttrain.strategies.base import TrainingStrategy


class OfflineStrategy(TrainingStrategy):
    """The drafter's loss on the dataset's rows, labels from the rows and their stored target features."""

    name = "offline"

    def loss(self, drafter, batch, generator, step: int, micro: int) -> LossOutput:
        return drafter(batch, generator, self.objective())
