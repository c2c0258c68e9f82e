"""Hybrid draft trees on a trained run: the drafter's tree alone vs with SSSD's candidates, side by side.

    python -m scripts.bench_hybrid run=outputs/parallelspec-smollm2-135m-instruct

The run's own final evaluation (``drafttrain.eval.in_training.spec_eval``: its MT-bench prompts, tree, batch 16 with
the online planner, batch 1 on ``latency_prompts`` prompts spread over the list, ``drafttrain.eval.in_training.latency_subset``) once per ``trainer.spec_eval.sssd.source``
in ``sources``: ``none`` (the drafter's tree), ``input`` (+ SSSD n-gram candidates from the prompt and the
output so far, SSSD §3.1.1), ``data`` (+ a datastore over the run's training answers, i.e. the target's
self-distilled outputs, §3.1.2). Each evaluation times plain decoding beside it in the same engine, so
every speedup is a side-by-side ratio. Every output is checked token for token against plain greedy.
The training data is read from the run's self-distillation cache (the same ``DRAFTTRAIN_CACHE``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from drafttrain.config import SSSDEvalConfig

KEYS = ("eval/tau", "eval/tau_planned", "eval/speedup_b16", "eval/speedup_full_tree", "eval/speedup_b1", "eval/tau_b1",
        "eval/plain_tokens_per_s", "eval/spec_tokens_per_s", "eval/tree_nodes_per_step", "eval/greedy_equal")


@dataclass
class BenchHybridConfig:
    """Schema of ``python -m scripts.bench_hybrid`` (key=value overrides, validated before any work)."""

    run: str = "outputs/parallelspec-smollm2-135m-instruct"  # a finished training run (drafter/ + config.json)
    sources: list[str] = field(default_factory=lambda: ["none", "input", "data"])
    nodes: int = SSSDEvalConfig.nodes  # SSSD-only nodes per tree at most (the main job's)
    latency_prompts: int = 4
    out: str = "docs/benchmarks/hybrid"


def bench(cfg: BenchHybridConfig) -> dict:
    from drafttrain.config import ConfigError, to_dict
    from drafttrain.validation import validate
    from drafttrain.compose import build_run
    from drafttrain.eval.in_training import spec_eval
    from scripts.common import load_run_config, run_train_data

    bad = sorted(set(cfg.sources) - {"none", "input", "data"})
    if bad:
        raise ConfigError(f"sources must be among none|input|data, got {bad}")
    saved = load_run_config(cfg.run)
    saved["output_dir"] = "outputs/bench_hybrid"  # eval_outputs.jsonl of each evaluation
    base = validate(saved)
    built = build_run(base, drafter=cfg.run)  # the run's drafter, packed like its target
    target, drafter = built.target, built.drafter
    train_ds = run_train_data(base, target) if "data" in cfg.sources else None
    rows = []
    for src in cfg.sources:
        d = to_dict(base)
        d["trainer"]["spec_eval"]["sssd"] = {"source": src, "nodes": cfg.nodes}
        d["trainer"]["spec_eval"]["latency_prompts"] = cfg.latency_prompts
        c = validate(d)
        Path(c.output_dir).mkdir(parents=True, exist_ok=True)
        r = spec_eval(c, target, drafter, train_ds)
        row = {"source": src, **{k: r.get(k) for k in KEYS}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "run": cfg.run, "nodes": cfg.nodes, "tree": f"{base.trainer.spec_eval.tree}",
            "prompts": r.get("eval/prompts"), "max_new_tokens": base.trainer.spec_eval.max_new_tokens}  # fmt: skip


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    lines = ["# Hybrid draft trees: the drafter's tree + SSSD's training-free candidates", "",
             f"Measured {res['date']}: {machine_line(res.get('machine'))}, 1-minute load "
             f"average {res['machine']['loadavg_1min']} at the start.", "",
             f"Run `{res['run']}`; its final evaluation (prompts: {res['prompts']}; {res['max_new_tokens']} new tokens; "
             f"tree {res['tree']}) once per SSSD source, up to {res['nodes']} SSSD-only nodes per tree. τ = the full "
             "tree's tokens per verification step; b16 = 16 sequences at a time with the online planner; b1 = the first "
             "prompts one at a time with the planner; every speedup is tokens/s over plain decoding in the same engine, "
             "measured beside it.", "",
             "| SSSD source | τ (full tree) | τ (planned) | nodes per step | speedup b16 | speedup b16, full tree | speedup b1 | τ b1 | greedy-equal |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def f(x, d=3):
        return "" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))

    for r in res["rows"]:
        lines.append(f"| {r['source']} | {f(r['eval/tau'])} | {f(r['eval/tau_planned'])} | {f(r['eval/tree_nodes_per_step'], 1)} | "
                     f"{f(r['eval/speedup_b16'], 2)}x | {f(r['eval/speedup_full_tree'], 2)}x | {f(r['eval/speedup_b1'], 2)}x | "
                     f"{f(r['eval/tau_b1'])} | {r['eval/greedy_equal']} |")  # fmt: skip
    lines += ["", "Reproduce (from the repository root, after the main job):", "", "```bash", command, "```", "", analysis, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchHybridConfig, bench, markdown, "bench_hybrid", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
