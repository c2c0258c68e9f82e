"""What one target forward costs by tokens per forward and by batch, plain ``F.linear`` vs prepacked, beside the roofline.

    python -m scripts.bench_forward_cost

A verification forward of the engine (:meth:`drafttrain.verify.engine.SpecEngine.forward_trees`: the
EMS-SD unpadded engine, ``context`` committed tokens per row, a chain of k - 1 drafts below each
row's root, logits at every input: exactly what a speculative step pays; k = 1 is a plain decoding
step) is timed with the target's linear layers as loaded (``plain``: ``F.linear``, MKL sgemm on the
CPU wheel) and on each prepacked backend of :mod:`drafttrain.target.fastlinear` available here (``onednn``:
oneDNN's prepacked inner product; ``kernel``: drafttrain's kernel, the build this machine gets; on an
AVX-512 machine also ``kernel_avx2``: the AVX2 build, to compare the two), all interleaved call by call
on the same cache, medians of ``repeats`` calls. ``packed`` in the results is the default backend
(``target.fast_linear=auto``). The same script measures
the machine's memory read bandwidth (a sum over a tensor far larger than the caches) and matmul
throughput, and reports the roofline of each forward: max(bytes read / bandwidth, FLOPs / throughput),
where bytes = every weight once + the K/V cache rows read, FLOPs = 2 x parameters x tokens.

Writes ``<out>.json`` and ``<out>.md`` (a hand-written section between ``<!-- analysis -->`` markers
is kept). The goal: a 9-token forward <= 1.3x a 1-token forward.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

import torch

from drafttrain.config import TargetConfig


@dataclass
class BenchForwardCostConfig:
    """Schema of ``python -m scripts.bench_forward_cost`` (key=value overrides, validated before any work)."""

    tokens: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 9, 17, 33, 65])  # inputs per row (batch 1)
    variants: list[str] = field(default_factory=lambda: ["plain", "onednn", "kernel", "kernel_avx2"])  # those available are timed
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


def _avx2_kernel_available() -> bool:
    """The ``kernel_avx2`` variant: this machine's kernel build is the AVX-512 one (the AVX2 build then runs
    here too, and the two can be compared)."""
    from drafttrain.target import fastlinear

    return fastlinear.kernel_isa() == "avx512" and fastlinear.kernel_available()


def _kernel_isa() -> str | None:
    from drafttrain.target import fastlinear

    return fastlinear.kernel_isa() if fastlinear.kernel_available() else None


@functools.cache
def _avx2_packed_linear_class():
    from drafttrain.target import fastlinear

    class Avx2PackedLinear(fastlinear.PackedLinear):
        """A kernel-backed ``PackedLinear`` on the AVX2 build whatever this machine's default build."""

        def _kernel(self):
            return fastlinear._kernel_build("avx2")

    return Avx2PackedLinear


def _avx2_packed(plain: torch.nn.Linear):
    """``plain`` on the AVX2 build of the kernel (on an AVX-512 machine, whose default is the AVX-512 build)."""
    from drafttrain.target import fastlinear

    layer = fastlinear.PackedLinear.from_linear(plain, "kernel")
    layer.__class__ = _avx2_packed_linear_class()
    return layer


class LinearSwitch:
    """Every linear layer of ``model`` in several versions sharing parameters: ``plain`` (``nn.Linear``)
    and one :class:`~drafttrain.target.fastlinear.PackedLinear` per backend in ``backends`` (default: every
    backend available here; ``kernel_avx2``: the kernel's AVX2 build on an AVX-512 machine), packed
    once; :meth:`use` puts one set in place."""

    def __init__(self, model: torch.nn.Module, backends: list[str] | None = None):
        from drafttrain.target import fastlinear
        from drafttrain.target.fastlinear import PackedLinear

        ok = lambda b: _avx2_kernel_available() if b == "kernel_avx2" else fastlinear.available(b)  # noqa: E731
        self.backends = [b for b in (backends or fastlinear.BACKENDS) if ok(b)]
        best = fastlinear.best_backend()
        self.default = best if best in self.backends else next(iter(self.backends), None)
        self.sites = []  # (parent module, attribute name, {variant: layer})
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    plain = child.to_linear() if isinstance(child, PackedLinear) else child
                    versions = {"plain": plain}
                    for b in self.backends:
                        versions[b] = _avx2_packed(plain) if b == "kernel_avx2" else PackedLinear.from_linear(plain, b)
                        versions[b].packed_weight()
                    self.sites.append((parent, name, versions))

    @property
    def variants(self) -> list[str]:
        return ["plain", *self.backends]

    def use(self, variant: bool | str) -> None:
        """``variant``: ``plain`` / a backend name; True = the default backend, False = plain."""
        if variant is True:
            variant = self.default or "plain"
        elif variant is False:
            variant = "plain"
        for parent, name, versions in self.sites:
            setattr(parent, name, versions[variant])


# ==================================================================================================
# The measurement
# ==================================================================================================


def prefilled_engine(target, batch: int, context: int, seed: int):
    """A plain engine with ``batch`` rows of ``context`` committed (random) tokens, prefilled."""
    from drafttrain.compose import Run
    from drafttrain.verify import PlainProposer

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.config.vocab_size - 1, (context,), generator=g).tolist() for _ in range(batch)]
    eng = Run(target).engine(PlainProposer(), batch_size=batch, max_new_tokens=10_000, stop_token_ids=-1,
                     initial_capacity=context + 80)  # fmt: skip
    eng.submit(prompts)
    eng.admit()
    return eng


def forward_ms(eng, k: int, switch: LinearSwitch, repeats: int, seed: int, variants: list[str] | None = None) -> dict[str, float]:
    """Median ms of one verification forward of a k-token chain per row, for each variant, interleaved."""
    from drafttrain.verify import DraftTree

    g = torch.Generator().manual_seed(seed)
    rows = sum(s is not None for s in eng.rows)
    trees = [DraftTree.chain(torch.randint(3, 40000, (k - 1,), generator=g)) for _ in range(rows)]
    order = list(variants or switch.variants)
    times = {v: [] for v in order}
    for rep in range(repeats + 1):
        for v in order if rep % 2 == 0 else order[::-1]:  # alternate who goes first
            switch.use(v)
            t = time.perf_counter()
            eng.forward_trees(trees)  # writes K/V after the committed tokens, commits nothing
            if rep:  # the first round warms up
                times[v].append(1000 * (time.perf_counter() - t))
    return {v: statistics.median(ts) for v, ts in times.items()}


def bench(cfg: BenchForwardCostConfig) -> dict:
    from drafttrain.compose import build_run

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    bw = memory_bandwidth_gbs(cfg.bandwidth_mb)
    gflops = matmul_gflops()
    target = build_run(cfg, fast_linear="off").target
    unknown = set(cfg.variants) - {"plain", "onednn", "kernel", "kernel_avx2"}
    if unknown:
        raise ValueError(f"variants: unknown {sorted(unknown)}; choose from plain, onednn, kernel, kernel_avx2")
    switch = LinearSwitch(target.model, [v for v in cfg.variants if v != "plain"])
    variants = [v for v in switch.variants if v in cfg.variants]
    mc = target.config
    n_params = sum(p.numel() for p in target.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    linear_params = sum(vs["plain"].weight.numel() for _, _, vs in switch.sites)
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
            engines = {batch: prefilled_engine(target, batch, cfg.context, cfg.seed)}  # one at a time: free the last cache
        ms = forward_ms(engines[batch], k, switch, cfg.repeats, cfg.seed + k, variants)
        rf = roofline(batch, k)
        packed = switch.default if switch.default in ms else next((v for v in variants if v != "plain"), "plain")
        rows.append({"batch": batch, "tokens": k, **{f"{v}_ms": t for v, t in ms.items()}, "packed_ms": ms[packed],
                     **rf, "roofline_ms": max(rf["memory_ms"], rf["compute_ms"])})  # fmt: skip
        print(f"batch {batch:2d} tokens {k:2d}: " + "  ".join(f"{v} {t:7.1f} ms" for v, t in ms.items())
              + f"  roofline {rows[-1]['roofline_ms']:6.1f} ms", flush=True)  # fmt: skip
    switch.use(False)
    timed = [*variants, "packed"]
    base = {v: next(r[f"{v}_ms"] for r in rows if r["batch"] == 1 and r["tokens"] == 1) for v in timed}
    for r in rows:
        for v in timed:  # cost relative to the same variant's 1-token forward at batch 1
            r[f"{v}_vs_1token"] = r[f"{v}_ms"] / base[v]
            r[f"{v}_vs_plain_1token"] = r[f"{v}_ms"] / base.get("plain", base[v])
    return {"rows": rows, "variants": variants, "packed_variant": packed, "kernel_isa": _kernel_isa(), "bandwidth_gbs": bw, "matmul_gflops": gflops, "weight_bytes": weight_bytes,
            "parameters": n_params, "linear_layers": len(switch.sites), "kv_bytes_per_token": kv_bytes_per_token,
            "config": {k: v for k, v in cfg.__dict__.items() if k != "target"}, "target": cfg.target.__dict__}  # fmt: skip


# ==================================================================================================
# The page
# ==================================================================================================


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    m = res["machine"]
    rows = res["rows"]
    b1 = {r["tokens"]: r for r in rows if r["batch"] == 1}
    nine = b1.get(9)
    shared = m.get("loadavg_1min", 0) > 0.5 * (m.get("cpus") or 1)
    lines = [
        "# Cost of one target forward by tokens per forward: `F.linear` vs prepacked weights (oneDNN, drafttrain's kernel)",
        "",
        f"Measured {res['date']} on {machine_line(m)}; 1-minute load average {m['loadavg_1min']} at the start"
        + (" and the machine was **shared with other jobs** while this ran: the absolute times are inflated and "
           "noisy (medians of interleaved calls keep the comparison fair; re-run on an idle machine for the real numbers)."
           if shared else "."),
        "",
        f"Target: {res['target'].get('name')} ({res['parameters'] / 1e6:.1f} M parameters, {res['weight_bytes'] / 1e6:.0f} MB "
        f"fp32, {res['linear_layers']} linear layers incl. the LM head), {res['config']['context']} committed tokens per "
        f"row. One forward = the engine's verification forward (`SpecEngine.forward_trees`: root + a chain of "
        f"k - 1 drafts per row, logits at every input; k = 1 is a plain decoding step). **plain** = the "
        f"linear layers as loaded (`F.linear`, `target.fast_linear=off`); **onednn** = oneDNN prepacked weights "
        f"(`target.fast_linear=onednn`); **kernel** = drafttrain's kernel (`drafttrain/target/csrc/small_m_linear.cpp`, "
        f"`target.fast_linear=kernel`), its {str(res.get('kernel_isa') or 'avx2').upper()} build (the one this machine gets)"
        + ("; **kernel_avx2** = the same kernel's AVX2 build (16 registers, smaller tiles), for comparison"
           if "kernel_avx2" in (res.get("variants") or []) else "")
        + f"; the default (`auto`) here is **{res.get('packed_variant', 'packed')}**. "
        f"Interleaved call by call, median of {res['config']['repeats']} calls each.",
        "",
        f"Roofline: memory read bandwidth **{res['bandwidth_gbs']:.1f} GB/s** (sum over a "
        f"{res['config']['bandwidth_mb']} MB tensor) and fp32 matmul throughput **{res['matmul_gflops']:.0f} GFLOP/s** "
        f"(1024^3 matmul), both measured by this run; roofline = max(weights + K/V read / bandwidth, "
        f"2 x linear parameters x tokens / throughput).",
        "",
    ]
    variants = res.get("variants") or ["plain", "packed"]
    if nine:
        parts = [f"{v}: **{nine[f'{v}_vs_1token']:.2f}x** ({nine[f'{v}_ms']:.1f} vs {b1[1][f'{v}_ms']:.1f} ms)" for v in variants]
        lines += ["**Goal: a 9-token forward <= 1.3x a 1-token forward.** " + "; ".join(parts) + ". "
                  + "Against plain decoding's 1-token forward: "
                  + ", ".join(f"{v} {nine[f'{v}_vs_plain_1token']:.2f}x" for v in variants if v != "plain") + ".", ""]
    lines += ["| batch | tokens per row | " + " | ".join(f"{v} ms" for v in variants) + " | "
              + " | ".join(f"{v} vs 1 token" for v in variants) + " | roofline ms (memory, compute) |",
              "|---|---|" + "---|" * (2 * len(variants)) + "---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['tokens']} | " + " | ".join(f"{r[f'{v}_ms']:.1f}" for v in variants) + " | "
                     + " | ".join(f"{r[f'{v}_vs_1token']:.2f}x" for v in variants)
                     + f" | {r['roofline_ms']:.1f} ({r['memory_ms']:.1f}, {r['compute_ms']:.1f}) |")  # fmt: skip
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
