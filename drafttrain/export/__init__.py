"""Export a trained drafter to the folders serving engines load (docs/design.md, "Serving formats").

One module per format; each has ``export(drafter, out_dir, **options) -> engine config`` and
``load(directory, target) -> Drafter`` (drafttrain's own reader of the exported folder, so tests can hold
the exported network to the trained one logit for logit), and records the tensor names its engine's
loader consumes (engines skip unknown names silently; :func:`drafttrain.export.common.check_consumed`).

| format | engine | recipes |
|---|---|---|
| ``speculators`` | vLLM (``vllm serve DIR``, ``speculative_config={"model": DIR, "method": "eagle3"}``) | eagle3, parallelspec_eagle3 |
| ``sglang`` | SGLang (``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR``) | eagle3, parallelspec_eagle3 |
| ``vllm_medusa`` | vLLM (``"method": "medusa"``) | medusa |
| ``vllm_eagle`` | vLLM (``"method": "eagle"``, EAGLE-1) | eagle (only the variant vLLM's network computes) |
| ``dflash`` | vLLM (``"method": "dflash"``, ``num_speculative_tokens`` = B - 1; speculators' DFlash format) | dflash |

ParallelSpec's Medusa and EAGLE integrations (``parallelspec``, ``parallelspec_eagle``) have no engine
format: no engine runs their mask-token drafting over a fc([e; f]) item layer.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from drafttrain.export.common import ExportError

# format -> module (under drafttrain.export) and the drafter recipes it writes
FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "speculators": ("speculators", ("eagle3", "parallelspec_eagle3")),
    "sglang": ("sglang", ("eagle3", "parallelspec_eagle3")),
    "vllm_medusa": ("medusa", ("medusa",)),
    "vllm_eagle": ("vllm_eagle", ("eagle",)),
    "dflash": ("dflash", ("dflash",)),
}


def formats_for(recipe: str) -> list[str]:
    """The export formats that exist for drafter ``recipe`` (first = default), possibly none."""
    return [f for f, (_, recipes) in FORMATS.items() if recipe in recipes]


def format_table() -> str:
    """One line per format: 'format (engine): recipes', for error messages."""
    return "; ".join(f"{f}: {', '.join(r)}" for f, (_, r) in FORMATS.items())


def resolve_format(recipe: str, fmt: str | None) -> str:
    """``fmt`` checked against ``recipe`` (None = the recipe's default format).

    Raises:
        ExportError: unknown format, or none/this one does not exist for the recipe (lists what exists).
    """
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"unknown export format '{fmt}'; formats: {format_table()}")
    fits = formats_for(recipe)
    if not fits:
        raise ExportError(f"no serving-engine format exists for '{recipe}' drafters; formats that exist "
                          f"(format: recipes): {format_table()}")  # fmt: skip
    if fmt is None:
        return fits[0]
    if fmt not in fits:
        raise ExportError(f"format '{fmt}' does not write '{recipe}' drafters; for '{recipe}': {fits}")
    return fmt


def module(fmt: str):
    """The module implementing format ``fmt`` (imported lazily)."""
    return importlib.import_module(f"drafttrain.export.{FORMATS[fmt][0]}")


def export_drafter(drafter, fmt: str | None, out_dir: str | Path, **options) -> tuple[str, dict]:
    """Write ``drafter`` to ``out_dir`` in format ``fmt`` (None = the recipe's default).

    Options are the format's (e.g. ``verifier``, ``num_speculative_tokens``, ``target_config``).

    Returns:
        (format written, the engine config written to ``out_dir/config.json``).

    Raises:
        ExportError: see :func:`resolve_format`, or the format cannot represent this drafter exactly.
    """
    fmt = resolve_format(drafter.name, fmt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return fmt, module(fmt).export(drafter, out, **options)


def load_exported(directory: str | Path, fmt: str, target):
    """drafttrain's reader of an exported folder: the drafter the engine would run, bound to ``target``."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format '{fmt}'; formats: {format_table()}")
    return module(fmt).load(Path(directory), target)


__all__ = ["FORMATS", "ExportError", "export_drafter", "format_table", "formats_for", "load_exported", "resolve_format"]
