"""The command lines that serve an exported folder: vLLM's ``--speculative-config``, the OpenAI server line to
paste on this CPU host, ``python -m scripts.serve``, the lines for fewer requests at a time; what a format's
engine needs comes from its :class:`~drafttrain.export.formats.Format`, never from its name."""

from __future__ import annotations

import json
from pathlib import Path

from drafttrain.export.formats import FORMATS, VLLM_METHOD, module

# vLLM's CPU build on a small host (docs/serving.md): KV cache GiB, memory fraction, longest sequence
CPU_KV_CACHE_GB, CPU_MEMORY_UTILIZATION, CPU_MAX_MODEL_LEN = 4, 0.3, 1024


def vllm_speculative_config(fmt: str, out: Path, n_spec: int, engine_cfg: dict, speculation: dict | None = None) -> dict:
    """vLLM's ``--speculative-config`` for an exported folder: ``model`` (absolute), ``method``,
    ``num_speculative_tokens``, ``parallel_drafting`` (a ``peagle`` folder), and the batch-size schedule of K
    (``num_speculative_tokens_per_batch_size``) when ``speculation`` has one that changes K and the format takes it
    (:attr:`~drafttrain.export.formats.Format.dynamic_k`; parallel drafting with a schedule stopped vLLM 0.32's CPU
    engine at the first step a smaller K was scheduled, "RuntimeError: output with shape [1, 1] doesn't match the
    broadcast shape [3, 1]", where EAGLE-3 chains with the same schedule stayed lossless: parallel drafters get the
    batch-1 K alone)."""
    method = VLLM_METHOD[fmt]
    spec = {"model": str(Path(out).resolve()), "method": method, "num_speculative_tokens": int(n_spec)}
    parallel = engine_cfg.get("speculators_model_type") == "peagle" or engine_cfg.get("parallel_drafting")
    if parallel:
        spec["parallel_drafting"] = True
    sched = (speculation or {}).get("schedule")
    if sched and len(sched) > 1 and FORMATS[fmt].dynamic_k and not parallel:
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
        fmt: the format written (a key of :data:`~drafttrain.export.formats.FORMATS`); ``out``: the exported folder;
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
        Another engine's format: its module's ``serve_commands`` (SGLang: its ``launch_server`` line).
    """
    if FORMATS[fmt].vllm_method is None:  # another engine: its module writes its own line
        return module(fmt).serve_commands(out, verifier, n_spec)
    import shlex
    import sys

    from drafttrain.generation.vllm_client import REPO

    spec = vllm_speculative_config(fmt, out, n_spec, engine_cfg, speculation)
    cmds = [f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'"]
    if FORMATS[fmt].serves_folder:  # the folder names its verifier
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
    it. vLLM 0.32 cannot stop speculating there: parallel drafting (and every format without
    :attr:`~drafttrain.export.formats.Format.dynamic_k`) takes no batch-size schedule, so the line's K runs at every batch size; and
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
    if FORMATS[fmt].vllm_method is None or speculation.get("vllm_cpu_refused"):  # not vLLM's, or not lossless there
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
