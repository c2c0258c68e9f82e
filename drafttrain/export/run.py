"""Exporting a drafter: one drafter into one format (:func:`export_drafter`), a training run's drafter with its K and
serve lines (:func:`export_run`), and drafttrain's reader of an exported folder (:func:`load_exported`)."""

from __future__ import annotations

import json
from pathlib import Path

from drafttrain.export.commands import serve_alternatives, serve_commands
from drafttrain.export.common import ExportError
from drafttrain.export.formats import FORMATS, format_table, module, resolve_format


def export_drafter(drafter, fmt: str | None, out_dir: str | Path, **options) -> tuple[str, dict]:
    """Write ``drafter`` to ``out_dir`` in format ``fmt`` (None = the first the drafter declares).

    Options are the format's (e.g. ``verifier``, ``num_speculative_tokens``, ``target_config``). Also writes
    ``out_dir/export_info.json`` with the weight files' digests and the target's sizes
    (:func:`drafttrain.export.verify.export_record`), what :func:`load_exported` checks.

    Returns:
        (format written, the engine config written to ``out_dir/config.json``).

    Raises:
        ExportError: see :func:`~drafttrain.export.formats.resolve_format`, or the format cannot represent this
            drafter exactly.
    """
    fmt = resolve_format(drafter.name, fmt)  # a format the drafter declares
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


def vllm_profile_for(info: dict) -> tuple[dict, Path] | None:
    """The vLLM profile cached on this host for an export's weights and target (or None); a profile from
    before this host's facts changed, or for other weights, is not found (:func:`drafttrain.export.vllm_profile.lookup`)."""
    from drafttrain.export.vllm_profile import lookup

    return lookup(info)


def vllm_cpu_refusal(target) -> str | None:
    """Why the printed CPU line must not speculate on this target, or None: vLLM 0.32's CPU build loads EAGLE-3
    exports of targets with recurrent layers (Qwen3-Next: bf16 only, prefix caching off) and of MLA targets
    (DeepSeek-V3: bf16, a 512 + 64 latent only), but its speculative output was measured different from its own plain
    greedy at one request at a time on both (docs/benchmarks/serving.md), so the line serves the target alone; the
    exported folder is written all the same (a GPU build may serve it)."""
    from drafttrain.target import families

    cls = type(target.model).__name__
    if getattr(target, "recurrent", False):
        return (f"vLLM 0.32 CPU's speculative decoding is not lossless on {cls}'s recurrent layers (its output "
                "differs from its plain greedy at one request at a time)")  # fmt: skip
    if families.mla_attention(target.config):
        return (f"vLLM 0.32 CPU's speculative decoding is not lossless on {cls}'s MLA attention (its output differs "
                "from its plain greedy at one request at a time)")  # fmt: skip
    return None


def export_run(checkpoint: str | Path, fmt: str | None = None, output_dir: str | Path | None = None,
               target_path: str | None = None, verifier: str | None = None,
               num_speculative_tokens: int | None = None, overwrite: bool = False, target=None,
               gpu_cost_ratio: float | None = None, draft_cost_ratio: float | None = None,
               vllm_profile: bool = True, serve_loads=(1, 8)) -> Path:
    """Export a training run's (or a drafter folder's) drafter; writes the engine folder + ``export_info.json``.

    ``scripts.export`` and the end of ``train.run`` both call this. ``target``: an already loaded
    :class:`~drafttrain.target.Target` of the run (skips loading it again); ``target_path`` replaces the
    run's own target folder; ``verifier`` (null = the target's folder) is the name the engine serves.
    ``num_speculative_tokens`` (null: chosen) fixes K; otherwise K and its batch-size schedule are chosen
    from the run's held-out acceptance and the target's cost measured on this host, or stated for a GPU by
    ``gpu_cost_ratio`` (:func:`drafttrain.export.speculation.for_export`; ``draft_cost_ratio`` states the
    drafter's); ``export_info.json``'s ``speculation`` block records the choice and its figures. With
    ``vllm_profile`` (the default) and a vLLM profile measured on this host for these exact weights and target
    (``scripts.serve_check profile_k=[...]``, :mod:`drafttrain.export.vllm_profile`), K comes from vLLM's
    measured speedups instead: the K that holds at every load in ``serve_loads`` (requests in flight), or
    the target alone; the model's choice is kept under ``speculation.model``. Without a profile, the cost
    model's K is held to the same loads (:func:`drafttrain.export.speculation.hold_at_loads`): where its
    schedule drops K to 0 at one of them, the line serves the target alone and ``alternatives`` carries K
    for fewer requests at a time.

    Returns:
        The folder written (``output_dir``; null = ``outputs/export/<run name>-<format>``).

    Raises:
        ConfigError: a checkpoint without a drafter; a random tiny target with no ``target_path``; a
            non-empty ``output_dir`` without ``overwrite``.
        ExportError: the recipe has no such format, or the format cannot hold the drafter exactly.
        drafttrain.atomic.DiskFullError: the disk filled up while writing (the previous export in
            ``output_dir`` is kept whole, the partial one removed).
    """
    from drafttrain.config import ConfigError, TargetConfig
    from drafttrain.compose import build_run
    from drafttrain.drafters.base import DRAFTER_CONFIG
    from drafttrain.export.common import drafter_dir, run_config, write_json
    from drafttrain.target import resolve_target_dir

    loads = [int(n) for n in serve_loads]
    if not loads or min(loads) < 1:
        raise ConfigError(f"serve_loads must list requests in flight >= 1, got {list(serve_loads)}")
    try:
        ddir = drafter_dir(checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"checkpoint={checkpoint}: {err}") from None
    name = json.loads((ddir / DRAFTER_CONFIG).read_text())["name"]
    fmt = resolve_format(name, fmt)  # before any model loads: the formats the drafter declares
    form = FORMATS[fmt]
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
    built = build_run(tcfg, target=target, drafter=ddir, pack=False)  # the saved weights as they are (no packing)
    target, drafter = built.target, built.drafter
    verifier = verifier or target_dir
    from drafttrain.export import speculation as spx

    fixed, why = num_speculative_tokens, "given: num_speculative_tokens" if num_speculative_tokens else None
    if form.k_is_depth and not fixed:  # the engine drafts the whole block each pass: K = the draft depth only
        fixed, why = drafter.draft_depth, f"{form.engine} drafts the drafter's whole depth per pass ({fmt})"
    drafting = form.drafting or drafter.spec.drafting  # an engine that drafts its own way (SGLang: step by step)
    import torch

    from drafttrain.export.vllm_profile import host_key
    from drafttrain.fingerprint import folder_fingerprint
    from drafttrain.target import fastlinear

    cost_key = {"host": host_key(), "target": folder_fingerprint(target_dir), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "linears": fastlinear.describe(target.model)}  # fmt: skip
    try:
        spec_block = spx.for_export(drafter, target, ddir, drafting, fixed_k=fixed, fixed_reason=why,
                                    gpu_cost_ratio=gpu_cost_ratio, draft_cost_ratio=draft_cost_ratio,
                                    cost_key=cost_key)  # fmt: skip
    except spx.SpeculationError as err:
        raise ConfigError(f"speculation: {err}") from None
    n_spec = int(spec_block["num_speculative_tokens"])
    from drafttrain.atomic import atomic_dir
    from drafttrain.export.verify import INFO, export_record

    # written whole into .tmp_<name>, fsynced, then renamed over a previous export (a folder holding other
    # files than an export gets the new files moved in one by one); a full disk leaves the previous export
    previous_export = (out / INFO).is_file() or not (out.exists() and any(out.iterdir()))
    hint = f"older exports beside {out}, older checkpoints under a run's output_dir/checkpoints, caches on that disk"
    with atomic_dir(out, f"the {fmt} export", hint, merge=not previous_export) as tmp:
        _, engine_cfg = export_drafter(drafter, fmt, tmp, verifier=verifier, num_speculative_tokens=n_spec,
                                       target_config=target.config)  # fmt: skip
        info = {"format": fmt, "recipe": name, "checkpoint": str(Path(checkpoint).resolve()), "target_path": target_dir,
                "verifier": verifier, "num_speculative_tokens": n_spec, "commands": None, "speculation": None}  # fmt: skip
        info.update(export_record(tmp, fmt, drafter, target.config, target_dir))  # digests + target facts: verify_export
        found = vllm_profile_for(info) if vllm_profile and not fixed else None
        if found:  # K measured in vLLM on this host for these weights: it replaces the cost model's choice
            from drafttrain.export import vllm_profile as vpx

            try:
                spec_block = vpx.apply(spec_block, found[0], found[1], loads)
            except vpx.ProfileError as err:
                raise ConfigError(f"vLLM profile {found[1]}: {err}") from None
            if int(spec_block["num_speculative_tokens"]) != n_spec:  # the engine config names K: write it again
                n_spec = int(spec_block["num_speculative_tokens"])
                _, engine_cfg = export_drafter(drafter, fmt, tmp, verifier=verifier, num_speculative_tokens=n_spec,
                                               target_config=target.config)  # fmt: skip
                info.update(export_record(tmp, fmt, drafter, target.config, target_dir))
        elif not num_speculative_tokens and form.vllm_method:  # the model's K, held to every load vLLM's line serves
            spec_block = spx.hold_at_loads(spec_block, loads)
        if form.vllm_method and (why_not := vllm_cpu_refusal(target)):  # measured not lossless in vLLM 0.32 CPU
            spec_block = {**spec_block, "pays": False, "vllm_cpu_refused": why_not,
                          "line_note": f"  # {why_not}: serve without speculation on vLLM's CPU build"}  # fmt: skip
        info.update({"num_speculative_tokens": n_spec, "speculation": spec_block,
                     "commands": serve_commands(fmt, out, verifier, n_spec, engine_cfg, spec_block, target_dir)})  # fmt: skip
        if alts := serve_alternatives(fmt, out, engine_cfg, spec_block, target_dir):
            info["alternatives"] = alts
        write_json(tmp / INFO, info)
    return out


__all__ = ["export_drafter", "export_run", "load_exported", "vllm_cpu_refusal", "vllm_profile_for"]
