"""The real targets side by side: one EAGLE-3 drafter per target, trained and measured the same way.

Per target (one run folder each under ``out_root/<target>/eagle3``), the commands the page shows::

    T=qwen2.5-coder-0.5b; R=outputs/bench_targets/$T
    bash scripts/bootstrap.sh qwen2.5-coder-0.5b                                     # its packages (once)
    python -m scripts.bench_recipes phase=train recipe=eagle3 out_root=$R budget_minutes=30 \\
        'overrides=["target=qwen2.5-coder-0.5b","data.max_conversations=500"]'     # self-distil + train
    python -m scripts.bench_recipes phase=eval recipe=eagle3 out_root=$R eval_suite=full   # MT-bench + GSM8K
    python -m scripts.export checkpoint=$R/eagle3 output_dir=$R/export
    python -m scripts.serve_check export_dir=$R/export output_dir=$R/serve_check     # vLLM plain vs speculative
    python -m scripts.bench_targets                                                   # this page

``report`` (the only phase here) reads each run's ``final_metrics.json``, ``bench_command.json``,
``eval_full.json`` and ``serve_check/results.json`` (whatever exists) and writes
``docs/benchmarks/targets.json`` and ``.md``: steps, training and wall minutes, τ per prompt set (the
draft tree and the chain), batch-1 speedup in our engine, vLLM's acceptance length beside ours, vLLM's
equality with its plain decoding, and vLLM speculative over vLLM plain tokens/s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import kept_analysis, write_report


@dataclass
class BenchTargetsConfig:
    """Schema of ``python -m scripts.bench_targets`` (key=value overrides)."""

    out_root: str = "outputs/bench_targets"  # <out_root>/<target>/eagle3 (+ serve_check/)
    targets: list[str] = field(default_factory=lambda: ["smollm2-135m-instruct", "qwen2.5-coder-0.5b"])
    dest: str = "docs/benchmarks/targets"


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def summarize(root: Path, target: str) -> dict | None:
    """One row of the page from ``root/<target>`` (None where the run has not finished training)."""
    run = root / target / "eagle3"
    final = _read(run / "final_metrics.json")
    if final is None:
        return None
    launch = _read(run / "bench_command.json") or {}
    cfg = _read(run / "config.json") or {}
    full = _read(run / "eval_full.json") or {}
    serve = _read(root / target / "serve_check" / "results.json") or {}
    host = ((_read(run / "launch.json") or {}).get("host")) or {}
    row = {
        "target": target,
        "target_name": (cfg.get("target") or {}).get("name"),
        "steps": final.get("step"),
        "train_minutes": round(float(final.get("train_seconds", 0.0)) / 60, 1),
        "wall_minutes": round(sum(x.get("wall_seconds", 0) for x in launch.get("launches", [])) / 60, 1) or None,
        "train_rows": final.get("train_rows"),
        "heldout_tau_sim": final.get("eval/tau_sim"),
        "host": host,
    }
    for prompts in ("mt_bench", "gsm8k"):
        r = full.get(prompts) or {}
        row[f"{prompts}_tau_tree"] = r.get("eval/tau")
        row[f"{prompts}_tau_chain"] = r.get("eval/tau_chain")
        row[f"{prompts}_speedup_b1"] = r.get("eval/speedup_b1")
        row[f"{prompts}_greedy_equal"] = r.get("eval/greedy_equal")
    if serve:
        v, ours = serve["vllm"], serve.get("ours") or {}
        acc = (v.get("acceptance") or {}).get("mean_acceptance_length")
        row["vllm"] = {"acceptance_length": acc, "ours_tau": ours.get("tau"),
                       "tau_ratio": serve.get("tau_ratio_vllm_over_ours"),
                       "num_equal": sum(serve["vllm_spec_equal_per_prompt"]), "num_prompts": serve["num_prompts"],
                       "speedup_over_vllm_plain": v["spec_tokens_per_s"] / v["plain_tokens_per_s"],
                       "chain": serve.get("num_speculative_tokens")}  # fmt: skip
    else:
        row["vllm"] = None
    return row


def _fmt(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(rows: list[dict], analysis: str) -> str:
    head = ("# Real targets side by side: EAGLE-3 for SmolLM2-135M and Qwen2.5-Coder-0.5B\n\n"
            "One `eagle3` drafter per target, trained the same way (self-distilled ShareGPT first turns, a fixed\n"
            "budget of training minutes, the draft layer the serving engines build), evaluated on 16 MT-bench and\n"
            "16 GSM8K prompts (128 new tokens, greedy) through drafttrain's engine, then served by vLLM's CPU build.\n"
            "Commands: the module docstring of `scripts/bench_targets.py` (reproduce: `python -m scripts.bench_targets`).\n\n")  # fmt: skip
    cols = ["target", "host", "steps", "train min", "wall min", "MT-bench τ tree / chain", "GSM8K τ tree / chain",
            "b1 speedup MT / GSM", "greedy-equal", "vLLM acceptance / ours", "vLLM spec == plain",
            "vLLM spec / plain tok/s"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        h = r.get("host") or {}
        host = f"{h.get('cpu_model', h.get('cpu_capability', '?'))}, bf16 {h.get('native_bf16', '?')}"
        v = r.get("vllm") or {}
        lines.append("| " + " | ".join([
            r["target"], host, _fmt(r["steps"]), _fmt(r["train_minutes"], 1), _fmt(r["wall_minutes"], 1),
            f"{_fmt(r['mt_bench_tau_tree'])} / {_fmt(r['mt_bench_tau_chain'])}",
            f"{_fmt(r['gsm8k_tau_tree'])} / {_fmt(r['gsm8k_tau_chain'])}",
            f"{_fmt(r['mt_bench_speedup_b1'], 2)} / {_fmt(r['gsm8k_speedup_b1'], 2)}",
            _fmt(bool(r["mt_bench_greedy_equal"]) and bool(r["gsm8k_greedy_equal"])
                 if r["mt_bench_greedy_equal"] is not None else None),
            f"{_fmt(v.get('acceptance_length'))} / {_fmt(v.get('ours_tau'))}",
            f"{v.get('num_equal', '-')}/{v.get('num_prompts', '-')}" if v else "-",
            _fmt(v.get("speedup_over_vllm_plain"), 2),
        ]) + " |")  # fmt: skip
    return head + "\n".join(lines) + "\n\n" + analysis + "\n"


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    c = parse_cli(BenchTargetsConfig, argv)
    root = Path(c.out_root)
    rows = [r for t in c.targets if (r := summarize(root, t)) is not None]
    write_report(c.dest, {"rows": rows, "out_root": c.out_root}, lambda kept: markdown(rows, kept))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
