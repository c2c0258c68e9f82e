"""Training step time of the group-wise layout against a naive version running K + 1 separate passes.

    python -m scripts.bench_layout steps=10 out=docs/benchmarks/layout

The group-wise layout (:mod:`drafttrain.layout`, ParallelSpec section 4.1) trains every position of
every parallel group in ONE drafter pass: the T context items once, then K mask slots per anchor.
Without it, the exact alternative is one pass per group position k = 0..K ("shift the labels by k",
done right): pass k holds the T items and, for every anchor, mask slots 1..k (slot k needs slots
1..k-1 as context), and only its position-k slots enter the loss. :func:`naive_loss` computes exactly
the layout's loss that way (tested equal: tests/test_bench_layout.py), so the step-time ratio is the
compute the layout saves. A step = forward + backward + AdamW step on the same real batches,
alternating the two methods step by step; the median over ``steps`` steps is reported.

Writes ``<out>.json`` and ``<out>.md``. ``overrides`` are Hydra overrides of the training config
(default: the parallelspec recipe as it ships, on the main job's cached self-distilled data).
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from drafttrain import layout as L
from drafttrain.losses import parallel_group_loss


def naive_loss(dr, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
    """ParallelSpec's Eq. 3 loss of ``dr`` (a ParallelSpecDrafter) computed with K + 1 separate passes.

    Anchors are drawn exactly as :meth:`ParallelSpecDrafter.layouts` draws them (same generator order),
    so the result equals ``dr.training_loss(batch, generator).loss``.
    """
    ids, feats = batch["input_ids"], batch["features"]
    t = ids.shape[1] - 1
    k_max = dr.num_mask_tokens
    items = dr.items(ids[:, 1:], dr.noisy(feats[:, :t], generator))  # [b, t, d]
    ratio = float(dr.config["anchor_ratio"]) if dr.training else 1.0
    per_seq = []
    for i in range(ids.shape[0]):
        n = int(batch["lengths"][i])
        labels = L.item_labels(ids[i, :n], batch["loss_mask"][i, :n])
        per_seq.append((labels, L.select_anchors(labels, k_max, ratio, generator)))
    kd = float(dr.config["kd_weight"])
    total = items.new_zeros((), dtype=torch.float32)
    for k in range(k_max + 1):  # pass k: items + mask slots 1..k of every anchor; loss on position k only
        lays = [L.build_group_layout(y, a if k > 0 else a[:0], k) for y, a in per_seq]
        lay = L.collate_layouts(lays, dtype=dr.fc.weight.dtype)
        hidden = dr.forward_layout(items, lay)  # [b, s_k, d]
        draft = dr.target_to_draft(lay.labels)
        sel = (lay.slot_kind == k) & (lay.labels != L.IGNORE_INDEX) & (draft >= 0)
        logits = dr.logits(hidden[sel])
        t_logits = dr.target_logits(dr.slot_target_features(lay, feats, sel)) if kd > 0 else None
        loss, _, _ = parallel_group_loss(logits, draft[sel], lay.slot_kind[sel], dr.weights, t_logits, kd)
        total = total + loss  # only position k has slots here: loss = w_k * mean CE at k
    return total


def _step(dr, opt, batch, method: str, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    loss = dr(batch, gen).loss if method == "layout" else naive_loss(dr, batch, gen)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def bench(overrides: list[str], steps: int, anchor_ratios: list[float]) -> dict:
    from drafttrain.config import to_dict
    from drafttrain.data.batches import get_batch, sample_indices
    from drafttrain.data.pipeline import LocalProcess, prepare_data
    from drafttrain.data.vocab import frequent_tokens
    from drafttrain.drafters import build_drafter, drafter_config
    from drafttrain.target import load_target
    from drafttrain.train import compose_config

    c = compose_config(["+recipe=parallelspec", *overrides])
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    target = load_target(c.target)
    train_ds, _ = prepare_data(c, target, LocalProcess())
    lengths = [len(x) for x in train_ds.with_format(None)["input_ids"]]
    mbs = c.trainer.micro_batch_size
    group = mbs * c.trainer.length_group_steps
    batches = [get_batch(train_ds, target, sample_indices(s * mbs, mbs, len(train_ds), c.seed, lengths, group),
                         target.device) for s in range(steps + 1)]  # fmt: skip
    vocab = None
    if c.drafter.draft_vocab_size:
        vocab, _ = frequent_tokens(train_ds, c.drafter.draft_vocab_size, target.lm_head.weight.shape[0])
    rows = []
    for ratio in anchor_ratios:
        full = {**to_dict(c)["drafter"], "anchor_ratio": ratio}
        times: dict[str, list[float]] = {"layout": [], "naive": []}
        models = {}
        for method in times:
            torch.manual_seed(c.seed)
            dr = build_drafter("parallelspec", drafter_config("parallelspec", full), target)
            if vocab is not None:
                dr.set_draft_vocab(vocab)
            dr.train()
            models[method] = (dr, torch.optim.AdamW(dr.parameters(), lr=c.optim.lr))
        with torch.no_grad():  # the two methods compute the same loss on the real batch
            a = float(models["layout"][0](batches[0], torch.Generator().manual_seed(0)).loss)
            b = float(naive_loss(models["naive"][0], batches[0], torch.Generator().manual_seed(0)))
        for s, batch in enumerate(batches):  # step 0 is a warm-up, not timed
            for method in (("layout", "naive") if s % 2 == 0 else ("naive", "layout")):
                dt = _step(*models[method], batch, method, seed=s)
                if s > 0:
                    times[method].append(dt)
        lay_s, naive_s = statistics.median(times["layout"]), statistics.median(times["naive"])
        rows.append({
            "anchor_ratio": ratio,
            "layout_step_s": round(lay_s, 4),
            "naive_step_s": round(naive_s, 4),
            "ratio_naive_over_layout": round(naive_s / lay_s, 2),
            "loss_layout": a,
            "loss_naive": b,
            "layout_steps_s": [round(x, 4) for x in times["layout"]],
            "naive_steps_s": [round(x, 4) for x in times["naive"]],
        })  # fmt: skip
    return {
        "config": {
            "target": c.target.name, "num_mask_tokens": c.drafter.num_mask_tokens,
            "draft_vocab_size": c.drafter.draft_vocab_size, "kd_weight": c.drafter.kd_weight,
            "micro_batch_size": mbs, "mean_sequence_tokens": sum(float(b["lengths"].float().mean()) for b in batches) / len(batches),
            "mixed_precision": "no (fp32)", "overrides": overrides,
        },
        "machine": {"torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
                    "processor": platform.processor() or platform.machine()},
        "timed_steps": steps,
        "rows": rows,
    }  # fmt: skip


def markdown(result: dict, command: str) -> str:
    cfg = result["config"]
    lines = [
        "# Group-wise layout vs. K + 1 separate passes (training step time)",
        "",
        f"ParallelSpec drafter, {cfg['target']}, K = {cfg['num_mask_tokens']}, draft vocabulary "
        f"{cfg['draft_vocab_size']}, kd_weight {cfg['kd_weight']}, micro-batch {cfg['micro_batch_size']} "
        f"(mean {cfg['mean_sequence_tokens']:.0f} tokens per sequence), fp32, {result['machine']['torch_threads']} torch threads. "
        f"A step = forward + backward + AdamW on the same real batches; median of {result['timed_steps']} steps per "
        "method, the two methods alternating. The naive version runs pass k = 0..K with the items and mask "
        "slots 1..k of every anchor and takes only position k's loss; both compute the same loss (checked "
        "on the first batch below, and in tests/test_bench_layout.py).",
        "",
        "| anchor ratio | layout step (s) | K + 1 passes step (s) | naive / layout | loss layout | loss naive |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['anchor_ratio']} | {r['layout_step_s']:.3f} | {r['naive_step_s']:.3f} | "
                     f"**{r['ratio_naive_over_layout']:.2f}x** | {r['loss_layout']:.5f} | {r['loss_naive']:.5f} |")  # fmt: skip
    lines += ["", "Reproduce:", "", "```bash", command, "```", ""]
    return "\n".join(lines)


@dataclass
class BenchLayoutConfig:
    """Schema of ``python -m scripts.bench_layout`` (key=value overrides, validated before any work)."""

    steps: int = 10  # timed steps per method (after one warm-up step)
    anchor_ratios: list[float] = field(default_factory=lambda: [0.25, 1.0])
    out: str = "docs/benchmarks/layout"
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of the training config, e.g. [target=tiny]


def main(argv: list[str] | None = None) -> dict:
    import json

    from drafttrain.cliconfig import parse_cli
    from scripts.common import reproduce, write_report

    args = parse_cli(BenchLayoutConfig, argv)
    result = bench(args.overrides, args.steps, args.anchor_ratios)
    command = reproduce("bench_layout", argv)
    write_report(args.out, {**result, "command": command}, markdown(result, command))
    for r in result["rows"]:
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("steps_s")}))
    return result


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
