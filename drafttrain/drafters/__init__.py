"""Drafters behind one interface (:class:`~drafttrain.drafters.base.Drafter`); recipe name = drafter name."""

from drafttrain.drafters.base import Drafter, LossOutput, SharedTargetModules
from drafttrain.drafters.eagle import EagleDrafter
from drafttrain.drafters.medusa import MedusaDrafter
from drafttrain.drafters.parallelspec import ParallelSpecDrafter
from drafttrain.drafters.parallelspec_eagle import ParallelSpecEagleDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    cls.name: cls for cls in (MedusaDrafter, EagleDrafter, ParallelSpecDrafter, ParallelSpecEagleDrafter)
}


def build_drafter(name: str, config: dict, target) -> Drafter:
    """Build a fresh drafter ``name`` for ``target`` (shared modules bound by reference).

    Args:
        name: a key of :data:`DRAFTERS`.
        config: the drafter's config keys (a subset of its ``defaults``; see :func:`drafter_config`).

    Raises:
        ValueError: unknown drafter name, or a config key the drafter does not read.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter '{name}'; known: {sorted(DRAFTERS)}")
    return DRAFTERS[name](config, SharedTargetModules.from_target(target))


def drafter_config(name: str, full: dict) -> dict:
    """The keys of a full drafter config (every ``DrafterConfig`` field) that drafter ``name`` reads.

    Raises:
        ValueError: unknown drafter name.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter '{name}'; known: {sorted(DRAFTERS)}")
    return DRAFTERS[name].select_config(full)


__all__ = [
    "DRAFTERS",
    "Drafter",
    "EagleDrafter",
    "LossOutput",
    "MedusaDrafter",
    "ParallelSpecDrafter",
    "ParallelSpecEagleDrafter",
    "SharedTargetModules",
    "build_drafter",
    "drafter_config",
]
