"""The decoding-method registry: what the evaluation harness and the eval config know about a method.

A method is a way to decode with the bundled engine: the checkpoint's own drafter, a training-free
drafter (SSSD), a tree grown another way (MCSD), another acceptance rule (MTAD), a verifier benchmark
(replay). Each lives in one module under ``drafttrain/verify/methods/`` that ends with a
:func:`register` call; config validation (:func:`drafttrain.config.validate_eval`) and the harness
(:func:`drafttrain.eval.harness.evaluate`) read :data:`METHODS` and nothing else, so adding a method
touches its module, its config section (a dataclass in the same module) and its tests (docs/design.md,
"Adding a decoding method").

Lossless or lossy is never decided by a method's name: every run's ``lossless`` flag is the
proposer's own ``lossless`` attribute (``Method.lossless`` describes the method for readers and
listings; ``None`` = it depends on the method's settings, e.g. MCSD's W_t).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MethodContext:
    """What a method's factory may read, and where it may report, once the models are loaded.

    Attributes:
        config: the validated eval config (:class:`~drafttrain.config.EvalConfig` plus one attribute
            per registered config section, e.g. ``config.sssd``).
        target: the loaded :class:`~drafttrain.target.Target`.
        drafter: the checkpoint's drafter, or None when no selected method ``needs_drafter``.
        prompts: the prompts' token ids (chat template applied), one list per prompt.
        results: extra top-level keys of ``results.json`` (e.g. SSSD's ``sssd_planner``); methods may
            fill them while runs go on (they are written at the end).
        drafter_info: extra keys of ``results.json``'s ``drafter`` block.
    """

    config: Any
    target: Any
    drafter: Any
    prompts: list[list[int]]
    results: dict[str, Any] = field(default_factory=dict)
    drafter_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Variant:
    """One speculative run per (batch size, engine mode): a label and how to build its proposer.

    Attributes:
        label: the run's ``method`` in ``results.json`` (e.g. ``mcsd_w2``, ``sssd_n8``).
        make: ``(batch_size, plain_outputs) -> proposer``: a fresh engine proposer per run (proposers
            keep per-sequence state). ``plain_outputs`` are the plain greedy token lists of that batch
            size, in prompt order (only a verifier benchmark such as replay reads them).
        warm: builds the proposer of the untimed warm-up run (default: ``make(2, warm-up plain outputs)``);
            for variants whose ``make`` does costly planning that the warm-up must not trigger.
        finish: ``(proposer, run_record, batch_size)`` after a timed run: add method-specific fields to
            the run's record (a dict) or write side outputs.
    """

    label: str
    make: Callable[[int, list[list[int]]], Any]
    warm: Callable[[], Any] | None = None
    finish: Callable[[Any, dict, int], None] | None = None


@dataclass(frozen=True)
class Method:
    """A registered decoding method.

    Attributes:
        name: the name in ``methods=[...]`` (and ``proposer=``).
        build: ``MethodContext -> list[Variant]``: the method's runs (one or several, e.g. one per W_t).
        needs_drafter: the method drafts with the checkpoint's drafter (``checkpoint=`` is then required,
            or ``untrained_drafter=true``).
        lossless: True / False, or None when it depends on the settings; for docs and listings only
            (each run reports its proposer's ``lossless``).
        config: the dataclass of the method's section of ``conf/evaluate.yaml`` (validated with the rest
            of the eval config: a typo'd key fails before any model loads), or None.
        section: the section's key (default ``name``).
        check: ``eval_config -> list of problems`` (value checks; run at validation, before models load).
        preflight: ``eval_config -> None``, raises before the target loads (e.g. a missing file).
        summary: one line for listings.
    """

    name: str
    build: Callable[[MethodContext], list[Variant]]
    needs_drafter: bool = False
    lossless: bool | None = True
    config: type | None = None
    section: str | None = None
    check: Callable[[Any], list[str]] | None = None
    preflight: Callable[[Any], None] | None = None
    summary: str = ""

    @property
    def section_key(self) -> str | None:
        return None if self.config is None else (self.section or self.name)


#: name -> :class:`Method`; filled by :func:`register` when ``drafttrain.verify.methods`` is imported.
METHODS: dict[str, Method] = {}


def register(method: Method, *aliases: str) -> Method:
    """Add ``method`` under its name (and ``aliases``).

    Raises:
        ValueError: a name is taken by another method, or two methods claim one config section with
            different dataclasses.
    """
    for name in (method.name, *aliases):
        if name in METHODS and METHODS[name] is not method:
            raise ValueError(f"decoding method {name!r} is already registered")
    key = method.section_key
    for other in METHODS.values():
        if key is not None and other.section_key == key and other.config is not method.config:
            raise ValueError(f"config section {key!r} of method {method.name!r} is taken by {other.name!r}")
    for name in (method.name, *aliases):
        METHODS[name] = method
    return method


def get_method(name: str) -> Method:
    """The method registered as ``name``.

    Raises:
        KeyError: unknown name (the message lists the registered ones).
    """
    if name not in METHODS:
        raise KeyError(f"unknown decoding method {name!r}; registered: {sorted(METHODS)}")
    return METHODS[name]


def config_sections() -> dict[str, type]:
    """``{section key: dataclass}`` of every registered method that has a config section."""
    return {m.section_key: m.config for m in METHODS.values() if m.config is not None}


__all__ = ["Method", "MethodContext", "Variant", "METHODS", "register", "get_method", "config_sections"]
