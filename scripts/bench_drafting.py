"""Batched vs one-sequence-at-a-time drafting through the batched verifier, side by side.

    python -m scripts.bench_drafting runs=outputs/bench_recipes

For each recipe's training run under ``runs`` and each batch size, two harness runs
(:func:`drafttrain.eval.harness.evaluate`, EMS-SD unpadded engine, greedy, same prompts) differ only in
``tree.batched_drafting``: the drafter drafts the whole batch in shared forwards (EAGLE: one forward
for every sequence's new items, then one per tree depth carrying every sequence's frontier;
ParallelSpec: one forward) or one sequence after another with its own drafter cache. Both are
checked token for token against plain decoding, and their τ must agree (same trees). The ratio of
their tokens/s is the gain of batching the drafter. Writes ``<out>.json`` and ``<out>.md`` (a
hand-written section between ``<!-- analysis -->`` markers is kept); finished harness runs are kept
in ``work_dir`` and skipped when the command is run again (interrupt and resume).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.bench_trees import TREES
from scripts.common import cached, machine_line, recipe_runs, reproduce, run_eval, write_report


@dataclass
class BenchDraftingConfig:
    """Schema of ``python -m scripts.bench_drafting`` (key=value overrides, validated before any work)."""

    runs: str = "outputs/bench_recipes"  # folder with one training run folder per recipe
    recipes: list[str] = field(default_factory=lambda: ["eagle", "parallelspec"])
    tree_index: int = 1  # which of scripts.bench_trees.TREES[recipe] (1: the 8-node tree)
    prompts: str = "mt_bench"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8])
    num_prompts: int = 8
    max_new_tokens: int = 64
    threads: int = 2
    target: str = "smollm2"
    out: str = "docs/benchmarks/drafting"
    work_dir: str = "outputs/bench_drafting"


def table(rows: list[dict]) -> list[str]:
    lines = ["| recipe | tree | batch | drafting | τ | tok/s | plain tok/s | speedup | batched / per-sequence | equal to plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") is not None else ""
        lines.append(f"| {r['recipe']} | {r['tree']} | {r['batch_size']} | {r['drafting']} | {r['tau']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {ratio} | "
                     f"{'yes' if r['greedy_equal'] else '**no**'} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    import logging

    from drafttrain.cliconfig import ConfigError, parse_cli

    args = parse_cli(BenchDraftingConfig, argv)
    if set(args.recipes) - set(TREES) or any(not 0 <= args.tree_index < len(TREES[r]) for r in args.recipes):
        raise ConfigError(f"recipes must be among {list(TREES)} and tree_index a valid index of TREES[recipe]")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = Path(args.work_dir)
    rows, machine = [], None
    for recipe, ckpt in recipe_runs(args.runs, args.recipes):
        label, overrides = TREES[recipe][args.tree_index]
        for bs in args.batch_sizes:
            got = {}
            for batched in (True, False):
                name = f"{recipe}-b{bs}-{'batched' if batched else 'perseq'}"
                res = cached(work / f"{name}.json", lambda: run_eval([
                    f"checkpoint={ckpt}", f"target={args.target}", "methods=[drafter]", f"prompts={args.prompts}",
                    f"num_prompts={args.num_prompts}", f"max_new_tokens={args.max_new_tokens}", f"batch_sizes=[{bs}]",
                    "modes=[unpadded]", f"num_threads={args.threads}", "plots=false", "progress=false",
                    f"output_dir={work / name}", f"tree.batched_drafting={str(batched).lower()}", *overrides,
                ]))  # fmt: skip
                machine = {**(res.get("machine") or {}), **(res.get("host") or {})}  # the harness's: drafttrain.host.describe
                plain = next(r for r in res["runs"] if r["method"] == "plain")
                spec = next(r for r in res["runs"] if r["method"] != "plain")
                got[batched] = {"recipe": recipe, "tree": label, "batch_size": bs,
                                "drafting": "batched" if batched else "per-sequence", "tau": spec["tau"],
                                "tokens_per_s": spec["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
                                "speedup": spec["speedup"], "greedy_equal": bool(spec.get("greedy_equal"))}  # fmt: skip
            got[True]["ratio"] = got[True]["tokens_per_s"] / got[False]["tokens_per_s"]
            got[True]["same_tau"] = abs(got[True]["tau"] - got[False]["tau"]) < 1e-9
            rows += [got[True], got[False]]
    data = {"command": reproduce("bench_drafting", argv), "args": asdict(args), "machine": machine, "rows": rows}
    write_report(args.out, data, lambda analysis: markdown(data, analysis))
    print("\n".join(table(rows)))


def markdown(data: dict, analysis: str) -> str:
    a = data["args"]
    return "\n".join([
        "# Batched vs per-sequence drafting through the batched verifier",
        "",
        "Reproduce (training runs from `python -m scripts.bench_recipes`):",
        "",
        "```bash",
        data["command"],
        "```",
        "",
        f"Greedy decoding, {a['num_prompts']} {a['prompts']} prompts, at most {a['max_new_tokens']} new tokens, EMS-SD "
        f"unpadded engine, {machine_line(data['machine'])}. Each row is one harness run (plain decoding and the drafter on the "
        "same prompts in one process); the two rows of a batch size differ only in `tree.batched_drafting`. "
        "The last-but-one column is the tokens/s ratio of the pair.",
        "",
        *table(data["rows"]),
        "",
        analysis,
        "",
    ])


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
