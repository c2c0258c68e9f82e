"""One-query (decode) attention: torch's sdpa as transformers calls it vs drafttrain's kernel, per call and per forward.

    python -m scripts.bench_decode_attention

Two measurements on the real target's shapes (SmolLM2-135M: 9 query heads, 3 key/value heads, head dim
64, 30 layers), both backends interleaved call by call, medians of ``repeats`` calls:

- **per call**: :func:`drafttrain.verify.cache.ragged_attention`, the engine's attention, on one query per
  sequence against ``context`` cached keys per row (views into a larger cache, each row its own
  committed-slot mask), under :func:`drafttrain.target.fastattention.use` ``sdpa`` (transformers' sdpa call:
  grouped-query heads packed as [b, h_kv, group, hd] queries) and ``kernel``; then ``tree_points``
  (batch, queries per row: a verification step's root + draft nodes, causal among themselves), where
  ``sdpa`` is what the engine ran there before: its grouped-query matmuls (``grouped_attention``) for a
  batch, sdpa with ``enable_gqa`` for one sequence;
- **per forward**: the engine's forward (:meth:`~drafttrain.verify.engine.SpecEngine.forward_trees`, logits
  included) at each batch size with ``forward_tokens`` inputs per row (1: a plain decoding step; k: root +
  a chain of k - 1 drafts), with each backend; the output logits are compared (max |diff|, argmax equal).

The generator's end-to-end figure is ``python -m scripts.bench_generate phase=backends
backends=[engine:sdpa,engine]`` (docs/benchmarks/generate_data.md).

Writes ``<out>.json`` and ``<out>.md`` (a hand-written section between ``<!-- analysis -->`` markers is kept).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from drafttrain.config import TargetConfig

VARIANTS = ("sdpa", "kernel")


@dataclass
class BenchDecodeAttentionConfig:
    """Schema of ``python -m scripts.bench_decode_attention`` (key=value overrides, validated before any work)."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 32, 64])
    contexts: list[int] = field(default_factory=lambda: [128, 300, 600])  # cached keys per row (per-call table)
    tree_points: list[list[int]] = field(default_factory=lambda: [[1, 2], [1, 5], [16, 2]])  # (batch, queries per row)
    forward_batch_sizes: list[int] = field(default_factory=lambda: [1, 16, 64])
    forward_tokens: list[int] = field(default_factory=lambda: [1, 5])  # inputs per row per forward
    forward_context: int = 300  # committed tokens per row for the per-forward table
    repeats: int = 30  # timed calls per point and backend (interleaved), after one warm-up each
    forward_repeats: int = 15
    threads: int = 2
    seed: int = 0
    out: str = "docs/benchmarks/decode_attention"
    target: TargetConfig = field(default_factory=TargetConfig)


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each callable, called in turn (alternating who goes first), after one warm-up round."""
    order = list(fns)
    times = {k: [] for k in order}
    for rep in range(repeats + 1):
        for k in order if rep % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            fns[k]()
            if rep:
                times[k].append(1000 * (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in times.items()}


def per_call(attn_module, cfg: BenchDecodeAttentionConfig, h: int, h_kv: int, hd: int) -> list[dict]:
    from drafttrain.target import fastattention
    from drafttrain.verify.cache import grouped_attention, ragged_attention

    g = torch.Generator().manual_seed(cfg.seed)
    rows = []
    points = [(b, t, 1) for b in cfg.batch_sizes for t in cfg.contexts]
    points += [(b, cfg.forward_context, nq) for b, nq in cfg.tree_points]
    for b, t, nq in points:
        q = torch.randn(b, h, nq, hd, generator=g)
        kb = torch.randn(b, h_kv, t + 64, hd, generator=g)  # the cache has room beyond the read window
        vb = torch.randn(b, h_kv, t + 64, hd, generator=g)
        k, v = kb[:, :, :t], vb[:, :, :t]
        mask = torch.zeros(b, 1, 1, t)
        for i in range(b):  # ragged rows: row i has committed t - 2i slots
            mask[i, ..., t - min(2 * i, t - 1) :] = torch.finfo(torch.float32).min
        if nq > 1:  # the last nq slots are this step's inputs: causal among themselves (a chain)
            mask = mask.repeat(1, 1, nq, 1)
            mask[:, 0, :, t - nq :] = torch.full((nq, nq), torch.finfo(torch.float32).min).triu(1)

        def call(name):
            def f():
                if name == "sdpa" and nq > 1 and b > 1:  # the engine's batched verification attention before the kernel
                    return grouped_attention(q, k, v, mask, hd**-0.5)
                if nq > 1 and b == 1:  # one sequence's tree: sdpa with enable_gqa (the engine's choice) vs the kernel itself
                    if name == "sdpa":
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5,
                                                                                enable_gqa=h != h_kv)  # fmt: skip
                    return fastattention.decode_attention(q, k, v, mask, hd**-0.5)
                with fastattention.use(name):
                    return ragged_attention(attn_module, q, k, v, mask, scaling=hd**-0.5)[0].transpose(1, 2)

            return f

        ms = _interleaved({n: call(n) for n in VARIANTS}, cfg.repeats)
        diff = (call("sdpa")() - call("kernel")()).abs().max().item()
        kv_mb = 2 * b * h_kv * t * hd * 4 / 1e6
        rows.append({"batch": b, "context": t, "queries": nq, "kv_mb": round(kv_mb, 2), **{f"{n}_ms": round(ms[n], 4) for n in VARIANTS},
                     "speedup": round(ms["sdpa"] / ms["kernel"], 2), "max_abs_diff": diff})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def per_forward(target, cfg: BenchDecodeAttentionConfig) -> list[dict]:
    from drafttrain.target import fastattention
    from drafttrain.verify import DraftTree
    from scripts.bench_forward_cost import prefilled_engine

    rows = []
    g = torch.Generator().manual_seed(cfg.seed)
    for b, k in [(b, k) for b in cfg.forward_batch_sizes for k in cfg.forward_tokens]:
        eng = prefilled_engine(target, b, cfg.forward_context, cfg.seed)
        trees = [DraftTree.chain(torch.randint(3, 40000, (k - 1,), generator=g)) for _ in range(b)]
        outs = {}

        def step(name):
            def f():
                with fastattention.use(name):
                    outs[name] = eng.forward_trees(trees)[0]  # writes K/V after the committed tokens, commits nothing

            return f

        ms = _interleaved({n: step(n) for n in VARIANTS}, cfg.forward_repeats)
        ref, new = torch.cat(outs["sdpa"]), torch.cat(outs["kernel"])
        rows.append({"batch": b, "tokens": k, "context": cfg.forward_context, **{f"{n}_ms": round(ms[n], 2) for n in VARIANTS},
                     "speedup": round(ms["sdpa"] / ms["kernel"], 3), "logits_max_abs_diff": (ref - new).abs().max().item(),
                     "argmax_equal": bool(torch.equal(ref.argmax(-1), new.argmax(-1)))})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def bench(cfg: BenchDecodeAttentionConfig) -> dict:
    from drafttrain.target import fastattention
    from drafttrain.cliconfig import ConfigError
    from drafttrain.compose import build_run

    if any(nq > fastattention.MAX_QUERIES and b > 1 for b, nq in cfg.tree_points):  # before any model loads
        raise ConfigError(f"tree_points above fastattention.MAX_QUERIES={fastattention.MAX_QUERIES} queries at batch > 1 "
                          "would run the same grouped matmuls under both names")
    if not fastattention.available():
        raise ConfigError(f"the decode attention kernel is unavailable here: {fastattention.unavailable_reason()}")
    torch.set_num_threads(cfg.threads)
    target = build_run(cfg).target
    c = target.config
    h, h_kv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // h
    attn = target.model.model.layers[0].self_attn
    return {"target": {"name": cfg.target.name, "heads": h, "kv_heads": h_kv, "head_dim": hd, "layers": c.num_hidden_layers},
            "per_call": per_call(attn, cfg, h, h_kv, hd), "per_forward": per_forward(target, cfg)}  # fmt: skip


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    m, t = res["machine"], res["target"]
    lines = [
        "# Decode attention (a few queries per sequence): sdpa as transformers calls it vs drafttrain's kernel",
        "",
        f"Measured {res['date']} on {machine_line(m)}; 1-minute load average {m['loadavg_1min']} at the start.",
        "",
        f"Shapes of {t['name']}: {t['heads']} query heads, {t['kv_heads']} key/value heads, head dim {t['head_dim']}, "
        f"{t['layers']} layers, float32. **sdpa** = `torch.nn.functional.scaled_dot_product_attention` as transformers "
        "calls it for grouped-query heads with a mask (queries packed as [b, h_kv, group, hd]), what the engine ran "
        "until now; **kernel** = `drafttrain/target/csrc/decode_attention.cpp` (`drafttrain.target.fastattention`: each key/value "
        "head read once for its group). Both through the engine's own attention function "
        "(`drafttrain.verify.cache.ragged_attention`), interleaved call by call, medians.",
        "",
        "## Per call (one layer)",
        "",
        "Queries per row > 1: a verification step (root + a chain of drafts); there **sdpa** is what the engine "
        "runs there: its grouped-query matmuls (`grouped_attention`) at batch > 1 above "
        "`fastattention.MAX_QUERIES` queries per row (the kernel up to it), sdpa with `enable_gqa` on the one "
        "sequence at batch 1 (the kernel called directly there, for comparison: the engine keeps sdpa).",
        "",
        "| batch | cached keys per row | queries per row | K/V read (MB) | sdpa ms | kernel ms | speedup | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["per_call"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r.get('queries', 1)} | {r['kv_mb']} | {r['sdpa_ms']:.3f} | {r['kernel_ms']:.3f} | "
                     f"**{r['speedup']:.2f}x** | {r['max_abs_diff']:.1e} |")  # fmt: skip
    lines += ["", f"## Per forward: the engine's forward ({t['layers']} layers, LM head included; 1 input per row = a plain "
              "decoding step, k = root + a chain of k - 1 drafts)", "",
              "| batch | inputs per row | committed tokens per row | sdpa ms | kernel ms | speedup | logits max abs diff | argmax equal |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["per_forward"]:
        lines.append(f"| {r['batch']} | {r.get('tokens', 1)} | {r['context']} | {r['sdpa_ms']:.1f} | {r['kernel_ms']:.1f} | **{r['speedup']:.2f}x** | "
                     f"{r['logits_max_abs_diff']:.1e} | {r['argmax_equal']} |")  # fmt: skip
    lines += ["", "Reproduce (from the repository root; a few minutes on an idle 2-core machine):", "", "```bash", command,
              "```", "", analysis, ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchDecodeAttentionConfig, bench, markdown, "bench_decode_attention", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
