"""Drafters behind one interface (:class:`~drafttrain.drafters.base.Drafter`); recipe name = drafter name.

The registry :data:`DRAFTERS` maps a name to its class. The library's drafters are registered here; a
drafter defined anywhere else (a test file, a user's module) joins with :func:`register_drafter` and is
then usable by name everywhere a name is read: ``drafter.name=NAME`` in a training config (its config
keys are validated against its ``defaults``, :func:`drafttrain.validation.validate`), :func:`build_drafter`,
``Drafter.from_pretrained`` of its checkpoints, and the verifier (which follows its ``spec``).
"""

from __future__ import annotations

from drafttrain.drafters.base import (
    DRAFTERS,
    LAST_LAYER,
    Drafter,
    DrafterSpec,
    DraftGroups,
    LossOutput,
    Objective,
    SharedTargetModules,
)
from drafttrain.drafters.dflash import DFlashDrafter
from drafttrain.drafters.eagle import EagleDrafter
from drafttrain.drafters.eagle3 import Eagle3Drafter
from drafttrain.drafters.medusa import MedusaDrafter
from drafttrain.drafters.parallelspec import ParallelSpecDrafter
from drafttrain.drafters.parallelspec_eagle import ParallelSpecEagleDrafter
from drafttrain.drafters.parallelspec_eagle3 import ParallelSpecEagle3Drafter

# DRAFTERS (name -> class) lives in drafttrain.drafters.base, so Drafter.from_pretrained reads it without
# importing this package's modules back; register_drafter below fills it.


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Register a drafter class under its ``name`` (usable as a class decorator); returns ``cls``.

    The class must set ``name`` (a new one, or the same class again: re-importing a module is fine),
    ``spec`` (a :class:`DrafterSpec`) and ``defaults`` (a dict of every config key it reads, each with
    its default; values must be bool, int, float, str, None or a list of them, so the config schema can
    be derived from them).

    Raises:
        TypeError: not a :class:`Drafter` subclass, or ``spec``/``defaults`` missing or of the wrong kind.
        ValueError: ``name`` already names another class, or is ``"base"``/empty.
    """
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(f"register_drafter needs a Drafter subclass, got {cls!r}")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name or name == "base":
        raise ValueError(f"{cls.__qualname__} needs a class attribute name (the registry key), got {name!r}")
    if not isinstance(cls.__dict__.get("spec", getattr(cls, "spec", None)), DrafterSpec):
        raise TypeError(f"drafter '{name}' ({cls.__qualname__}) needs a class attribute spec = DrafterSpec(...)")
    if not isinstance(cls.defaults, dict) or "name" in cls.defaults:
        raise TypeError(f"drafter '{name}': defaults must be a dict of its config keys (without 'name')")
    old = DRAFTERS.get(name)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"drafter name '{name}' is already registered by {old.__module__}.{old.__qualname__}")
    DRAFTERS[name] = cls
    return cls


for _cls in (MedusaDrafter, EagleDrafter, Eagle3Drafter, ParallelSpecDrafter, ParallelSpecEagleDrafter,
             ParallelSpecEagle3Drafter, DFlashDrafter):
    register_drafter(_cls)


def drafter_class(name: str) -> type[Drafter]:
    """The registered class of drafter ``name``.

    Raises:
        ValueError: unknown drafter name (the message lists the registered ones).
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter '{name}'; known: {sorted(DRAFTERS)} (register others with register_drafter)")
    return DRAFTERS[name]


def build_drafter(name: str, config: dict, target) -> Drafter:
    """Build a fresh drafter ``name`` for ``target`` (shared modules bound by reference).

    Args:
        name: a key of :data:`DRAFTERS`.
        config: the drafter's config keys (a subset of its ``defaults``; see :func:`drafter_config`).

    Raises:
        ValueError: unknown drafter name, or a config key the drafter does not read.
    """
    return drafter_class(name)(config, SharedTargetModules.from_target(target))


def drafter_config(name: str, full: dict) -> dict:
    """The keys of a full drafter config (e.g. the validated training config's ``drafter`` section) that
    drafter ``name`` reads.

    Raises:
        ValueError: unknown drafter name.
    """
    return drafter_class(name).select_config(full)


__all__ = [
    "DRAFTERS",
    "DFlashDrafter",
    "LAST_LAYER",
    "Drafter",
    "DrafterSpec",
    "DraftGroups",
    "Eagle3Drafter",
    "EagleDrafter",
    "LossOutput",
    "MedusaDrafter",
    "Objective",
    "ParallelSpecDrafter",
    "ParallelSpecEagle3Drafter",
    "ParallelSpecEagleDrafter",
    "SharedTargetModules",
    "build_drafter",
    "drafter_class",
    "drafter_for_serving",
    "drafter_config",
    "register_drafter",
]


def drafter_for_serving(fmt: str, model_type: str) -> type[Drafter] | None:
    """The registered drafter class whose network a folder of serving format ``fmt`` naming ``model_type`` holds
    (the classes' :attr:`~drafttrain.drafters.base.Drafter.serving_formats`): of several that declare it (SGLang's
    EAGLE-3 folder is both EAGLE-3's and parallel drafting's on the EAGLE-3 network, which SGLang runs as a chain),
    the most general one (the class the others derive from). None when no class declares it."""
    found = [c for c in DRAFTERS.values() if c.serving_formats.get(fmt) == model_type]
    return min(found, key=lambda c: (len(c.__mro__), c.name)) if found else None

