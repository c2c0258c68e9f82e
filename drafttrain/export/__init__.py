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
import json
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

    Options are the format's (e.g. ``verifier``, ``num_speculative_tokens``, ``target_config``). Also writes
    ``out_dir/export_info.json`` with the weight files' digests and the target's sizes
    (:func:`drafttrain.export.verify.export_record`), what :func:`load_exported` checks.

    Returns:
        (format written, the engine config written to ``out_dir/config.json``).

    Raises:
        ExportError: see :func:`resolve_format`, or the format cannot represent this drafter exactly.
    """
    fmt = resolve_format(drafter.name, fmt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine_cfg = module(fmt).export(drafter, out, **options)
    from drafttrain.export.common import write_json
    from drafttrain.export.verify import INFO, export_record

    write_json(out / INFO, export_record(out, fmt, drafter, options.get("target_config")))
    return fmt, engine_cfg


def load_exported(directory: str | Path, fmt: str, target):
    """drafttrain's reader of an exported folder: the drafter the engine would run, bound to ``target``.

    Raises:
        ExportError: an unknown format, or the folder fails :func:`drafttrain.export.verify.verify_export`
            (missing / truncated / modified files, sizes that do not fit ``target``), checked before it loads.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format '{fmt}'; formats: {format_table()}")
    from drafttrain.export.verify import verify_export

    verify_export(directory, target, fmt)
    return module(fmt).load(Path(directory), target)


def serve_commands(fmt: str, out: Path, verifier: str, n_spec: int, engine_cfg: dict) -> list[str]:
    """The shell commands that serve an exported folder (printed, and written to ``export_info.json``).

    Args:
        fmt: the format written (a key of :data:`FORMATS`); ``out``: the exported folder;
        ``verifier``: the target name or folder the engine serves; ``n_spec``: tokens drafted per step;
        ``engine_cfg``: the engine config written (its ``speculators_model_type`` "peagle" or
        ``parallel_drafting`` turns on vLLM's parallel drafting).

    Returns:
        vLLM: ``vllm serve VERIFIER --speculative-config '{...}'`` (speculators and DFlash folders name their
        verifier, so ``vllm serve DIR`` comes first); SGLang: its ``launch_server`` line.
    """
    if fmt == "sglang":
        return [f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {n_spec} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {n_spec + 1}"]  # fmt: skip
    method = {"speculators": "eagle3", "vllm_medusa": "medusa", "vllm_eagle": "eagle", "dflash": "dflash"}[fmt]
    spec = {"model": str(out), "method": method, "num_speculative_tokens": n_spec}
    if engine_cfg.get("speculators_model_type") == "peagle" or engine_cfg.get("parallel_drafting"):
        spec["parallel_drafting"] = True
    cmds = [f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'"]
    if fmt in ("speculators", "dflash"):
        cmds.insert(0, f"vllm serve {out}")
    return cmds


def export_run(checkpoint: str | Path, fmt: str | None = None, output_dir: str | Path | None = None,
               target_path: str | None = None, verifier: str | None = None,
               num_speculative_tokens: int | None = None, overwrite: bool = False, target=None) -> Path:
    """Export a training run's (or a drafter folder's) drafter; writes the engine folder + ``export_info.json``.

    ``scripts.export`` and the end of ``train.run`` both call this. ``target``: an already loaded
    :class:`~drafttrain.target.Target` of the run (skips loading it again); ``target_path`` replaces the
    run's own target folder; ``verifier`` (null = the target's folder) is the name the engine serves.

    Returns:
        The folder written (``output_dir``; null = ``outputs/export/<run name>-<format>``).

    Raises:
        ConfigError: a checkpoint without a drafter; a random tiny target with no ``target_path``; a
            non-empty ``output_dir`` without ``overwrite``.
        ExportError: the recipe has no such format, or the format cannot hold the drafter exactly.
    """
    from drafttrain.config import ConfigError, TargetConfig
    from drafttrain.drafters import Drafter
    from drafttrain.drafters.base import DRAFTER_CONFIG
    from drafttrain.export.common import drafter_dir, run_config, write_json
    from drafttrain.target import load_target, resolve_target_dir

    try:
        ddir = drafter_dir(checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"checkpoint={checkpoint}: {err}") from None
    recipe = json.loads((ddir / DRAFTER_CONFIG).read_text())["name"]
    fmt = resolve_format(recipe, fmt)  # before any model loads
    tcfg = TargetConfig(**(run_config(ddir) or {}).get("target", {}))
    if target_path:
        tcfg.path, tcfg.random_init, target = target_path, False, None
    elif tcfg.random_init:
        raise ConfigError(f"{checkpoint} was trained on a random tiny target that exists on no disk: save that "
                          "target (save_pretrained) and pass target_path=DIR")  # fmt: skip
    out = Path(output_dir or f"outputs/export/{Path(checkpoint).resolve().name}-{fmt}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"output_dir {out} is not empty (overwrite=true replaces its files)")
    target_dir = str(Path(resolve_target_dir(tcfg)).resolve())
    target = target if target is not None else load_target(tcfg)
    drafter = Drafter.from_pretrained(ddir, target).eval()
    verifier = verifier or target_dir
    n_spec = int(num_speculative_tokens or drafter.draft_depth)
    _, engine_cfg = export_drafter(drafter, fmt, out, verifier=verifier, num_speculative_tokens=n_spec,
                                   target_config=target.config)  # fmt: skip
    info = {"format": fmt, "recipe": recipe, "checkpoint": str(Path(checkpoint).resolve()), "target_path": target_dir,
            "verifier": verifier, "num_speculative_tokens": n_spec,
            "commands": serve_commands(fmt, out, verifier, n_spec, engine_cfg)}  # fmt: skip
    from drafttrain.export.verify import export_record

    info.update(export_record(out, fmt, drafter, target.config, target_dir))  # digests + target facts: verify_export
    write_json(out / "export_info.json", info)
    return out


__all__ = ["FORMATS", "ExportError", "export_drafter", "export_run", "format_table", "formats_for", "load_exported",
           "resolve_format", "serve_commands"]
