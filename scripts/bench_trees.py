"""Each recipe's drafter through the batched verifier with its own proposer: chain vs draft trees.

    python -m scripts.bench_trees runs=outputs/bench_recipes

For every training run folder under ``runs`` (one per recipe, e.g. from ``scripts.bench_recipes``),
every tree of ``TREES[recipe]`` and every prompt set, one harness run
(:func:`drafttrain.eval.harness.evaluate`, EMS-SD unpadded mode) decodes the same prompts with plain
decoding and with the drafter's own proposer (:func:`drafttrain.verify.proposers.proposer_for`:
ParallelSpec / Medusa per-depth trees, EAGLE's autoregressive trees), at each batch size. Greedy
decoding: every speculative output is checked token for token against plain decoding. Writes
``<out>.json`` and ``<out>.md`` (a hand-written section between ``<!-- analysis -->`` markers in an
existing page is kept). Finished (recipe, tree, prompt set) runs are kept in ``work_dir`` and
skipped when the command is run again (interrupt and resume).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.common import cached, machine_line, recipe_runs, reproduce, run_eval, write_report

# recipe -> [(label, harness overrides)]; the chain is each drafter's own depth (ParallelSpec K + 1,
# Medusa K heads, EAGLE D steps)
TREES: dict[str, list[tuple[str, list[str]]]] = {
    "parallelspec": [("chain", []), ("best-first top-[4,2,1,1,1], 8 nodes", ["tree.widths=[4,2,1,1,1]", "tree.budget=8"])],
    "parallelspec_eagle": [("chain", []), ("best-first top-[4,2,1,1,1], 8 nodes", ["tree.widths=[4,2,1,1,1]", "tree.budget=8"])],
    "medusa": [("chain", []), ("best-first top-[4,2,1,1], 8 nodes", ["tree.widths=[4,2,1,1]", "tree.budget=8"]),
               ("Medusa's choice list, first 16 nodes", ["tree.choices=medusa_default", "tree.budget=16"])],
    "eagle": [("chain", []), ("EAGLE-2 dynamic [4,2,2,1,1], 8 nodes", ["tree.widths=[4,2,2,1,1]", "tree.budget=8"]),
              ("EAGLE's default tree (25 nodes)", ["tree.choices=eagle_default"])],
}  # fmt: skip


@dataclass
class BenchTreesConfig:
    """Schema of ``python -m scripts.bench_trees`` (key=value overrides, validated before any work)."""

    runs: str = "outputs/bench_recipes"  # folder with one training run folder per recipe
    recipes: list[str] = field(default_factory=lambda: list(TREES))
    prompt_sets: list[str] = field(default_factory=lambda: ["mt_bench", "gsm8k"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    num_prompts: int = 8
    max_new_tokens: int = 64
    threads: int = 2
    target: str = "smollm2"  # the target config the runs were trained for
    out: str = "docs/benchmarks/trees"
    work_dir: str = "outputs/bench_trees"


def table(rows: list[dict]) -> list[str]:
    lines = ["| recipe | tree | prompts | batch | τ | nodes/step | tok/s | plain tok/s | speedup | equal to plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['tree']} | {r['prompts']} | {r['batch_size']} | {r['tau']:.3f} | "
                     f"{r['nodes_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {'yes' if r['greedy_equal'] else '**no**'} |")  # fmt: skip
    return lines


def rows_of(recipe: str, tree: str, prompts: str, res: dict) -> list[dict]:
    plain = {r["batch_size"]: r for r in res["runs"] if r["method"] == "plain"}
    out = []
    for r in res["runs"]:
        if r["method"] == "plain":
            continue
        out.append({"recipe": recipe, "tree": tree, "prompts": prompts, "batch_size": r["batch_size"], "tau": r["tau"],
                    "nodes_per_step": r.get("mean_tree_nodes", float("nan")), "tokens_per_s": r["tokens_per_s"],
                    "plain_tokens_per_s": plain[r["batch_size"]]["tokens_per_s"], "speedup": r["speedup"],
                    "greedy_equal": bool(r.get("greedy_equal")), "accept_hist": r.get("accept_hist")})  # fmt: skip
    return out


def markdown(data: dict, analysis: str) -> str:
    a = data["args"]
    lines = [
        "# Draft trees per recipe through the batched verifier",
        "",
        "Reproduce (training runs from `python -m scripts.bench_recipes`):",
        "",
        "```bash",
        data["command"],
        "```",
        "",
        f"Greedy decoding, {a['num_prompts']} prompts per set, at most {a['max_new_tokens']} new tokens, EMS-SD "
        f"unpadded engine, {machine_line(data.get('machine'))}. Each row is one "
        "harness run: plain decoding and the recipe's drafter through its own proposer on the same prompts, in one "
        "process, speedup = their tokens/s ratio. τ = tokens emitted per sequence-step (../design.md, \"Definitions\").",
        "",
        *table(data["rows"]),
        "",
        analysis,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import logging

    from drafttrain.cliconfig import ConfigError, parse_cli

    args = parse_cli(BenchTreesConfig, argv)
    if set(args.recipes) - set(TREES):
        raise ConfigError(f"recipes: {sorted(set(args.recipes) - set(TREES))} not in {list(TREES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = Path(args.work_dir)
    rows, machine = [], None
    for recipe, ckpt in recipe_runs(args.runs, args.recipes):
        for t, (label, overrides) in enumerate(TREES[recipe]):
            for prompts in args.prompt_sets:
                res = cached(work / f"{recipe}-{t}-{prompts}.json", lambda: run_eval([
                    f"checkpoint={ckpt}", f"target={args.target}", "methods=[drafter]", f"prompts={prompts}", f"num_prompts={args.num_prompts}",
                    f"max_new_tokens={args.max_new_tokens}", f"batch_sizes=[{','.join(map(str, args.batch_sizes))}]",
                    "modes=[unpadded]", f"num_threads={args.threads}", "plots=false", "progress=false",
                    f"output_dir={work / f'{recipe}-{t}-{prompts}'}", *overrides,
                ]))  # fmt: skip
                machine = {**(res.get("machine") or {}), **(res.get("host") or {})}  # the harness's: drafttrain.host.describe
                rows += rows_of(recipe, label, prompts, res)
    data = {"command": reproduce("bench_trees", argv), "args": asdict(args), "machine": machine, "rows": rows}
    write_report(args.out, data, lambda analysis: markdown(data, analysis))
    print("\n".join(table(rows)))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
