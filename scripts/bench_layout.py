"""Training step time of the group-wise layout against a naive version running K + 1 separate passes.

    python -m scripts.bench_layout steps=10 out=docs/benchmarks/layout

The group-wise layout (:mod:`drafttrain.layout`, ParallelSpec section 4.1) trains every position of
every parallel group in ONE drafter pass: the T context items once, then K mask slots per anchor.
Without it, the exact alternative is one pass per group position k = 0..K ("shift the labels by k",
done right): pass k holds the T items and, for every anchor, mask slots 1..k (slot k needs slots
1..k-1 as context), and only its position-k slots enter the loss. :func:`naive_loss` computes exactly
the layout's loss that way (tested equal: tests/scripts/test_bench_layout.py), so the step-time ratio is the
compute the layout saves. A step = forward + backward + AdamW step on the same real batches,
alternating the two methods step by step; the median over ``steps`` steps is reported.

Writes ``<out>.json`` and ``<out>.md``. ``overrides`` are Hydra overrides of the training config
(default: the parallelspec recipe as it ships, on the main job's cached self-distilled data).

``part=masks`` (the page's second section; ``part=all`` runs both) measures the dense mask against the flex
block mask of the same layout (:mod:`drafttrain.attention`) at layout lengths ``mask_lengths``: one attention
forward of a SmolLM2-135M-shaped layer (9 query heads, 3 key/value heads, head dim 64, fp32, batch 1) over
the group-wise layout with K = 4 and every item an anchor (s = 5t slots), mask building included. Dense =
the additive mask + ``scaled_dot_product_attention``; flex = the block mask + compiled flex attention (CPU
kernel). Forward only: flex attention has no backward on CPU. Each (mode, length) runs in its own process;
peak memory = the rise of its resident-set high-water mark over the inputs (Linux ``/proc/self/status``
VmHWM, reset after a warm-up call that also compiles), time = median of ``mask_repeats`` calls.
Other parts' results already in ``<out>.json`` are kept.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
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
    from scripts.common import machine
    from drafttrain.config import to_dict
    from drafttrain.data.batches import get_batch, sample_indices
    from drafttrain.data.pipeline import LocalProcess, prepare_data
    from drafttrain.data.vocab import frequent_tokens
    from drafttrain.drafters import build_drafter, drafter_config
    from drafttrain.compose import build_run
    from drafttrain.train import compose_config

    c = compose_config(["+recipe=parallelspec_medusa", *overrides])  # the Medusa integration: drafter parallelspec
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    target = build_run(c).target
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
        "machine": machine(),  # drafttrain.host.describe + the load average
        "timed_steps": steps,
        "rows": rows,
    }  # fmt: skip


def markdown(result: dict, command: str) -> str:
    from scripts.common import machine_line

    cfg = result["config"]
    lines = [
        "# Group-wise layout vs. K + 1 separate passes (training step time)",
        "",
        f"ParallelSpec drafter, {cfg['target']}, K = {cfg['num_mask_tokens']}, draft vocabulary "
        f"{cfg['draft_vocab_size']}, kd_weight {cfg['kd_weight']}, micro-batch {cfg['micro_batch_size']} "
        f"(mean {cfg['mean_sequence_tokens']:.0f} tokens per sequence), fp32, on {machine_line(result['machine'])}. "
        f"A step = forward + backward + AdamW on the same real batches; median of {result['timed_steps']} steps per "
        "method, the two methods alternating. The naive version runs pass k = 0..K with the items and mask "
        "slots 1..k of every anchor and takes only position k's loss; both compute the same loss (checked "
        "on the first batch below, and in tests/scripts/test_bench_layout.py).",
        "",
        "| anchor ratio | layout step (s) | K + 1 passes step (s) | naive / layout | loss layout | loss naive |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['anchor_ratio']} | {r['layout_step_s']:.3f} | {r['naive_step_s']:.3f} | "
                     f"**{r['ratio_naive_over_layout']:.2f}x** | {r['loss_layout']:.5f} | {r['loss_naive']:.5f} |")  # fmt: skip
    lines += ["", "Reproduce:", "", "```bash", command, "```", ""]
    return "\n".join(lines)


MASK_SHAPE = {"heads": 9, "kv_heads": 3, "head_dim": 64, "num_mask_tokens": 4}  # SmolLM2-135M's attention


def _status_bytes(key: str) -> int:
    """A memory line of ``/proc/self/status`` (VmRSS: resident now, VmHWM: its high-water mark) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def mask_point(mode: str, slots: int, repeats: int) -> dict:
    """One (mode, layout length) measurement, in the calling process (:func:`bench_masks` runs each in its own).

    Returns:
        {"mode", "slots", "items", "forward_ms", "peak_mib" (rise of VmHWM over the inputs), "mask_mib" (the
        dense mask's bytes, or the block mask's tensors), "blocks_computed" (flex: share of 128 x 128 blocks
        with an allowed entry), "max_abs_diff" (flex vs a dense reference on the first 512 query rows)}.
    """
    from drafttrain import attention as A

    torch.manual_seed(0)
    k = MASK_SHAPE["num_mask_tokens"]
    t = slots // (k + 1)
    lay_one = L.build_group_layout(torch.arange(t), torch.arange(t), k)
    h, hk, hd = MASK_SHAPE["heads"], MASK_SHAPE["kv_heads"], MASK_SHAPE["head_dim"]
    s = lay_one.num_slots
    q, kk, v = torch.randn(1, h, s, hd), torch.randn(1, hk, s, hd), torch.randn(1, hk, s, hd)
    A.COMPILE_ON_CPU = True
    extra: dict = {}

    def run():
        if mode == "dense":
            lay = L.collate_layouts([lay_one], torch.float32)
            out = torch.nn.functional.scaled_dot_product_attention(q, kk, v, attn_mask=lay.attention_mask, enable_gqa=True)
            extra["mask_bytes"] = lay.attention_mask.numel() * 4
            return out
        lay = L.collate_layouts([lay_one], torch.float32, dense=False)
        bm = A.group_block_mask(lay)
        extra["mask_bytes"] = sum(x.numel() * x.element_size() for x in bm.as_tuple() if isinstance(x, torch.Tensor))
        extra["blocks_computed"] = round(1 - bm.sparsity() / 100, 4)
        return A.flex_attention_forward(None, q, kk, v, bm, scaling=hd**-0.5)[0].transpose(1, 2)

    with torch.no_grad():
        out = run()  # warm-up (compiles flex)
        diff = None
        if mode == "flex":
            rows = min(s, 512)
            ref_mask = L.collate_layouts([lay_one], torch.float32).attention_mask[..., :rows, :]
            ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, :rows], kk, v, attn_mask=ref_mask, enable_gqa=True)
            diff = float((out[:, :, :rows] - ref).abs().max())
            del ref, ref_mask
        del out
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
        base = _status_bytes("VmRSS")
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
            del out
        peak = _status_bytes("VmHWM")
    return {"mode": mode, "slots": s, "items": t, "forward_ms": round(1000 * statistics.median(times), 1),
            "peak_mib": round(max(0, peak - base) / 2**20, 1), "mask_mib": round(extra["mask_bytes"] / 2**20, 2),
            "blocks_computed": extra.get("blocks_computed"), "max_abs_diff": diff}  # fmt: skip


def bench_masks(lengths: list[int], repeats: int) -> dict:
    """:func:`mask_point` for dense and flex at every layout length, each in a fresh process."""
    from drafttrain.host import describe

    rows = []
    for n in lengths:
        for mode in ("dense", "flex"):
            code = f"import json; from scripts.bench_layout import mask_point; print(json.dumps(mask_point({mode!r}, {n}, {repeats})))"
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return {"shape": MASK_SHAPE, "repeats": repeats, "rows": rows, "host": describe()}


def masks_markdown(m: dict, command: str) -> str:
    from scripts.common import machine_line

    host = m["host"]
    sh = m["shape"]
    lines = [
        "## Dense vs flex masks (memory and forward time, CPU)",
        "",
        f"Host: {machine_line(host)}, fp32. One attention forward over the "
        f"group-wise layout (K = {sh['num_mask_tokens']}, every item an anchor: s = 5t slots) of a SmolLM2-135M-shaped "
        f"layer ({sh['heads']} query heads, {sh['kv_heads']} key/value heads, head dim {sh['head_dim']}), batch 1, mask "
        "building included; median of "
        f"{m['repeats']} calls. Dense = additive mask + SDPA; flex = block mask + compiled flex attention (the same "
        "rule, drafttrain/attention.py). **Forward only: flex attention has no backward on CPU** (PyTorch raises "
        "NotImplementedError), so training-step memory and time of flex are GPU figures, not measured here. "
        "Peak = rise of the process's resident-set high-water mark over the inputs (each point in its own process). "
        "On CPU the flex peak includes building the block mask eagerly, which evaluates the rule on the full "
        "[q, kv] grid (int64 intermediates); on CUDA drafttrain builds it compiled (`_compile=True`), "
        "which avoids that grid: not measurable here.",
        "",
        "| layout slots s | items t | dense mask (MiB) | dense peak (MiB) | dense fwd (ms) | flex mask (MiB) | flex peak (MiB) "
        "| flex fwd (ms) | blocks computed | flex vs dense max diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["slots"], r["mode"]): r for r in m["rows"]}
    for s in sorted({r["slots"] for r in m["rows"]}):
        d, f = by.get((s, "dense")), by.get((s, "flex"))
        if not d or not f:
            continue
        lines.append(f"| {s} | {d['items']} | {d['mask_mib']} | {d['peak_mib']} | {d['forward_ms']} | {f['mask_mib']} | "
                     f"{f['peak_mib']} | {f['forward_ms']} | {100 * f['blocks_computed']:.1f}% | {f['max_abs_diff']:.1e} |")  # fmt: skip
    lines += [
        "",
        "Dense mask bytes (`drafttrain.attention.dense_mask_bytes`): **b x q x kv x bytes(dtype)** for the [b, 1, q, kv] "
        "additive mask (4 bytes fp32, 2 bf16), plus the [b, q, kv] bool matrix it is built from (1 byte per entry) while "
        "it is built. Group-wise layout: q = kv = s = t + n K (n anchors; t (K + 1) with every item an anchor). "
        "EAGLE-3's training-time test, step k of K: q = t, kv = (k + 1) t; the last step at t = 4,096, K = 7 is "
        "4,096 x 28,672 x 4 B = 470 MB per sequence in fp32. DFlash: q = n B, kv = t + n B. The flex block mask "
        "holds a few int32 tensors of about b x (q / 128) x (kv / 128) entries.",
        "",
        "Reproduce:",
        "",
        "```bash",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)


@dataclass
class BenchLayoutConfig:
    """Schema of ``python -m scripts.bench_layout`` (key=value overrides, validated before any work)."""

    steps: int = 10  # timed steps per method (after one warm-up step)
    anchor_ratios: list[float] = field(default_factory=lambda: [0.25, 1.0])
    out: str = "docs/benchmarks/layout"
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of the training config, e.g. [target=tiny]
    part: str = "all"  # steps (layout vs K + 1 passes) | masks (dense vs flex masks) | all
    mask_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192])  # layout slots s
    mask_repeats: int = 3


def main(argv: list[str] | None = None) -> dict:
    import json

    from drafttrain.cliconfig import parse_cli
    from scripts.common import reproduce, write_report

    args = parse_cli(BenchLayoutConfig, argv)
    if args.part not in ("steps", "masks", "all"):
        raise SystemExit(f"part must be steps|masks|all, got {args.part!r}")
    old = Path(args.out).with_suffix(".json")
    result = json.loads(old.read_text()) if old.exists() else {}  # the other part's results stay
    command = reproduce("bench_layout", argv)
    if args.part in ("steps", "all"):
        result.update(bench(args.overrides, args.steps, args.anchor_ratios), command=command)
        for r in result["rows"]:
            print(json.dumps({k: v for k, v in r.items() if not k.endswith("steps_s")}))
    if args.part in ("masks", "all"):
        result["masks"] = {**bench_masks(args.mask_lengths, args.mask_repeats), "command": command}
    page = markdown(result, result["command"]) if "rows" in result else ""
    if "masks" in result:
        page += "\n" + masks_markdown(result["masks"], result["masks"]["command"])
    write_report(args.out, result, page)
    return result


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
