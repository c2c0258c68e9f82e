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


VLLM_METHOD = {"speculators": "eagle3", "vllm_medusa": "medusa", "vllm_eagle": "eagle", "dflash": "dflash"}
# vLLM methods whose proposer drafts a K chosen per step, so they take num_speculative_tokens_per_batch_size.
# vLLM 0.32: Medusa's proposer asserts K == num_speculative_tokens; DFlash drafts its whole block; parallel
# drafting with a schedule stopped the CPU engine at the first step a K below the maximum was scheduled
# ("RuntimeError: output with shape [1, 1] doesn't match the broadcast shape [3, 1]"), where EAGLE-3 chains
# with the same schedule stayed lossless: parallel drafters get the batch-1 K alone.
DYNAMIC_K_METHODS = ("eagle", "eagle3")
# vLLM's CPU build on a small host (docs/serving.md): KV cache GiB, memory fraction, longest sequence
CPU_KV_CACHE_GB, CPU_MEMORY_UTILIZATION, CPU_MAX_MODEL_LEN = 4, 0.3, 1024


def vllm_speculative_config(fmt: str, out: Path, n_spec: int, engine_cfg: dict, speculation: dict | None = None) -> dict:
    """vLLM's ``--speculative-config`` for an exported folder: ``model`` (absolute), ``method``,
    ``num_speculative_tokens``, ``parallel_drafting`` (a ``peagle`` folder), and the batch-size schedule of K
    (``num_speculative_tokens_per_batch_size``) when ``speculation`` has one that changes K and the method
    takes it (:data:`DYNAMIC_K_METHODS`)."""
    method = VLLM_METHOD[fmt]
    spec = {"model": str(Path(out).resolve()), "method": method, "num_speculative_tokens": int(n_spec)}
    parallel = engine_cfg.get("speculators_model_type") == "peagle" or engine_cfg.get("parallel_drafting")
    if parallel:
        spec["parallel_drafting"] = True
    sched = (speculation or {}).get("schedule")
    if sched and len(sched) > 1 and method in DYNAMIC_K_METHODS and not parallel:
        spec["num_speculative_tokens_per_batch_size"] = sched
    return spec


def vllm_cpu_command(model: str, spec: dict | None, *, python: str | None = None, threads: str | None = None,
                     kv_cache_gb: int = CPU_KV_CACHE_GB, memory_utilization: float = CPU_MEMORY_UTILIZATION,
                     max_model_len: int = CPU_MAX_MODEL_LEN, eager: bool = True, host: str | None = None,
                     port: int | None = None) -> tuple[dict[str, str], list[str]]:  # fmt: skip
    """vLLM's OpenAI server on this CPU host: the environment variables to set and the argv.

    ``python -m vllm.entrypoints.openai.api_server`` under the vLLM venv (vllm-cpu's own ``vllm`` entry point
    fails looking up the package "vllm"), all paths absolute; ``VLLM_CPU_OMP_THREADS_BIND`` = ``threads``
    (null: this process's cores), no reserved core, ``kv_cache_gb`` GiB of KV cache; a memory fraction
    and a sequence length that fit a small host; eager (no torch.compile start-up).

    Args:
        model: the target's folder; spec: :func:`vllm_speculative_config` (None = plain serving);
        python: the vLLM venv's python (null: :func:`~drafttrain.generation.vllm_client.vllm_python`, else
        where ``bash scripts/install_vllm.sh`` puts it).

    Returns:
        (env, argv): ``env`` the VLLM_CPU_* variables only (add them to the caller's environment).
    """
    from drafttrain.cliconfig import ConfigError
    from drafttrain.generation.vllm_client import cpu_list, vllm_python, vllm_venv

    if python is None:
        try:
            python = str(vllm_python() or vllm_venv() / "bin" / "python")
        except ConfigError:  # a half-installed venv: the line still names where the install puts python
            python = str(vllm_venv() / "bin" / "python")
    py = python
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads or cpu_list(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb))}  # fmt: skip
    argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model).resolve()),
            "--gpu-memory-utilization", f"{memory_utilization:g}", "--max-model-len", str(int(max_model_len))]  # fmt: skip
    if eager:
        argv.append("--enforce-eager")
    if host:
        argv += ["--host", host]
    if port:
        argv += ["--port", str(int(port))]
    if spec:
        argv += ["--speculative-config", json.dumps(spec)]
    return env, argv


def shell_line(env: dict[str, str], argv: list[str]) -> str:
    """One pasteable shell line: ``K=V ... argv`` (quoted where needed)."""
    import shlex

    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])


def serve_commands(fmt: str, out: Path, verifier: str, n_spec: int, engine_cfg: dict, speculation: dict | None = None,
                   target_dir: str | None = None) -> list[str]:  # fmt: skip
    """The shell commands that serve an exported folder (printed, and written to ``export_info.json``).

    Args:
        fmt: the format written (a key of :data:`FORMATS`); ``out``: the exported folder;
        ``verifier``: the target name or folder the engine serves; ``n_spec``: tokens drafted per step;
        ``engine_cfg``: the engine config written (its ``speculators_model_type`` "peagle" or
        ``parallel_drafting`` turns on vLLM's parallel drafting); ``speculation``: the export's speculation
        block (:func:`drafttrain.export.speculation.for_export`: its schedule, and whether any K pays);
        ``target_dir``: the target's folder on this host (null = ``verifier``).

    Returns:
        vLLM: the GPU form ``vllm serve VERIFIER --speculative-config '{...}'`` (speculators and DFlash folders
        name their verifier, so ``vllm serve DIR`` comes first), ``python -m scripts.serve`` from the
        repository, and last the line to paste on this CPU host (:func:`vllm_cpu_command`, absolute paths);
        where no K pays, that last line serves the target alone and says so in a trailing comment.
        SGLang: its ``launch_server`` line.
    """
    if fmt == "sglang":
        return [f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {Path(out).resolve()} --speculative-num-steps {n_spec} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {n_spec + 1}"]  # fmt: skip
    import shlex
    import sys

    from drafttrain.generation.vllm_client import REPO

    spec = vllm_speculative_config(fmt, out, n_spec, engine_cfg, speculation)
    cmds = [f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'"]
    if fmt in ("speculators", "dflash"):
        cmds.insert(0, f"vllm serve {Path(out).resolve()}")
    pays = (speculation or {}).get("pays")
    measured = (speculation or {}).get("line_note")  # K chosen from vLLM's own measured speedups on this host
    serve = f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m scripts.serve checkpoint={shlex.quote(str(Path(out).resolve()))}"
    if pays is False:
        s = speculation["expected_speedup"]
        note = measured or (f"  # expected {s:.2f}x at best (K={speculation['num_speculative_tokens']}): serve "
                            "without speculation on this host")  # fmt: skip
        cmds += [serve + " speculative=false" + note, shell_line(*vllm_cpu_command(target_dir or verifier, None)) + note]
    else:
        note = measured or concurrency_note(spec, speculation)
        cmds += [serve + note, shell_line(*vllm_cpu_command(target_dir or verifier, spec)) + note]
    return cmds


def concurrency_note(spec: dict, speculation: dict | None) -> str:
    """A trailing shell comment for a serve line whose export's schedule drops K to 0 from some batch size on:
    up to how many requests at a time speculation is expected to pay, and that more should be served without
    it. vLLM 0.32 cannot stop speculating there: parallel drafting (and every method outside
    :data:`DYNAMIC_K_METHODS`) takes no batch-size schedule, so the line's K runs at every batch size; and
    where the schedule is taken, its K = 0 still runs the drafter's machinery each step (docs/serving.md
    measures both). '' where K never reaches 0, or only at batch 1 (the export then serves without speculation)."""
    sched = (speculation or {}).get("schedule") or []
    zero = next((int(lo) for lo, _hi, k in sched if int(k) == 0), None)
    if zero is None or zero <= 1:
        return ""
    why = ("takes no batch-size schedule for this method" if "num_speculative_tokens_per_batch_size" not in spec
           else "still runs the drafter at a scheduled K = 0")  # fmt: skip
    return (f"  # the export expects speculation to pay up to {zero - 1} requests at a time and to lose from {zero} on; "
            f"vLLM 0.32 {why}: serve without speculation where more run at once")


def serve_alternatives(fmt: str, out: Path, engine_cfg: dict, speculation: dict, target_dir: str) -> list[dict]:
    """Lines for fewer requests at a time than the printed line serves (vLLM formats). For a line chosen from a
    vLLM profile: each load whose best K on its own differs from the served one, as ``{"loads": [n],
    "num_speculative_tokens": K, "measured_speedup": x, "command": the CPU line serving K}`` (e.g. one request at a time, where the line for 1 and 8 requests serves the target alone). For a line the
    cost model held to every load (:func:`drafttrain.export.speculation.hold_at_loads`): its
    ``predicted_alternative``, ``{"loads": [1..n], "num_speculative_tokens": K, "expected_speedup": x, "command"}``."""
    if speculation.get("vllm_cpu_refused"):  # the CPU build is not lossless on this target: no speculating line
        return []
    pred = speculation.get("predicted_alternative")
    if pred:
        spec = vllm_speculative_config(fmt, out, int(pred["num_speculative_tokens"]), engine_cfg)
        n = max(pred["loads"])
        return [{**pred, "command": f"{shell_line(*vllm_cpu_command(target_dir, spec))}  # expected "
                 f"{pred['expected_speedup']:.2f}x with 1 request; up to {n} at a time, not more"}]  # fmt: skip
    choice = (speculation.get("vllm_profile") or {}).get("choice") or {}
    alts = []
    for n, (k, x) in (choice.get("best_alone") or {}).items():
        if k and k != choice.get("k"):
            spec = vllm_speculative_config(fmt, out, int(k), engine_cfg)
            line = shell_line(*vllm_cpu_command(target_dir, spec))
            alts.append({"loads": [int(n)], "num_speculative_tokens": int(k), "measured_speedup": x,
                         "command": f"{line}  # measured {x:.2f}x with {n} request(s) in flight; not for more at once"})  # fmt: skip
    return alts


def alternative_label(alt: dict) -> str:
    """How many requests at a time an ``alternatives`` entry is for, in words ("1 request", "up to 5 requests")."""
    loads = [int(n) for n in alt["loads"]]
    n = max(loads)
    return f"{'up to ' if len(loads) > 1 else ''}{n} request{'s' if n != 1 else ''}"


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
    built = build_run(tcfg, target=target, drafter=ddir, pack=False)  # the saved weights as they are (no packing)
    target, drafter = built.target, built.drafter
    verifier = verifier or target_dir
    from drafttrain.export import speculation as spx

    fixed, why = num_speculative_tokens, "given: num_speculative_tokens" if num_speculative_tokens else None
    if fmt == "dflash" and not fixed:  # vLLM runs DFlash's whole block: K = B - 1 is the only count
        fixed, why = drafter.draft_depth, "DFlash's block: vLLM drafts block_size - 1 tokens per pass"
    drafting = "autoregressive" if fmt == "sglang" else drafter.spec.drafting  # SGLang drafts step by step
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
        info = {"format": fmt, "recipe": recipe, "checkpoint": str(Path(checkpoint).resolve()), "target_path": target_dir,
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
        elif not num_speculative_tokens and fmt != "sglang":  # the model's K, held to every load vLLM's line serves
            spec_block = spx.hold_at_loads(spec_block, loads)
        if fmt != "sglang" and (why_not := vllm_cpu_refusal(target)):  # measured not lossless in vLLM 0.32 CPU
            spec_block = {**spec_block, "pays": False, "vllm_cpu_refused": why_not,
                          "line_note": f"  # {why_not}: serve without speculation on vLLM's CPU build"}  # fmt: skip
        info.update({"num_speculative_tokens": n_spec, "speculation": spec_block,
                     "commands": serve_commands(fmt, out, verifier, n_spec, engine_cfg, spec_block, target_dir)})  # fmt: skip
        if alts := serve_alternatives(fmt, out, engine_cfg, spec_block, target_dir):
            info["alternatives"] = alts
        write_json(tmp / INFO, info)
    return out


__all__ = ["FORMATS", "ExportError", "alternative_label", "export_drafter", "export_run", "format_table", "formats_for", "load_exported",
           "resolve_format", "serve_commands", "shell_line", "vllm_cpu_command", "vllm_profile_for",
           "vllm_speculative_config"]
