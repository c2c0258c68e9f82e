"""What one target forward costs by tokens per forward and by batch, plain ``F.linear`` vs prepacked, beside the roofline.

    python -m scripts.bench_forward_cost

A verification forward of the engine (:meth:`drafttrain.verify.engine.SpecEngine.forward_trees`: the
EMS-SD unpadded engine, ``context`` committed tokens per row, a chain of k - 1 drafts below each
row's root, logits at every input: exactly what a speculative step pays; k = 1 is a plain decoding
step) is timed with the target's linear layers as loaded (``F.linear``, MKL sgemm on the CPU wheel)
and on oneDNN prepacked weights (:mod:`drafttrain.fastlinear`, ``target.fast_linear``), the two
interleaved call by call on the same cache, medians of ``repeats`` calls. The same script measures
the machine's memory read bandwidth (a sum over a tensor far larger than the caches) and matmul
throughput, and reports the roofline of each forward: max(bytes read / bandwidth, FLOPs / throughput),
where bytes = every weight once + the K/V cache rows read, FLOPs = 2 x parameters x tokens.

Writes ``<out>.json`` and ``<out>.md`` (a hand-written section between ``<!-- analysis -->`` markers
is kept). Issue 16's goal: a 9-token forward <= 1.3x a 1-token forward.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from drafttrain.config import TargetConfig


@dataclass
class BenchForwardCostConfig:
    """Schema of ``python -m scripts.bench_forward_cost`` (key=value overrides, validated before any work)."""

    tokens: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 9, 17, 33, 65])  # inputs per row (batch 1)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    batch_tokens: list[int] = field(default_factory=lambda: [1, 9])  # inputs per row measured at every batch size
    context: int = 200  # committed tokens per row in the cache
    repeats: int = 15  # timed calls per point and variant (interleaved), after one warm-up each
    threads: int = 2  # torch intra-op threads
    bandwidth_mb: int = 1024  # size of the bandwidth probe tensor
    seed: int = 0
    out: str = "docs/benchmarks/forward_cost"
    target: TargetConfig = field(default_factory=TargetConfig)  # the target (fast_linear is toggled here)


# ==================================================================================================
# The machine: memory bandwidth and matmul throughput
# ==================================================================================================


def memory_bandwidth_gbs(mb: int, repeats: int = 7) -> float:
    """Read bandwidth in GB/s: median time of ``x.sum()`` over an ``mb`` MB float32 tensor (every byte read once)."""
    x = torch.ones(mb * (1 << 20) // 4)
    x.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Dense fp32 matmul throughput in GFLOP/s (median of ``repeats`` [n, n] x [n, n] products)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(ts) / 1e9


# ==================================================================================================
# Two views of one model: plain and prepacked linears, same parameters
# ==================================================================================================


class LinearSwitch:
    """Every linear layer of ``model`` in two versions sharing parameters (``nn.Linear`` and
    :class:`~drafttrain.fastlinear.PackedLinear`, packed once); :meth:`use` puts one set in place."""

    def __init__(self, model: torch.nn.Module):
        from drafttrain.fastlinear import PackedLinear

        self.sites = []  # (parent module, attribute name, plain, packed)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    plain = child.to_linear() if isinstance(child, PackedLinear) else child
                    packed = child if isinstance(child, PackedLinear) else PackedLinear.from_linear(child)
                    packed.packed_weight()
                    self.sites.append((parent, name, plain, packed))

    def use(self, packed: bool) -> None:
        for parent, name, plain, pk in self.sites:
            setattr(parent, name, pk if packed else plain)


# ==================================================================================================
# The measurement
# ==================================================================================================


def _engine(target, batch: int, context: int, seed: int):
    """A plain engine with ``batch`` rows of ``context`` committed (random) tokens, prefilled."""
    from drafttrain.verify import PlainProposer, SpecEngine

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.config.vocab_size - 1, (context,), generator=g).tolist() for _ in range(batch)]
    eng = SpecEngine(target, PlainProposer(), batch_size=batch, max_new_tokens=10_000, stop_token_ids=-1,
                     initial_capacity=context + 80)  # fmt: skip
    eng.submit(prompts)
    eng.admit()
    return eng


def forward_ms(eng, k: int, switch: LinearSwitch, repeats: int, seed: int) -> dict[str, float]:
    """Median ms of one verification forward of a k-token chain per row, plain and packed, interleaved."""
    from drafttrain.verify import DraftTree

    g = torch.Generator().manual_seed(seed)
    rows = sum(s is not None for s in eng.rows)
    trees = [DraftTree.chain(torch.randint(3, 40000, (k - 1,), generator=g)) for _ in range(rows)]
    times = {"plain": [], "packed": []}
    order = ["plain", "packed"]
    for rep in range(repeats + 1):
        for v in order if rep % 2 == 0 else order[::-1]:  # alternate who goes first
            switch.use(v == "packed")
            t = time.perf_counter()
            eng.forward_trees(trees)  # writes K/V after the committed tokens, commits nothing
            if rep:  # the first round warms up
                times[v].append(1000 * (time.perf_counter() - t))
    return {v: statistics.median(ts) for v, ts in times.items()}


def bench(cfg: BenchForwardCostConfig) -> dict:
    from drafttrain.target import load_target

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    bw = memory_bandwidth_gbs(cfg.bandwidth_mb)
    gflops = matmul_gflops()
    tcfg = TargetConfig(**{**cfg.target.__dict__, "fast_linear": "off"})
    target = load_target(tcfg)
    switch = LinearSwitch(target.model)
    mc = target.config
    n_params = sum(p.numel() for p in target.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    linear_params = sum(pl.weight.numel() for _, _, pl, _ in switch.sites)
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv_bytes_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * 4

    def roofline(batch: int, k: int) -> dict:
        read = weight_bytes + batch * (cfg.context + k) * kv_bytes_per_token
        flops = 2 * linear_params * batch * k
        return {"memory_ms": 1000 * read / (bw * 1e9), "compute_ms": 1000 * flops / (gflops * 1e9)}

    points = [(1, k) for k in cfg.tokens] + [(b, k) for b in cfg.batch_sizes for k in cfg.batch_tokens if b != 1]
    rows, engines = [], {}
    for batch, k in points:
        if batch not in engines:
            switch.use(False)
            engines = {batch: _engine(target, batch, cfg.context, cfg.seed)}  # one at a time: free the last cache
        ms = forward_ms(engines[batch], k, switch, cfg.repeats, cfg.seed + k)
        rf = roofline(batch, k)
        rows.append({"batch": batch, "tokens": k, "plain_ms": ms["plain"], "packed_ms": ms["packed"], **rf,
                     "roofline_ms": max(rf["memory_ms"], rf["compute_ms"])})  # fmt: skip
        print(f"batch {batch:2d} tokens {k:2d}: plain {ms['plain']:7.1f} ms  packed {ms['packed']:7.1f} ms  "
              f"roofline {rows[-1]['roofline_ms']:6.1f} ms", flush=True)  # fmt: skip
    switch.use(False)
    base = {v: next(r[f"{v}_ms"] for r in rows if r["batch"] == 1 and r["tokens"] == 1) for v in ("plain", "packed")}
    for r in rows:
        for v in ("plain", "packed"):  # cost relative to the same variant's 1-token forward at batch 1
            r[f"{v}_vs_1token"] = r[f"{v}_ms"] / base[v]
        r["packed_vs_plain_1token"] = r["packed_ms"] / base["plain"]
    return {"rows": rows, "bandwidth_gbs": bw, "matmul_gflops": gflops, "weight_bytes": weight_bytes,
            "parameters": n_params, "linear_layers": len(switch.sites), "kv_bytes_per_token": kv_bytes_per_token,
            "config": {k: v for k, v in cfg.__dict__.items() if k != "target"}, "target": cfg.target.__dict__}  # fmt: skip


# ==================================================================================================
# The page
# ==================================================================================================


def markdown(res: dict, command: str, analysis: str) -> str:
    m = res["machine"]
    rows = res["rows"]
    b1 = {r["tokens"]: r for r in rows if r["batch"] == 1}
    nine = b1.get(9)
    shared = m.get("loadavg_1min", 0) > 0.5 * (m.get("cpus") or 1)
    lines = [
        "# Cost of one target forward by tokens per forward: `F.linear` vs oneDNN prepacked weights",
        "",
        f"Measured {res['date']} on {m['processor']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, torch "
        f"{m['torch']}; 1-minute load average {m['loadavg_1min']} at the start"
        + (" and the machine was **shared with other jobs** while this ran: the absolute times are inflated and "
           "noisy (medians of interleaved calls keep the comparison fair; re-run on an idle machine for the real numbers)."
           if shared else "."),
        "",
        f"Target: {res['target'].get('name')} ({res['parameters'] / 1e6:.1f} M parameters, {res['weight_bytes'] / 1e6:.0f} MB "
        f"fp32, {res['linear_layers']} linear layers incl. the LM head), {res['config']['context']} committed tokens per "
        f"row. One forward = the engine's verification forward (`SpecEngine.forward_trees`: root + a chain of "
        f"k - 1 drafts per row, logits at every input; k = 1 is a plain decoding step). **plain** = the "
        f"linear layers as loaded (`F.linear`, `target.fast_linear=off`), **packed** = oneDNN prepacked weights "
        f"(`drafttrain/fastlinear.py`, `target.fast_linear=auto`, the default on CPU); interleaved call by call, "
        f"median of {res['config']['repeats']} calls each.",
        "",
        f"Roofline: memory read bandwidth **{res['bandwidth_gbs']:.1f} GB/s** (sum over a "
        f"{res['config']['bandwidth_mb']} MB tensor) and fp32 matmul throughput **{res['matmul_gflops']:.0f} GFLOP/s** "
        f"(1024^3 matmul), both measured by this run; roofline = max(weights + K/V read / bandwidth, "
        f"2 x linear parameters x tokens / throughput).",
        "",
    ]
    if nine:
        lines += [f"**Goal (issue 16): a 9-token forward <= 1.3x a 1-token forward.** Packed: "
                  f"**{nine['packed_vs_1token']:.2f}x** ({nine['packed_ms']:.1f} vs {b1[1]['packed_ms']:.1f} ms); "
                  f"plain: {nine['plain_vs_1token']:.2f}x ({nine['plain_ms']:.1f} vs {b1[1]['plain_ms']:.1f} ms); "
                  f"the packed 9-token forward costs {nine['packed_vs_plain_1token']:.2f}x a plain 1-token one.", ""]
    lines += ["| batch | tokens per row | plain ms | packed ms | packed / plain | plain vs 1 token | packed vs 1 token | roofline ms (memory, compute) |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} | "
                     f"{r['packed_ms'] / r['plain_ms']:.2f} | {r['plain_vs_1token']:.2f}x | {r['packed_vs_1token']:.2f}x | "
                     f"{r['roofline_ms']:.1f} ({r['memory_ms']:.1f}, {r['compute_ms']:.1f}) |")  # fmt: skip
    lines += ["", "\"vs 1 token\": the row's time over the same variant's batch-1, 1-token forward.", "",
              "Reproduce (from the repository root; a few minutes on an idle 2-core machine):", "", "```bash", command, "```",
              "", analysis, ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchForwardCostConfig, bench, markdown, "bench_forward_cost", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
