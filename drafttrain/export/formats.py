"""The serving formats: what each engine's folder is, and which drafters declare it.

A format is an engine's drafter folder (its ``config.json`` keys and tensor names). Which drafters a format
writes is not listed here: each drafter class declares the formats its network is
(:attr:`drafttrain.drafters.base.Drafter.serving_formats`, format -> the model type the folder names), so a
new drafter that is an existing format's network exports by declaring it, and no exporter tests a drafter's
name. Each format's module under ``drafttrain/export/`` has ``export(drafter, out_dir, **options) -> engine
config``, ``load(directory, target) -> Drafter`` (drafttrain's reader of the folder, for round trips),
``layout(cfg, shapes)`` (the sizes :mod:`drafttrain.export.verify` checks) and ``WEIGHTS``.

| format | engine | how it is served |
|---|---|---|
| ``speculators`` | vLLM | ``vllm serve DIR``, or ``speculative_config={"model": DIR, "method": "eagle3"}`` |
| ``sglang`` | SGLang | ``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`` |
| ``vllm_medusa`` | vLLM | ``"method": "medusa"`` |
| ``vllm_eagle`` | vLLM | ``"method": "eagle"`` (EAGLE-1) |
| ``dflash`` | vLLM | ``"method": "dflash"``, ``num_speculative_tokens`` = block size - 1 (speculators' DFlash format) |
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from drafttrain.export.common import ExportError


@dataclass(frozen=True)
class Format:
    """What the export, its serve lines and its checks need to know of a format (facts of its engine).

    Attributes:
        module: the module under ``drafttrain.export`` that writes and reads it.
        engine: the serving engine, for messages (``vLLM``, ``SGLang``).
        vllm_method: vLLM's ``speculative_config`` ``method`` (None: not a vLLM folder; its module then has
            ``serve_commands(out, verifier, n_spec)``).
        serves_folder: the folder names its verifier, so ``vllm serve DIR`` serves it as it is.
        dynamic_k: vLLM's proposer for it drafts a K chosen per step, so it takes a batch-size schedule of K
            (``num_speculative_tokens_per_batch_size``); vLLM 0.32's Medusa proposer asserts K equals its
            maximum, DFlash drafts its whole block, and parallel drafting with a schedule stopped the CPU
            engine at the first smaller K (EAGLE-3 chains with the same schedule stayed lossless).
        k_is_depth: the engine drafts the drafter's whole depth each step (DFlash's block): K = the draft depth.
        drafting: how the engine drafts where it overrides the drafter's own (SGLang drafts autoregressively,
            whatever the network); None = the drafter's.
    """

    module: str
    engine: str
    vllm_method: str | None = None
    serves_folder: bool = False
    dynamic_k: bool = False
    k_is_depth: bool = False
    drafting: str | None = None


#: format name -> :class:`Format`
FORMATS: dict[str, Format] = {
    "speculators": Format("speculators", "vLLM", vllm_method="eagle3", serves_folder=True, dynamic_k=True),
    "sglang": Format("sglang", "SGLang", drafting="autoregressive"),
    "vllm_medusa": Format("medusa", "vLLM", vllm_method="medusa"),
    "vllm_eagle": Format("vllm_eagle", "vLLM", vllm_method="eagle", dynamic_k=True),
    "dflash": Format("dflash", "vLLM", vllm_method="dflash", serves_folder=True, k_is_depth=True),
}
#: format -> vLLM's speculative method, for the formats vLLM serves
VLLM_METHOD = {f: x.vllm_method for f, x in FORMATS.items() if x.vllm_method}


def writers(fmt: str) -> list[str]:
    """The registered drafters that declare format ``fmt``, by name."""
    from drafttrain.drafters import DRAFTERS

    return [name for name, cls in DRAFTERS.items() if fmt in cls.serving_formats]


def formats_for(drafter: str) -> list[str]:
    """The export formats the registered drafter ``drafter`` declares (first = default), possibly none; an unknown
    name has none."""
    from drafttrain.drafters import DRAFTERS

    cls = DRAFTERS.get(drafter)
    return [f for f in (cls.serving_formats if cls is not None else {}) if f in FORMATS]


def format_table() -> str:
    """One entry per format, ``format: the drafters that declare it``, for error messages."""
    return "; ".join(f"{f}: {', '.join(writers(f)) or 'no drafter'}" for f in FORMATS)


def resolve_format(drafter: str, fmt: str | None) -> str:
    """``fmt`` checked against the formats drafter ``drafter`` declares (None = its default format).

    Raises:
        ExportError: unknown format, or the drafter declares none / not this one (the message lists what exists).
    """
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"unknown export format '{fmt}'; formats: {format_table()}")
    fits = formats_for(drafter)
    if not fits:
        raise ExportError(f"no serving-engine format exists for '{drafter}' drafters; formats that exist "
                          f"(format: drafters): {format_table()}")  # fmt: skip
    if fmt is None:
        return fits[0]
    if fmt not in fits:
        raise ExportError(f"format '{fmt}' does not write '{drafter}' drafters; for '{drafter}': {fits}")
    return fmt


def module(fmt: str):
    """The module implementing format ``fmt`` (imported lazily)."""
    return importlib.import_module(f"drafttrain.export.{FORMATS[fmt].module}")


def check_declares(drafter, fmt: str) -> str:
    """The model type ``drafter`` declares for ``fmt`` (what the folder's config names).

    Raises:
        ExportError: the drafter does not declare ``fmt`` (the message names the drafter and what it declares).
    """
    kind = type(drafter).serving_formats.get(fmt)
    if kind is None:
        raise ExportError(f"the {fmt} format writes the drafters that declare it ({', '.join(writers(fmt))}), not "
                          f"'{drafter.name}' (it declares {sorted(type(drafter).serving_formats) or 'none'})")  # fmt: skip
    return kind


def reader_class(fmt: str, model_type: str, directory):
    """The drafter class a folder of ``fmt`` naming ``model_type`` is read into
    (:func:`drafttrain.drafters.drafter_for_serving`).

    Raises:
        ExportError: no registered drafter declares it.
    """
    from drafttrain.drafters import drafter_for_serving

    cls = drafter_for_serving(fmt, model_type)
    if cls is None:
        raise ExportError(f"{directory}: a {fmt} folder of model type {model_type!r}, which no drafter of this "
                          f"drafttrain declares ({format_table()})")  # fmt: skip
    return cls
