"""Drafting time per engine step: the ParallelSpec proposer's greedy hot path before and after its
rework (batched draft-vocabulary trees, memoized templates), and with the drafter on prepacked weights.

    python -m scripts.bench_draft_cost

Two engines decode the same prompts side by side, one step each in turn (greedy, EMS-SD unpadded
engine, the drafter's best-first tree): one with ``ParallelSpecProposer(fast_greedy=False)`` (before:
the drafter's logits scattered into the full vocabulary, a softmax and D top-k calls per sequence, a
tree template built and validated every step), one with ``fast_greedy=True`` (after: one softmax +
top-k over the draft vocabulary for the batch, memoized templates, trusted trees) and one with the
same proposer on a copy of the drafter whose linear layers and draft head are prepacked (packed:
:meth:`~drafttrain.drafters.base.Drafter.pack_for_inference`). The before and after
trees are the same (tests/verify/test_fast_drafting.py), so those engines stay in the same state (the packed
one's differ by float reassociation only and may part at a near tie); the page reports each
one's drafting time per step (``EngineStats.draft_seconds``: drafter forward + tree building),
median over steps, at every batch size. ``drafter``: a training run folder (or its ``drafter/``);
null = a fresh drafter of the shipped ParallelSpec config (same cost, meaningless acceptance).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from drafttrain.config import TargetConfig


@dataclass
class BenchDraftCostConfig:
    """Schema of ``python -m scripts.bench_draft_cost`` (key=value overrides, validated before any work)."""

    drafter: str | None = None  # a training run folder or drafter/ folder; null = fresh ParallelSpec drafter
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 16])
    steps: int = 20  # timed steps per batch size and variant (after 2 warm-up steps)
    tree_widths: list[int] = field(default_factory=lambda: [4, 2, 1, 1, 1])
    tree_budget: int = 8
    prompts: str = "mt_bench"
    threads: int = 2
    seed: int = 0
    out: str = "docs/benchmarks/draft_cost"
    target: TargetConfig = field(default_factory=TargetConfig)


def bench(cfg: BenchDraftCostConfig) -> dict:
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids
    from drafttrain.compose import build_run
    from drafttrain.compose import Run
    from drafttrain.verify import ParallelSpecProposer
    from scripts.common import load_drafter

    torch.set_num_threads(cfg.threads)
    target = build_run(cfg).target
    drafter = load_drafter(target, cfg.drafter, cfg.seed, pack=False)
    packed = load_drafter(target, cfg.drafter, cfg.seed)  # the same weights, its linears and head prepacked
    rows_in = load_eval_prompts(cfg.prompts, limit=max(cfg.batch_sizes))
    prompts = [prompt_ids(target.tokenizer, r["messages"]) for r in rows_in]
    variants = {"before": (drafter, False), "after": (drafter, True), "packed": (packed, True)}
    rows = []
    for b in cfg.batch_sizes:
        ps = (prompts * ((b + len(prompts) - 1) // len(prompts)))[:b]
        engines = {}
        for name, (dr, fast) in variants.items():
            prop = ParallelSpecProposer(dr, widths=cfg.tree_widths, budget=cfg.tree_budget, fast_greedy=fast)
            eng = Run(target).engine(prop, batch_size=b, max_new_tokens=cfg.steps * 8 + 16, stop_token_ids=-1)
            eng.submit(ps)
            eng.admit()
            engines[name] = eng
        times = {name: [] for name in variants}
        order = list(variants)
        for i in range(cfg.steps + 2):
            k = i % len(order)
            for name in order[k:] + order[:k]:  # one step each in turn, the order rotating
                eng = engines[name]
                if eng.done:
                    continue
                before = eng.stats.draft_seconds
                eng.step()
                if i >= 2:
                    times[name].append(1000 * (eng.stats.draft_seconds - before))
        gen = {n: [s.generated for s in e.rows if s is not None] for n, e in engines.items()}
        nodes = {n: e.stats.tree_nodes for n, e in engines.items()}
        # packed numerics differ by float reassociation only: its trees may part at a near tie (reported)
        row = {"batch": b, "before_ms": statistics.median(times["before"]), "after_ms": statistics.median(times["after"]),
               "packed_ms": statistics.median(times["packed"]), "steps": len(times["after"]),
               "same_state": gen["before"] == gen["after"] and nodes["before"] == nodes["after"],
               "packed_same_state": gen["packed"] == gen["after"] and nodes["packed"] == nodes["after"],
               "forward_ms": 1000 * engines["after"].stats.forward_seconds / max(engines["after"].stats.forwards, 1)}  # fmt: skip
        rows.append(row)
        print(f"batch {b:2d}: drafting before {row['before_ms']:.1f} ms/step, after {row['after_ms']:.1f}, packed "
              f"{row['packed_ms']:.1f} (verification forward {row['forward_ms']:.1f} ms)", flush=True)  # fmt: skip
    return {"rows": rows, "drafter": cfg.drafter or "fresh parallelspec (shipped config)",
            "draft_vocab": int(drafter.d2t.numel()), "num_mask_tokens": int(getattr(drafter, "num_mask_tokens", 0))}  # fmt: skip


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    m = res["machine"]
    shared = m.get("loadavg_1min", 0) > 0.5 * (m.get("cpus") or 1)
    lines = [
        "# Drafting time per step: ParallelSpec greedy trees before / after the hot-path work and on prepacked weights",
        "",
        f"Measured {res['date']} on {machine_line(m)}; 1-minute load average {m['loadavg_1min']} at the start"
        + (" and the machine was **shared with other jobs** while this ran (times inflated and noisy; the two "
           "variants alternate step by step, so the comparison stays fair)." if shared else "."),
        "",
        f"Drafter: {res['drafter']} (K = {res['num_mask_tokens']}, draft vocabulary {res['draft_vocab']}); best-first tree "
        f"top-{res['config']['tree_widths']}, {res['config']['tree_budget']} nodes; MT-bench prompts; median over "
        f"{res['config']['steps']} steps. **before** = `ParallelSpecProposer(fast_greedy=False)` (full-vocabulary "
        "scatter, per-sequence softmax and top-k, templates rebuilt and validated every step); **after** = the default "
        "(one draft-vocabulary top-k for the batch, memoized templates, trusted trees); **packed** = the default with "
        "the drafter's linear layers and draft-vocabulary head on oneDNN prepacked weights (`Drafter.pack_for_inference`, "
        "what the evaluation entry points do when the target runs packed). All include the drafter's forward; the three engines "
        "advance one step each in turn.",
        "",
        "| batch | drafting before (ms/step) | after (ms/step) | packed (ms/step) | packed / before | verification forward (ms) "
        "| same trees (before, after) | same trees (packed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        pk, same_pk = r.get("packed_ms"), r.get("packed_same_state")  # absent in pages from before the packed variant
        pk_ms = "n/a" if pk is None else f"{pk:.1f}"
        pk_ratio = "n/a" if pk is None else f"{pk / r['before_ms']:.2f}"
        pk_same = "n/a" if same_pk is None else ("yes" if same_pk else "no (near tie)")
        lines.append(f"| {r['batch']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {pk_ms} | {pk_ratio} | "
                     f"{r['forward_ms']:.1f} | {'yes' if r['same_state'] else '**no**'} | {pk_same} |")  # fmt: skip
    lines += ["", "Reproduce (from the repository root):", "", "```bash", command, "```", "", analysis, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchDraftCostConfig, bench, markdown, "bench_draft_cost", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
