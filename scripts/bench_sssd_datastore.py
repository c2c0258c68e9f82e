"""Measure the SSSD datastore on real data: build time, size, load and lookup latency by batch size
(vectorised vs per-sequence, with/without a thread pool), and simulated acceptance on held-out answers.

    python -m scripts.build_datastore
    python -m scripts.sssd_grid
    python -m scripts.bench_sssd_datastore   # -> docs/benchmarks/sssd_datastore.{json,md}

The keys (``--help`` lists them) are those of :class:`BenchConfig`; ``grid`` is a ``scripts.sssd_grid``
JSON whose best weights are used (when the file exists).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class BenchConfig:
    """Schema of ``python -m scripts.bench_sssd_datastore`` (key=value overrides, validated before any work)."""

    datastore: str = "data/datastore/sharegpt"  # folder from scripts.build_datastore
    grid: str | None = "docs/benchmarks/sssd_grid.json"  # scripts.sssd_grid JSON with the best weights (null = defaults)
    num_sequences: int = 100
    offset: int = 40  # skip the held-out rows the grid search tuned on (scripts.sssd_grid uses the first 40)
    max_continuation: int = 128
    repeats: int = 20  # timed calls per latency (median), after one warm-up call
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    budgets: list[int] = field(default_factory=lambda: [0, 4, 8, 16, 32, 64])
    output: str = "docs/benchmarks/sssd_datastore"


def run(c: BenchConfig, argv: list[str] | None = None) -> dict:
    """Measure as configured; ``argv``: the overrides recorded in the reproduce command."""
    from drafttrain.verify.methods.sssd_datastore import Datastore
    from drafttrain.verify.methods.sssd import SSSDConfig, SSSDDrafter, simulate_greedy
    from scripts.common import load_sequences, machine, median_ms, reproduce

    t = time.perf_counter()
    ds = Datastore.load(c.datastore)
    load_ms = 1000 * (time.perf_counter() - t)
    seqs = load_sequences(Path(c.datastore) / "heldout.jsonl", c.num_sequences, c.max_continuation, c.offset)
    base = SSSDConfig()
    grid_best = None
    if c.grid and Path(c.grid).is_file():
        grid_report = json.loads(Path(c.grid).read_text())
        grid_best = grid_report["best"]
        base = SSSDConfig(**{**grid_report["base_config"], **grid_best})
    cfg = asdict(base)

    # -- lookup latency ------------------------------------------------------------------------
    rng = np.random.default_rng(0)
    contexts = []
    for _ in range(max(c.batch_sizes)):
        ctx, cont = seqs[int(rng.integers(len(seqs)))]
        contexts.append(ctx + cont[: int(rng.integers(0, len(cont)))])
    latency = []
    drafter1 = SSSDDrafter(base, ds)
    drafter2 = SSSDDrafter(base, ds, num_threads=2)
    for b in c.batch_sizes:
        ctxs = contexts[:b]
        states = [drafter1.new_state(x) for x in ctxs]
        look = lambda: ds.lookup_batch(ctxs, base.max_prefix_len, base.max_depth, base.max_samples, base.min_continuations)  # noqa: E731
        loop = lambda: [ds.lookup_batch([x], base.max_prefix_len, base.max_depth, base.max_samples, base.min_continuations) for x in ctxs]  # noqa: E731
        latency.append({
            "batch": b,
            "datastore_lookup_vectorised_ms": median_ms(look, c.repeats),
            "datastore_lookup_per_sequence_ms": median_ms(loop, c.repeats),
            "draft_batch_ms": median_ms(lambda: drafter1.draft_batch(states), c.repeats),
            "draft_per_sequence_ms": median_ms(lambda: [drafter1.draft(s) for s in states], c.repeats),
            "draft_batch_2_threads_ms": median_ms(lambda: drafter2.draft_batch(states), c.repeats),
        })

    # -- simulated acceptance --------------------------------------------------------------------
    acceptance = []
    for n in c.budgets:
        t = time.perf_counter()
        sim = simulate_greedy(SSSDDrafter(SSSDConfig(**{**cfg, "node_budget": n}), ds), seqs)
        acceptance.append({"source": "input + datastore", "node_budget": n, "tau": sim.tau, "steps": sim.steps,
                           "mean_tree_size": sim.mean_tree_size, "seconds": round(time.perf_counter() - t, 2)})
    for name, flags in (("input only", {"use_datastore": False}), ("datastore only", {"use_input": False})):
        sim = simulate_greedy(SSSDDrafter(SSSDConfig(**{**cfg, **flags}), ds), seqs)
        acceptance.append({"source": name, "node_budget": base.node_budget, "tau": sim.tau, "steps": sim.steps,
                           "mean_tree_size": sim.mean_tree_size})
    meta = ds.meta
    return {
        "command": reproduce("bench_sssd_datastore", argv),
        "machine": {**machine(), "numpy": np.__version__},  # drafttrain.host.describe + numpy
        "datastore": {
            "path": c.datastore, "source": meta.get("source"), "answers_only": meta.get("answers_only"),
            "rows": meta.get("rows"), "documents": meta["num_documents"], "tokens": meta["num_tokens"],
            "bytes": ds.nbytes, "tokenize_seconds": meta.get("load_rows_seconds"),
            "suffix_array_seconds": meta["build_seconds"], "build_seconds": meta.get("total_build_seconds"),
            "load_ms": round(load_ms, 2), "heldout_rows": meta.get("heldout_rows"),
            "heldout_dropped_duplicates": meta.get("heldout_dropped_duplicates"),
        },
        "sssd_config": cfg,
        "weights_from_grid": grid_best is not None,
        "sequences": len(seqs),
        "offset": c.offset,
        "continuation_tokens": sum(len(x) for _, x in seqs),
        "latency": latency,
        "acceptance": acceptance,
    }


def write(report: dict, output: Path) -> None:
    from scripts.common import machine_line

    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    d = report["datastore"]
    cfg = report["sssd_config"]
    lines = [
        "# SSSD datastore on real data",
        "",
        f"Reproduce: `{report['command']}` (after `python -m scripts.build_datastore` and `python -m scripts.sssd_grid`).",
        f"Machine: {machine_line(report['machine'])}, Python {report['machine']['python']}, numpy {report['machine']['numpy']}.",
        "",
        "## Build and size",
        "",
        "| source | rows | documents | tokens | size (MB) | tokenize (s) | suffix array (s) | build total (s) | load, mmap (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {d['source']} ({'answers' if d['answers_only'] else 'whole rows'}) | {d['rows']:,} | {d['documents']:,} | {d['tokens']:,} | "
        f"{d['bytes'] / 1e6:.1f} | {d['tokenize_seconds']} | {d['suffix_array_seconds']} | {d['build_seconds']} | {d['load_ms']} |",
        "",
        f"SSSD config: P = {cfg['max_prefix_len']}, D = {cfg['max_depth']}, N = {cfg['max_samples']} samples, "
        f"threshold {cfg['min_continuations']}, weights {'from the grid search' if report['weights_from_grid'] else '(defaults)'}: "
        f"input scale {cfg['input_scale']}, input depth/match damping {cfg['input_depth_damp']}/{cfg['input_match_damp']}, "
        f"datastore depth/match damping {cfg['datastore_depth_damp']}/{cfg['datastore_match_damp']}, combine {cfg['combine']}.",
        "",
        "## Drafting latency per step (median ms, whole batch)",
        "",
        "| batch | datastore lookup, vectorised | datastore lookup, per sequence | full draft_batch (node budget "
        f"{cfg['node_budget']}) | full draft, per sequence | draft_batch, 2 threads |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["latency"]:
        lines.append(f"| {r['batch']} | {r['datastore_lookup_vectorised_ms']:.2f} | {r['datastore_lookup_per_sequence_ms']:.2f} | "
                     f"{r['draft_batch_ms']:.2f} | {r['draft_per_sequence_ms']:.2f} | {r['draft_batch_2_threads_ms']:.2f} |")
    lines += [
        "",
        f"## Simulated acceptance on {report['sequences']} held-out answers ({report['continuation_tokens']:,} tokens)",
        "",
        f"Held-out rows never entered the datastore ({d['heldout_rows']} kept, {d['heldout_dropped_duplicates']} dropped "
        f"because their answer occurs verbatim in the training rows); the first {report['offset']} held-out rows, on "
        "which the grid search chose the weights, are skipped here. τ_sim = tokens per verification step (bonus "
        "included) when the target's greedy choice is the data's own next token (first "
        "answer of each row, at most 128 tokens).",
        "",
        "| source | node budget | τ_sim | mean nodes | steps |",
        "|---|---|---|---|---|",
    ]
    for r in report["acceptance"]:
        lines.append(f"| {r['source']} | {r['node_budget']} | {r['tau']:.3f} | {r['mean_tree_size']:.1f} | {r['steps']} |")
    lines += [
        "",
        "## Notes",
        "",
        "- Latency columns: *datastore lookup* = `Datastore.lookup_batch` (binary search of all P prefix lengths, "
        "strided sampling, continuation gather), once for the whole batch (vectorised) or once per sequence; "
        "*full draft* = `SSSDDrafter.draft_batch` (lookup + datastore trees, vectorised over the batch, + per-sequence "
        "input-trie walks and fusion in Python) or `draft` per sequence; *2 threads* = the per-sequence Python part "
        "in a 2-thread pool (it holds the GIL, so threads cannot run it in parallel).",
        "- τ_sim here predicts ShareGPT's own answers (ChatGPT text), not SmolLM2's outputs: it measures the "
        "datastore and the drafter, and equals real greedy τ only on self-distilled data (the target's own answers).",
        "",
    ]
    output.with_suffix(".md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    c = parse_cli(BenchConfig, argv)
    report = run(c, argv)
    write(report, Path(c.output))
    print(json.dumps({"datastore": report["datastore"], "latency": report["latency"], "acceptance": report["acceptance"]}, indent=1))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
