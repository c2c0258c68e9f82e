"""Decoding methods side by side on the real target; writes docs/benchmarks/modes.{json,md}.

    python -m scripts.build_datastore       # once: the SSSD datastore (data/datastore/sharegpt)
    python -m scripts.bench_modes checkpoint=outputs/mainjob2_eval
    python -m scripts.bench_modes replan=true    # only re-run the SSSD planner for an existing <out>.json

For each prompt set (MT-bench, GSM8K) and batch size (1, 8) one harness run
(:func:`drafttrain.eval.harness.evaluate`) decodes the same prompts with plain decoding, the trained
ParallelSpec drafter, SSSD (tree size chosen by the speculation-length planner), improved MCSD
(W_t = 1 and 2) and MTAD, all in the same process on the same engine (EMS-SD unpadded mode), with the
output perplexity under the target for every run (MCSD W_t > 1 and MTAD are lossy). A second run sweeps
SSSD's tree size on MT-bench at the same batch sizes: the measured best size beside the planner's choice.
A hand-written section between ``<!-- analysis -->`` markers in an existing page is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import kept_analysis, machine_line, reproduce, run_eval

METHODS = "[parallelspec,sssd,mcsd,mtad]"


@dataclass
class BenchModesConfig:
    """Schema of ``python -m scripts.bench_modes`` (key=value overrides, validated before any work)."""

    checkpoint: str | None = None  # training run folder of a ParallelSpec drafter (required unless replan=true)
    num_prompts: int = 8
    max_new_tokens: int = 96
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_sets: list[str] = field(default_factory=lambda: ["mt_bench", "gsm8k"])
    sweep: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])  # SSSD tree sizes swept on MT-bench ([] = none)
    threads: int = 2
    # extra harness overrides (default: the main job's tree for the ParallelSpec drafter)
    overrides: list[str] = field(default_factory=lambda: ["tree.widths=[4,2,1,1,1]", "tree.budget=8"])
    replan: bool = False  # only re-run the SSSD planner for an existing <out>.json
    out: str = "docs/benchmarks/modes"
    work_dir: str = "outputs/bench_modes"


def summary_table(results: dict) -> list[str]:
    """Method x batch rows of one prompt set: τ, tok/s, speedup, perplexity, lossless."""
    lines = ["| batch | method | lossless | τ | tok/s | speedup | perplexity | outputs equal to plain |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["runs"]:
        name = r["method"] + (f" (n = {r['node_budget']}, planner)" if r["method"] == "sssd" else "")
        eq = "-" if r["method"] == "plain" else f"{r.get('equal_fraction', float('nan')):.0%}"
        lines.append(f"| {r['batch_size']} | {name} | {'yes' if r.get('lossless', True) else '**no**'} | {r['tau']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r.get('perplexity', float('nan')):.3f} | {eq} |")  # fmt: skip
    return lines


def planner_table(main: dict, sweep: dict) -> list[str]:
    """Planner's tree size per batch size vs the best size measured in the sweep."""
    lines = ["| batch | planner: n | planner: expected speedup | measured best n | its speedup | speedup at the planner's n (main run) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for b, plan in main.get("sssd_planner", {}).items():
        swept = [r for r in sweep["runs"] if r["method"].startswith("sssd_n") and r["batch_size"] == int(b)]
        best = max(swept, key=lambda r: r["tokens_per_s"]) if swept else None
        at_plan = next((r for r in main["runs"] if r["method"] == "sssd" and r["batch_size"] == int(b)), None)
        best_n = best["node_budget"] if best else "-"
        best_s = "%.2fx" % best["speedup"] if best else "-"
        plan_s = "%.2fx" % at_plan["speedup"] if at_plan else "-"
        lines.append(f"| {b} | {plan['best_size']} | {plan['expected_speedup']:.2f}x | {best_n} | {best_s} | {plan_s} |")
    lines += ["", "Sweep (MT-bench): speedup by SSSD tree size n", "",
              "| batch | " + " | ".join(f"n = {r['node_budget']}" for r in sweep["runs"]
                                       if r["method"].startswith("sssd_n") and r["batch_size"] == sweep["runs"][0]["batch_size"]) + " |"]  # fmt: skip
    sizes = sorted({r["batch_size"] for r in sweep["runs"]})
    lines.append("|---" * (1 + sum(1 for r in sweep["runs"] if r["method"].startswith("sssd_n") and r["batch_size"] == sizes[0])) + "|")
    for b in sizes:
        cells = [f"{r['speedup']:.2f}x (τ {r['tau']:.2f})" for r in sweep["runs"]
                 if r["method"].startswith("sssd_n") and r["batch_size"] == b]  # fmt: skip
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(data: dict, out: Path) -> None:
    """modes.md from modes.json's dict (the analysis section of an existing page is kept)."""
    sets = {k: v for k, v in data.items() if isinstance(v, dict) and "runs" in v and k != "sssd_sweep"}
    first = next(iter(sets.values()))
    m, cc = first["machine"], first["command_config"]
    body = [
        "# Decoding methods side by side: plain, ParallelSpec, SSSD, improved MCSD, MTAD",
        "",
        f"Reproduce (JSON: `{out.with_suffix('.json').name}`):",
        "",
        f"```bash\npython -m scripts.build_datastore\n{data['command']}\n```",
        "",
        f"Machine: {machine_line(first.get('host') or m)}, Python {m['python']}; "
        f"git {first['git_sha']}. Target `{cc['target']['name']}`, drafter `{cc['checkpoint']}` "
        f"(K = {first['drafter']['num_mask_tokens']}); greedy decoding, {cc['num_prompts']} prompts per set, "
        f"{cc['max_new_tokens']} new tokens, engine mode `unpadded` (EMS-SD), plain baseline in `unpadded_kv`. "
        "Speedup = tokens/s over plain decoding of the same prompts and batch size in the same run. Perplexity: "
        "of the outputs under the target (lower = more likely); lossless methods reproduce plain greedy output.",
        "",
        kept_analysis(out.with_suffix(".md")),
        "",
    ]  # fmt: skip
    for name, res in sets.items():
        body += [f"## {name}", "", *summary_table(res), ""]
    sweep = data.get("sssd_sweep")
    if sweep is not None:
        mt = sets.get("mt_bench", first)
        body += ["## SSSD speculation-length planner vs measured best (MT-bench)", "", *planner_table(mt, sweep), ""]
        if data.get("replanned"):
            r = data["replanned"]
            body += [f"Planner re-run with forward times measured through the engine (git {r['git_sha']}, "
                     f"`python -m scripts.bench_modes replan=true`):", "",
                     "| batch | planner: n | expected speedup | forward ms by s = n + 1 |", "|---|---|---|---|"]  # fmt: skip
            for b, p in r["plans"].items():
                fw = ", ".join(f"{k}: {1000 * v:.0f}" for k, v in p["forward_seconds"].items())
                body.append(f"| {b} | {p['best_size']} | {p['expected_speedup']:.2f}x | {fw} |")
            body.append("")
    out.with_suffix(".md").write_text("\n".join(body))


def replan(out: Path) -> None:
    """Re-run only the planner (forward times measured now) for the batch sizes of an existing modes.json."""
    from drafttrain.validation import validate_eval
    from drafttrain.eval.harness import run_git_sha
    from drafttrain.verify.methods.sssd import plan_sssd_budget
    from drafttrain.compose import build_run

    data = json.loads(out.with_suffix(".json").read_text())
    cc = dict(data["mt_bench"]["command_config"])
    c = validate_eval(cc)
    target = build_run(c).target
    import torch

    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    data["replanned"] = {"git_sha": run_git_sha(), "plans": {str(b): plan_sssd_budget(c, target, b) for b in c.batch_sizes}}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    write_markdown(data, out)


def main(argv: list[str] | None = None) -> None:
    import logging

    from drafttrain.cliconfig import ConfigError, parse_cli

    args = parse_cli(BenchModesConfig, argv)
    if not args.replan and not args.checkpoint:
        raise ConfigError("checkpoint=<training run folder> is required (or replan=true)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    if args.replan:
        replan(out)
        print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
        return
    base = [f"checkpoint={args.checkpoint}", f"num_prompts={args.num_prompts}", f"max_new_tokens={args.max_new_tokens}",
            f"batch_sizes=[{','.join(map(str, args.batch_sizes))}]", "modes=[unpadded]", f"num_threads={args.threads}",
            "progress=false", "plots=false", *args.overrides]  # fmt: skip
    results = {name: run_eval(base + [f"prompts={name}", f"methods={METHODS}", f"output_dir={args.work_dir}/{name}"])
               for name in args.prompt_sets}  # fmt: skip
    sweep = None
    if args.sweep:
        sweep = run_eval(base + ["prompts=mt_bench", "methods=[sssd]", f"sssd.node_budgets=[{','.join(map(str, args.sweep))}]",
                                 f"output_dir={args.work_dir}/sssd_sweep"])  # fmt: skip
    command = reproduce("bench_modes", argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"command": command, **results, "sssd_sweep": sweep}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    write_markdown(data, out)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
