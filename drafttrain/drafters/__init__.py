"""Drafters behind one interface (:class:`~drafttrain.drafters.base.Drafter`); recipe name = drafter name."""

from drafttrain.drafters.base import Drafter, LossOutput, SharedTargetModules
from drafttrain.drafters.parallelspec import ParallelSpecDrafter

DRAFTERS: dict[str, type[Drafter]] = {ParallelSpecDrafter.name: ParallelSpecDrafter}


def build_drafter(name: str, config: dict, target) -> Drafter:
    """Build a fresh drafter ``name`` for ``target`` (shared modules bound by reference).

    Raises:
        ValueError: unknown drafter name.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter '{name}'; known: {sorted(DRAFTERS)}")
    return DRAFTERS[name](config, SharedTargetModules.from_target(target))


__all__ = ["DRAFTERS", "Drafter", "LossOutput", "SharedTargetModules", "ParallelSpecDrafter", "build_drafter"]
