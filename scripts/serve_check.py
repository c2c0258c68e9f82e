"""Round trip in a real engine: vLLM runs the target with and without an exported drafter, beside drafttrain's engine.

    bash scripts/install_vllm.sh                                     # once: vLLM's CPU build in .venv-vllm
    python -m scripts.export checkpoint=outputs/eagle3-smollm2-135m-instruct output_dir=outputs/export/eagle3
    python -m scripts.serve_check export_dir=outputs/export/eagle3 num_prompts=16 max_new_tokens=128

On the same prompts (chat template applied, greedy, the tokenizer's end-of-turn ids as stops) it runs:
vLLM plain and vLLM speculative (one ``vllm_runner`` process, ``.venv-vllm/bin/python``), then
drafttrain's :class:`~drafttrain.verify.engine.SpecEngine` plain and speculative with the drafter read
back from the exported folder (what vLLM loaded) drafting a chain of the same ``num_speculative_tokens``,
both at batch 1. It checks vLLM speculative == vLLM plain token for token on every prompt and writes
``results.json`` + ``report.md`` to ``output_dir``: vLLM's mean acceptance length (1 + accepted / drafts)
and per-position acceptance beside our tau and per-position rates, tokens/s of both engines, and how
many prompts the two engines' plain outputs agree on. Exit status 1 if vLLM's speculative output differs.

Keys: :class:`ServeCheckConfig` below (``--help``).
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from drafttrain.generation.vllm_client import RUNNER, vllm_env, vllm_python  # noqa: F401  (vllm_python: re-exported)

log = logging.getLogger("drafttrain.serve_check")


@dataclass
class ServeCheckConfig:
    """Run vLLM on the target with and without an exported drafter, beside drafttrain's own engine.

    ``export_dir``: a folder written by ``scripts.export`` (its ``export_info.json`` names the format and
    target); or ``checkpoint`` (+ ``format``): exported first into ``output_dir/export``. Either is checked
    first (:func:`drafttrain.export.verify.verify_export`): a modified, truncated or mismatched folder is
    refused in one line before vLLM or any model starts.
    """

    export_dir: str | None = None
    checkpoint: str | None = None
    format: str | None = None
    target_path: str | None = None
    prompts: str = "mt_bench"
    num_prompts: int = 16
    prompt_offset: int = 0
    prompt_stride: int = 5  # every 5th MT-bench question: 2 of each of its 8 categories (the main job's eval set)
    max_new_tokens: int = 128
    num_speculative_tokens: int | None = None  # null = the printed serve line's (the export's chosen K and its schedule)
    concurrency: list = field(default_factory=lambda: [1])  # requests in flight per timed vLLM pass: [1, 8] = one at a time, then 8
    vllm_python: str | None = None  # null = .venv-vllm/bin/python (scripts/install_vllm.sh), else $DRAFTTRAIN_VLLM_PYTHON
    vllm_threads: str = "0-1"  # VLLM_CPU_OMP_THREADS_BIND
    vllm_memory_gb: int = 4  # VLLM_CPU_KVCACHE_SPACE (GiB, an integer)
    max_model_len: int = 1024
    vllm_eager: bool = False  # no torch.compile in vLLM: minutes less start-up on 2 cores, slower decoding
    ours: bool = True  # also run drafttrain's SpecEngine (tau, tokens/s) on the same prompts
    num_threads: int | None = None  # torch threads for our engine (null = torch's default)
    output_dir: str = "outputs/serve_check"
    timeout_s: int = 3600
    extra: dict = field(default_factory=dict)  # extra keys for vLLM's speculative_config
    # profile: vLLM plain and with each K here (one K at every batch size), at each `concurrency`; cached per host,
    # target and drafter weights (drafttrain.export.vllm_profile), then the export is written again with the K
    # the profile chooses for those loads (reexport=false: keep the folder as it is)
    profile_k: list | None = None
    reexport: bool = True


def speculative_config(export_dir: Path, info: dict, n_spec: int, extra: dict | None = None,
                       speculation: dict | None = None) -> dict:  # fmt: skip
    """vLLM's ``speculative_config`` for an exported folder (format from its export_info.json): the one the
    printed serve line carries (:func:`drafttrain.export.vllm_speculative_config`; with ``speculation``, the
    export's block, its batch-size schedule of K where the method takes one), plus ``extra``.

    Raises:
        ValueError: a format vLLM does not load, or a DFlash K other than its block's mask slots.
    """
    from drafttrain.export import FORMATS, VLLM_METHOD, vllm_speculative_config

    fmt = info["format"]
    if fmt not in VLLM_METHOD:
        raise ValueError(f"vLLM does not load the '{fmt}' format; export with format=speculators (EAGLE-3) instead")
    cfg = json.loads((export_dir / "config.json").read_text())
    if FORMATS[fmt].k_is_depth and "block_size" in cfg:  # one pass drafts the block's B - 1 mask slots (DFlash)
        block = int(cfg["block_size"])
        if int(n_spec) != block - 1:
            raise ValueError(f"a DFlash drafter with block_size {block} drafts {block - 1} tokens per pass; "
                             f"num_speculative_tokens={n_spec} would run another block in vLLM")  # fmt: skip
    spec = vllm_speculative_config(fmt, export_dir, int(n_spec), cfg, speculation)
    return {**spec, **(extra or {})}


def run_vllm(python: Path, job: dict, *, threads: str, memory_gb: int, timeout_s: int, log_path: Path) -> list[dict]:
    """Run ``vllm_runner`` on ``job`` under the vLLM venv (CPU settings: docs/design.md, "Platform notes"); its results.

    Raises:
        RuntimeError: the runner exited non-zero (the tail of its log in the message).
    """
    env = vllm_env(threads, memory_gb)
    with tempfile.TemporaryDirectory() as tmp:
        jp, op = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jp.write_text(json.dumps(job))
        with open(log_path, "w") as logf:
            proc = subprocess.run([str(python), str(RUNNER), str(jp), str(op)], env=env, stdout=logf,
                                  stderr=subprocess.STDOUT, timeout=timeout_s, cwd=tmp)  # fmt: skip
        if proc.returncode != 0 or not op.is_file():
            tail = "".join(open(log_path).readlines()[-30:])
            raise RuntimeError(f"vLLM runner failed (exit {proc.returncode}); log {log_path}:\n{tail}")
        return json.loads(op.read_text())


def ours_per_position(hist: dict, steps: int, n: int) -> list[float]:
    """Per-position acceptance from our engine's histogram of accepted drafts per step: position i is
    accepted in a step iff at least i + 1 drafts were (vLLM's ``num_accepted_tokens_per_pos`` / drafts)."""
    return [sum(c for m, c in hist.items() if int(m) > i) / max(steps, 1) for i in range(n)]


def run(c) -> dict:
    """The whole check per ``c`` (:class:`ServeCheckConfig`); returns results.json's dict."""
    import torch

    from drafttrain.config import ConfigError, TargetConfig
    from drafttrain.data.template import end_of_turn_ids, prompt_ids
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.export import load_exported
    from drafttrain.compose import build_run

    if c.num_prompts < 1 or c.max_new_tokens < 1 or c.prompt_stride < 1 or c.prompt_offset < 0:
        raise ConfigError("num_prompts, max_new_tokens and prompt_stride must be >= 1, prompt_offset >= 0")
    if c.num_speculative_tokens is not None and c.num_speculative_tokens < 1:
        raise ConfigError("num_speculative_tokens must be >= 1 (or null: the exported default)")
    if not c.concurrency or any(not isinstance(n, int) or n < 1 for n in c.concurrency):
        raise ConfigError(f"concurrency must be a non-empty list of integers >= 1, got {list(c.concurrency or [])}")
    py = vllm_python(c.vllm_python)
    if py is None:
        raise ConfigError("no vLLM venv: run `bash scripts/install_vllm.sh` (creates .venv-vllm) or set vllm_python=")
    out = Path(c.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if c.export_dir:
        export_dir = Path(c.export_dir)
    elif c.checkpoint:
        from scripts.export import ExportConfig, run as export_run

        export_dir = export_run(ExportConfig(checkpoint=c.checkpoint, format=c.format, target_path=c.target_path,
                                             output_dir=str(out / "export"), overwrite=True,
                                             num_speculative_tokens=c.num_speculative_tokens))  # fmt: skip
    else:
        raise ConfigError("set export_dir= (a folder from scripts.export) or checkpoint=")
    from drafttrain.export.verify import read_export_info, verify_export

    # the folder checked before vLLM or any model starts: its files against their recorded digests, config.json
    # against the weights' shapes, and the target it is served with (sizes, fingerprint)
    info = verify_export(export_dir, c.target_path or read_export_info(export_dir).get("target_path"))
    n_spec = int(c.num_speculative_tokens or info["num_speculative_tokens"])
    target_path = c.target_path or info["target_path"]
    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    target = build_run(TargetConfig(path=target_path)).target
    rows = load_eval_prompts(c.prompts, limit=c.num_prompts, offset=c.prompt_offset, stride=c.prompt_stride)
    prompts = [prompt_ids(target.tokenizer, r["messages"]) for r in rows]
    stops = sorted(end_of_turn_ids(target.tokenizer))
    log.info("%d prompts of %s, %d new tokens, %s drafter (%s), %d speculative tokens", len(prompts), c.prompts,
             c.max_new_tokens, info["recipe"], info["format"], n_spec)  # fmt: skip

    if c.profile_k is not None:
        return run_profile(c, py, export_dir, info, target_path, prompts, stops, out)

    # -- vLLM: plain, then the printed line's speculation, in one runner process ---------------------
    # num_speculative_tokens unset: the serve line the export printed (its K, its schedule); where no K pays,
    # that line serves the target alone, so its figures are the plain run's (not run twice)
    speculation = info.get("speculation") if c.num_speculative_tokens is None else None
    serves_plain = bool(speculation) and speculation.get("pays") is False
    spec = speculative_config(export_dir, info, n_spec, dict(c.extra), speculation)
    concurrency = [int(n) for n in c.concurrency]
    job = {"model": str(Path(target_path).resolve()), "prompts": prompts, "max_new_tokens": c.max_new_tokens,
           "stop_token_ids": stops, "max_model_len": c.max_model_len, "eager": c.vllm_eager, "concurrency": concurrency,
           "runs": [{"speculative_config": None}] + ([] if serves_plain else [{"speculative_config": spec}])}  # fmt: skip
    t0 = time.perf_counter()
    runs = run_vllm(py, job, threads=c.vllm_threads, memory_gb=c.vllm_memory_gb, timeout_s=c.timeout_s,
                    log_path=out / "vllm.log")  # fmt: skip
    log.info("vLLM runs took %.0f s (engine start-ups included)", time.perf_counter() - t0)
    for name, r in zip(("plain", "speculative"), runs):
        if "error" in r:
            raise RuntimeError(f"vLLM {name} run failed: {r['error']}\n{r.get('traceback', '')}")
    v_plain, v_spec = runs[0], runs[-1]
    by_conc = []
    for p, s in zip(v_plain["by_concurrency"], v_spec["by_concurrency"]):
        eq = [a == b for a, b in zip(s["outputs"], p["outputs"])]
        by_conc.append({"concurrency": p["concurrency"], "plain_tokens_per_s": p["generated"] / p["seconds"],
                        "spec_tokens_per_s": s["generated"] / s["seconds"],
                        "speedup": (s["generated"] / s["seconds"]) / (p["generated"] / p["seconds"]),
                        "acceptance": None if serves_plain else s["acceptance"], "spec_equals_plain": all(eq),
                        "spec_equal_per_prompt": eq})  # fmt: skip
    equal = [all(x) for x in zip(*(b["spec_equal_per_prompt"] for b in by_conc))]
    results = {
        "recipe": info["recipe"], "format": info["format"], "export_dir": str(export_dir), "target": target_path,
        "prompts": c.prompts, "num_prompts": len(prompts), "max_new_tokens": c.max_new_tokens,
        "num_speculative_tokens": n_spec, "speculative_config": spec, "vllm_version": v_plain.get("vllm_version"),
        "vllm": {"plain_tokens_per_s": v_plain["generated"] / v_plain["seconds"],
                 "spec_tokens_per_s": v_spec["generated"] / v_spec["seconds"],
                 "plain_generated": v_plain["generated"], "spec_generated": v_spec["generated"],
                 "acceptance": v_spec["acceptance"], "metrics": v_spec["metrics"]},
        "vllm_spec_equals_plain": all(equal), "vllm_spec_equal_per_prompt": equal,
        "printed_line": c.num_speculative_tokens is None, "printed_line_serves_plain": serves_plain,
        "expected_speedup": (speculation or {}).get("expected_speedup"), "by_concurrency": by_conc,
    }  # fmt: skip

    # -- ours: the drafter vLLM loaded, read back, through SpecEngine ------------------------------
    if c.ours:
        from drafttrain.compose import Run
        from drafttrain.verify.proposers import PlainProposer, proposer_for

        drafter = load_exported(export_dir, info["format"], target).eval()
        proposer = proposer_for(drafter, widths=[1] * n_spec)

        def engine(prop):
            return Run(target).engine(prop, batch_size=1, max_new_tokens=c.max_new_tokens, stop_token_ids=stops)

        engine(proposer).run(prompts[:1])  # warm-up (allocations, first calls)
        o_plain = engine(PlainProposer()).run(prompts)
        o_spec = engine(proposer).run(prompts)
        ours_plain = [list(r.tokens) for r in o_plain.results]
        ours_spec = [list(r.tokens) for r in o_spec.results]
        st = o_spec.stats
        results["ours"] = {
            "plain_tokens_per_s": o_plain.stats.tokens_per_s, "spec_tokens_per_s": st.tokens_per_s, "tau": st.tau,
            "per_position": ours_per_position(st.accept_hist, st.seq_steps, n_spec),
            "spec_equals_plain": ours_spec == ours_plain,
        }  # fmt: skip
        results["plain_outputs_agree"] = sum(a == b for a, b in zip(ours_plain, v_plain["outputs"]))
        v_tau = (v_spec["acceptance"] or {}).get("mean_acceptance_length")
        results["tau_ratio_vllm_over_ours"] = v_tau / st.tau if v_tau and st.tau else None
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    return results


def run_profile(c, py: Path, export_dir: Path, info: dict, target_path: str, prompts: list, stops: list,
                out: Path) -> dict:  # fmt: skip
    """``profile_k``: vLLM plain and with each K (no schedule) on the same prompts at each ``concurrency``, in one
    runner process; the profile is cached for this host, target and drafter weights and written to
    ``output_dir/vllm_profile.json``; with ``reexport`` the export is written again so that its printed line
    takes the K the profile chooses (:func:`drafttrain.export.vllm_profile.choose`, loads = ``concurrency``).

    Raises:
        ConfigError: an empty ``profile_k`` or a K < 1; ValueError: a K the format cannot draft (DFlash: its block's).
    """
    from drafttrain.config import ConfigError
    from drafttrain.export import vllm_profile as vpx
    from drafttrain.host import describe

    ks = sorted({int(k) for k in c.profile_k})
    if not ks or ks[0] < 1:
        raise ConfigError(f"profile_k must list the K to measure, each >= 1, got {list(c.profile_k)}")
    specs = [speculative_config(export_dir, info, k, dict(c.extra)) for k in ks]  # fails here on a K it cannot run
    concurrency = [int(n) for n in c.concurrency]
    job = {"model": str(Path(target_path).resolve()), "prompts": prompts, "max_new_tokens": c.max_new_tokens,
           "stop_token_ids": stops, "max_model_len": c.max_model_len, "eager": c.vllm_eager, "concurrency": concurrency,
           "runs": [{"speculative_config": None}] + [{"speculative_config": sp} for sp in specs]
                   + [{"speculative_config": None}]}  # plain again last: its drift between the two is the noise margin  # fmt: skip
    t0 = time.perf_counter()
    runs = run_vllm(py, job, threads=c.vllm_threads, memory_gb=c.vllm_memory_gb, timeout_s=c.timeout_s,
                    log_path=out / "vllm.log")  # fmt: skip
    log.info("vLLM profile took %.0f s (%d engines)", time.perf_counter() - t0, len(runs))
    for name, r in zip(["plain"] + [f"K={k}" for k in ks] + ["plain (again)"], runs):
        if "error" in r:
            raise RuntimeError(f"vLLM {name} run failed: {r['error']}\n{r.get('traceback', '')}")
    plain = {p["concurrency"]: p for p in runs[0]["by_concurrency"]}
    again = {p["concurrency"]: p for p in runs[-1]["by_concurrency"]}
    before = {n: plain[n]["generated"] / plain[n]["seconds"] for n in concurrency}
    after = {n: again[n]["generated"] / again[n]["seconds"] for n in concurrency}
    base = {n: (before[n] + after[n]) / 2 for n in concurrency}  # plain's rate: the mean of before and after
    drift = {str(n): round(abs(before[n] - after[n]) / base[n], 4) for n in concurrency}
    rows = []
    for k, r in zip(ks, runs[1:-1]):
        by = {b["concurrency"]: b for b in r["by_concurrency"]}
        rate = {n: by[n]["generated"] / by[n]["seconds"] for n in concurrency}
        rows.append({"k": k, "speedup": {str(n): round(rate[n] / base[n], 4) for n in concurrency},
                     "tokens_per_s": {str(n): round(rate[n], 2) for n in concurrency},
                     "acceptance_length": {str(n): (by[n]["acceptance"] or {}).get("mean_acceptance_length")
                                           for n in concurrency},
                     "per_position": (by[concurrency[0]]["acceptance"] or {}).get("per_position"),
                     "equal": all(a == b for n in concurrency for a, b in zip(by[n]["outputs"], plain[n]["outputs"]))})  # fmt: skip
    profile = {"rows": rows, "plain_tokens_per_s": {str(n): round(base[n], 2) for n in concurrency},
               "plain_before_after": {str(n): [round(before[n], 2), round(after[n], 2)] for n in concurrency},
               "plain_drift": drift,
               "vllm_version": runs[0].get("vllm_version"), "host": describe(), "eager": c.vllm_eager,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "prompts": c.prompts,
               "num_prompts": len(prompts), "max_new_tokens": c.max_new_tokens, "concurrency": concurrency,
               "export_dir": str(Path(export_dir).resolve()), "format": info["format"], "recipe": info["recipe"]}  # fmt: skip
    cached = vpx.save(profile, info)
    choice = vpx.choose(profile, concurrency)
    result = {**profile, "cache": str(cached), "choice": choice}
    if c.reexport and info.get("checkpoint") and Path(info["checkpoint"]).exists():
        from drafttrain.export import export_run

        export_run(info["checkpoint"], info["format"], export_dir, target_path=c.target_path or info.get("target_path"),
                   verifier=info.get("verifier"),
                   overwrite=True, serve_loads=concurrency)  # fmt: skip
        new = json.loads((Path(export_dir) / "export_info.json").read_text())
        result["printed_line"] = new["commands"][-1]
        result["reexported"] = str(export_dir)
    (out / "vllm_profile.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(profile_report(result))
    if not all(r["equal"] for r in rows):
        bad = [r["k"] for r in rows if not r["equal"]]
        raise SystemExit(f"vLLM's speculative output differed from plain at K={bad} ({out / 'vllm_profile.json'})")
    return result


def profile_report(r: dict) -> str:
    """A markdown summary of a profile (:func:`run_profile`'s dict)."""
    conc = r["concurrency"]
    lines = [f"# vLLM profile: {r['recipe']} ({r['format']}), vLLM {r['vllm_version']}", "",
             f"{r['num_prompts']} prompts of {r['prompts']}, {r['max_new_tokens']} new tokens, greedy, "
             f"eager={r['eager']}; host: {r['host'].get('cpu_model')} ({r['host'].get('isa')}). Cached: `{r['cache']}`.", "",
             "| K | " + " | ".join(f"{n} in flight: tok/s (plain {r['plain_tokens_per_s'][str(n)]}) | speedup | "
                                   f"acceptance length" for n in conc) + " | equal to plain |",
             "|---|" + "---|---|---|" * len(conc) + "---|"]  # fmt: skip
    for row in r["rows"]:
        cells = []
        for n in conc:
            al = row["acceptance_length"].get(str(n))
            cells += [f"{row['tokens_per_s'][str(n)]:.1f}", f"{row['speedup'][str(n)]:.2f}x", "n/a" if al is None else f"{al:.3f}"]
        lines.append(f"| {row['k']} | " + " | ".join(cells) + f" | {row['equal']} |")
    ch = r["choice"]
    if r.get("plain_before_after"):
        lines += ["", "Plain decoding timed before and after the speculative engines (tok/s; their relative difference "
                  "is the noise margin a K must clear): " + ", ".join(
                      f"{n} in flight {a} / {b} ({100 * r['plain_drift'][str(n)]:.1f}%)"
                      for n, (a, b) in ((n, r['plain_before_after'][str(n)]) for n in conc))]  # fmt: skip
    lines += ["", f"Chosen for {conc} requests in flight: **K = {ch['k'] or 'none (serve the target alone)'}**, "
              f"worst measured speedup {ch['worst_speedup']:.2f}x; each load alone: "
              + ", ".join(f"{n}: K={k} ({x:.2f}x)" for n, (k, x) in ch["best_alone"].items())]  # fmt: skip
    if r.get("printed_line"):
        lines += ["", "The export's printed line now:", "", "```", r["printed_line"], "```"]
    return "\n".join(lines) + "\n"


def report(r: dict) -> str:
    """A markdown summary of ``results.json``."""
    v, o = r["vllm"], r.get("ours")
    acc = v["acceptance"] or {}
    lines = [f"# serve_check: {r['recipe']} ({r['format']}), vLLM {r['vllm_version']}", "",
             f"{r['num_prompts']} prompts of {r['prompts']}, {r['max_new_tokens']} new tokens, greedy, "
             f"{r['num_speculative_tokens']} speculative tokens.", "",
             f"- vLLM speculative == vLLM plain on every prompt: **{r['vllm_spec_equals_plain']}** "
             f"({sum(r['vllm_spec_equal_per_prompt'])}/{r['num_prompts']})"]  # fmt: skip
    if o:
        lines += [f"- drafttrain speculative == drafttrain plain: {o['spec_equals_plain']}; plain outputs of the two "
                  f"engines agree on {r['plain_outputs_agree']}/{r['num_prompts']} prompts", ""]  # fmt: skip
    which = ("the printed serve line" + (" (no K pays: it serves the target alone)" if r.get("printed_line_serves_plain")
             else "") if r.get("printed_line") else f"num_speculative_tokens={r['num_speculative_tokens']}")  # fmt: skip
    lines += ["", f"vLLM plain vs vLLM with {which}, by requests in flight:", "",
              "| concurrent requests | plain tok/s | speculative tok/s | speedup | mean acceptance length | equal to plain |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for b in r.get("by_concurrency", []):
        tau = (b["acceptance"] or {}).get("mean_acceptance_length")
        lines.append(f"| {b['concurrency']} | {b['plain_tokens_per_s']:.1f} | {b['spec_tokens_per_s']:.1f} | "
                     f"{b['speedup']:.2f}x | {'n/a' if tau is None else f'{tau:.3f}'} | "
                     f"{sum(b['spec_equal_per_prompt'])}/{len(b['spec_equal_per_prompt'])} |")  # fmt: skip
    first = (r.get("by_concurrency") or [{"concurrency": 1}])[0]["concurrency"]
    lines += ["", f"At {first} request(s) in flight (vLLM), drafttrain's engine at batch 1:", ""]
    lines += ["| engine | mean acceptance length (tau) | per-position acceptance | plain tok/s | speculative tok/s |",
              "|---|---|---|---|---|"]  # fmt: skip
    pp = ", ".join(f"{x:.3f}" for x in acc.get("per_position", []))
    lines.append(f"| vLLM | {acc.get('mean_acceptance_length', float('nan')):.3f} | {pp} | "
                 f"{v['plain_tokens_per_s']:.1f} | {v['spec_tokens_per_s']:.1f} |")  # fmt: skip
    if o:
        pp = ", ".join(f"{x:.3f}" for x in o["per_position"])
        lines.append(f"| drafttrain | {o['tau']:.3f} | {pp} | {o['plain_tokens_per_s']:.1f} | {o['spec_tokens_per_s']:.1f} |")
        if r.get("tau_ratio_vllm_over_ours"):
            lines += ["", f"vLLM / drafttrain acceptance length: {r['tau_ratio_vllm_over_ours']:.3f}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    r = run(parse_cli(ServeCheckConfig, argv))
    if "choice" in r:  # profile_k
        print(profile_report(r), flush=True)
        return
    print(report(r), flush=True)
    if not r["vllm_spec_equals_plain"]:
        raise SystemExit(1)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
