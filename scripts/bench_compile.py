"""Does ``torch.compile`` make the target's forward cheaper on this CPU? Eager vs compiled, side by side.

    python -m scripts.bench_compile

The goal is a k-token target forward close to a one-token one, "prepacked weights,
``torch.compile`` with freezing, or better". The engine uses prepacked weights (:mod:`drafttrain.target.fastlinear`);
this script measures the other option on the same weights, so the choice rests on numbers.

What is timed: the target's own forward (the Hugging Face model, ``batch`` rows (default 1), a ``StaticCache``
holding ``context`` committed tokens per row, k new tokens under the causal mask, logits at every input: the cost of a
plain step (k = 1) or of verifying a k - 1 chain) in seven variants, interleaved call by call, medians
of ``repeats`` calls:

- ``eager_plain``: eager, the linear layers as loaded (``F.linear``: MKL sgemm on the CPU wheel);
- ``eager_packed``: eager on oneDNN prepacked linears (``target.fast_linear=onednn``; the engine's default is
  drafttrain's kernel, docs/benchmarks/forward_cost.md);
- ``compiled_freezing``: ``torch.compile`` (inductor, static shapes) of the plain model with inductor's
  ``freezing`` on, the CPU inference mode in which inductor folds the weights as constants and prepacks
  the linear layers itself (for float32 on x86 with static shapes: MKL's packed sgemm, ``mkl._mkl_linear``);
- ``compiled_dynamic``: the same with dynamic shapes (``dynamic=True``): one graph for every input length,
  and with a symbolic row count inductor's freezing packs the linear layers for oneDNN instead
  (``mkldnn._linear_pointwise``, the op of ``eager_packed``), fused with the pointwise ops around them;
- ``compiled_packed``: ``torch.compile`` (no freezing) of the model on prepacked linears, so that inductor
  could only add pointwise fusion around our oneDNN calls;
- ``engine_packed``: the verifier's own forward (``SpecEngine.forward_trees`` at batch 1 on the prepacked
  target, the same prompt prefilled: the root token and a chain of k - 1 drafts, i.e. the same k tokens at
  the same positions), eager, with its ragged cache and tree mask;
- ``engine_compiled``: the same engine with ``compile_target=True`` (the backbone under ``torch.compile`` with
  freezing and dynamic shapes, one graph for every k and cache size; compiled before timing, the time
  recorded as ``warm_up_s``).

Each compiled variant's first call per shape is its compile time (a new input length or a new batch
size is a new graph under static shapes). A variant that fails to compile is reported with its error and
left out of the timing. Numerics: the largest |logit difference| from ``eager_plain`` and whether the
argmax agrees at every input.

The ``StaticCache`` variants are the best case for compilation: one plain cache and transformers' own sdpa
attention. The engine variants add what decoding really runs: a ragged cache, a per-step tree mask and
per-step shapes (input count and cache length change every step).

Writes ``<out>.json`` and ``<out>.md`` (a hand-written section between ``<!-- analysis -->`` markers is kept).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from drafttrain.config import TargetConfig

VARIANTS = ("eager_plain", "eager_packed", "compiled_freezing", "compiled_dynamic", "compiled_packed", "engine_packed",
            "engine_compiled")


@dataclass
class BenchCompileConfig:
    """Schema of ``python -m scripts.bench_compile`` (key=value overrides, validated before any work)."""

    tokens: list[int] = field(default_factory=lambda: [1, 3, 9])  # new tokens per forward (batch 1); each is a graph
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    context: int = 200  # committed tokens in the cache
    batch: int = 1  # rows per forward (the StaticCache variants; the engine variants run at batch 1 only)
    repeats: int = 10  # timed calls per point and variant (interleaved), after the first (compile / warm-up) call
    threads: int = 2  # torch intra-op threads
    seed: int = 0
    out: str = "docs/benchmarks/compile"
    target: TargetConfig = field(default_factory=TargetConfig)  # the target (fast_linear is set per variant)


class _Variant:
    """One way of running the forward: a model, its own prefilled ``StaticCache``, and the callable."""

    def __init__(self, name: str, model, context: int, prompt: torch.Tensor):
        from transformers import StaticCache

        self.name, self.model, self.context = name, model, context
        self.cache = StaticCache(config=model.config, max_cache_len=context + 128)
        with torch.no_grad():
            model(input_ids=prompt, cache=self.cache, use_cache=True)
        self.fn = model
        self.freezing = False
        if name.startswith("compiled"):
            # two compiled models x several shapes share transformers' wrapper code objects: dynamo's default of
            # 8 graphs per code object would fall back to eager (or recompile) mid-measurement
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(model, dynamic=name == "compiled_dynamic")
            self.freezing = name in ("compiled_freezing", "compiled_dynamic")
        self.error: str | None = None
        self.compile_s: dict[int, float] = {}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, k, v] of the k tokens per row ``ids`` [b, k] after the cached context (the same slots every
        call: the cache is cropped back to ``context`` tokens after each forward)."""
        import torch._inductor.config as inductor_config

        b, k = ids.shape
        pos = torch.arange(self.context, self.context + k)[None].expand(b, k)
        with torch.no_grad(), inductor_config.patch(freezing=self.freezing):
            logits = self.fn(input_ids=ids, cache=self.cache, position_ids=pos, use_cache=True).logits
        self.cache.crop(-k)  # back to the committed context: the next call overwrites the same slots
        return logits


class _EngineVariant:
    """The verifier's forward at batch 1: ``SpecEngine.forward_trees`` of the root + a chain, the prompt prefilled."""

    def __init__(self, name: str, target, prompt: torch.Tensor):
        from drafttrain.compose import Run
        from drafttrain.verify import PlainProposer

        self.name, self.error, self.compile_s = name, None, {}
        compiled = name == "engine_compiled"
        self.engine = Run(target).engine(PlainProposer(), batch_size=1, max_new_tokens=1_000_000, stop_token_ids=-1,
                                 initial_capacity=prompt.shape[1] + 160, compile_target=compiled)  # fmt: skip
        self.warm_up_s = self.engine.warm_up_compiled() if compiled else 0.0
        with torch.no_grad():
            self.engine.submit([prompt[0].tolist()])
            self.engine.admit()  # prefill: `context` committed tokens, like the StaticCache variants

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [1, k, v] of ids [1, k] at positions context .. context + k - 1 (ids[0, 0] as the root, the rest a
        chain of drafts); nothing is committed, so every call writes the same slots."""
        from drafttrain.verify import DraftTree

        seq = next(s for s in self.engine.rows if s is not None)
        seq.pending = int(ids[0, 0])
        with torch.no_grad():
            logits, _ = self.engine.forward_trees([DraftTree.chain(ids[0, 1:])])
        return logits[0][None]


def bench(cfg: BenchCompileConfig) -> dict:
    from drafttrain.compose import build_run

    unknown = sorted(set(cfg.variants) - set(VARIANTS))
    if unknown or not cfg.variants:
        raise ValueError(f"variants must be a non-empty subset of {list(VARIANTS)}, got {cfg.variants}")
    if not cfg.tokens or min(cfg.tokens) < 1 or max(cfg.tokens) > 128:
        raise ValueError(f"tokens must be in 1..128, got {cfg.tokens}")
    engines = [v for v in cfg.variants if v.startswith("engine")]
    if cfg.batch < 1 or (cfg.batch > 1 and engines):
        raise ValueError(f"batch must be >= 1, and 1 with the engine variants {engines} (compile_target is batch 1 "
                         f"only); got batch={cfg.batch}")  # fmt: skip
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    def target(name: str):  # each variant its own copy of the weights: two compiled wrappers of one module
        # would share dynamo's per-code-object cache entries (a graph compiled for one could serve the other)
        from drafttrain.target import fastlinear

        # oneDNN, what inductor's freezing packs with, so eager and compiled share their linears' library
        packed = "onednn" if fastlinear.onednn_available() else "auto"
        fl = packed if "packed" in name or name.startswith("engine") else "off"
        return build_run(cfg, fast_linear=fl).target

    names = ["eager_plain"] + [v for v in cfg.variants if v != "eager_plain"]  # the numerics' reference first
    targets = {v: target(v) for v in names}
    vocab = targets["eager_plain"].config.vocab_size
    g = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(3, vocab - 1, (cfg.batch, cfg.context), generator=g)
    variants = [_EngineVariant(v, targets[v], prompt) if v.startswith("engine") else
                _Variant(v, targets[v].model.eval(), cfg.context, prompt) for v in names]  # fmt: skip
    rows = []
    for k in cfg.tokens:
        ids = torch.randint(3, vocab - 1, (cfg.batch, k), generator=g)
        logits = {}
        for v in variants:  # first call: the compile (or warm-up) of this shape
            if v.error:
                continue
            t = time.perf_counter()
            try:
                logits[v.name] = v(ids).float()
            except Exception as e:  # noqa: BLE001 - a variant that cannot compile is a result, not a crash
                msg = " ".join(ln.strip() for ln in str(e).strip().splitlines()[:3] if ln.strip())
                v.error = f"{type(e).__name__}: {msg[:300]}"  # no dynamo reset: the other variants keep their graphs
                print(f"{v.name}: failed to compile: {v.error}", flush=True)
                continue
            v.compile_s[k] = time.perf_counter() - t
        ref = logits["eager_plain"]
        times = {v.name: [] for v in variants if not v.error}
        live = [v for v in variants if not v.error]
        for rep in range(cfg.repeats):
            for v in live if rep % 2 == 0 else live[::-1]:  # alternate who goes first
                t = time.perf_counter()
                v(ids)
                times[v.name].append(1000 * (time.perf_counter() - t))
        row = {"tokens": k}
        for v in variants:
            if v.name in times:
                row[v.name] = {"ms": statistics.median(times[v.name]), "first_call_s": v.compile_s.get(k),
                               "max_abs_logit_diff": float((logits[v.name] - ref).abs().max()),
                               "argmax_equal": bool((logits[v.name].argmax(-1) == ref.argmax(-1)).all())}  # fmt: skip
            else:
                row[v.name] = {"error": v.error}
        rows.append(row)
        print(f"tokens {k:3d}: " + "  ".join(f"{n} {r['ms']:7.1f} ms" for n, r in row.items() if isinstance(r, dict) and "ms" in r),
              flush=True)  # fmt: skip
    return {"rows": rows, "variants": names, "errors": {v.name: v.error for v in variants if v.error},
            "warm_up_s": {v.name: v.warm_up_s for v in variants if getattr(v, "warm_up_s", 0.0)},
            "target": cfg.target.__dict__}  # fmt: skip


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    m, rows, names = res["machine"], res["rows"], res["variants"]
    shared = m.get("loadavg_1min", 0) > 0.5 * (m.get("cpus") or 1)
    lines = [
        "# `torch.compile` vs eager for the target's forward (CPU)",
        "",
        f"Measured {res['date']} on {machine_line(m)}; 1-minute load average {m['loadavg_1min']} at the start"
        + (" and the machine was **shared with other jobs** (times inflated and noisy)." if shared else "."),
        "",
        f"Target: {res['target'].get('name')}; batch {res['config'].get('batch', 1)}, {res['config']['context']} "
        "committed tokens per row in a `StaticCache`, "
        "k new tokens, logits at every input (k = 1: a plain decoding step; k = 9: verifying 8 drafts). "
        "**eager_plain** = `F.linear` as loaded; **eager_packed** = oneDNN prepacked linears (`target.fast_linear=onednn`; "
        "the engine's default is drafttrain's kernel); **compiled_freezing** = `torch.compile` (inductor, static shapes) of the plain model "
        "with `freezing` on (MKL packed sgemm); **compiled_dynamic** = the same with dynamic shapes (one graph for every length; the linears then on oneDNN); **compiled_packed** = `torch.compile` of the prepacked model; "
        "**engine_packed** = the verifier's own forward (`SpecEngine.forward_trees`, root + a chain of k - 1 drafts, "
        "ragged cache, tree mask), eager on oneDNN; **engine_compiled** = the same with "
        "`compile_target=True`. Interleaved call by call, "
        f"median of {res['config']['repeats']} calls; \"first call\" = the compile of that shape (eager: warm-up).",
        "",
        "| tokens | " + " | ".join(f"{n} ms" for n in names) + " | first call s (" + ", ".join(names) + ") | max abs logit diff vs eager_plain | argmax equal |",
        "|---|" + "---|" * (len(names) + 3),
    ]  # fmt: skip
    for r in rows:
        ms, first, diff, eq = [], [], [], []
        for n in names:
            c = r[n]
            if "error" in c:
                ms.append("failed")
                first.append("-")
                continue
            ms.append(f"{c['ms']:.1f}")
            first.append(f"{c['first_call_s']:.1f}")
            if n != "eager_plain":
                diff.append(f"{n}: {c['max_abs_logit_diff']:.1e}")
                eq.append(f"{n}: {'yes' if c['argmax_equal'] else 'no'}")
        lines.append(f"| {r['tokens']} | " + " | ".join(ms) + f" | {', '.join(first)} | {'; '.join(diff)} | {'; '.join(eq)} |")
    by_k = {r["tokens"]: r for r in rows}
    if 1 in by_k and len(by_k) > 1:
        top = max(by_k)
        ratios = [f"{n} {by_k[top][n]['ms'] / by_k[1][n]['ms']:.2f}x" for n in names if "ms" in by_k[1][n] and "ms" in by_k[top][n]]
        lines += ["", f"{top}-token forward over the same variant's 1-token forward: " + ", ".join(ratios) + "."]
    for n, sec in res.get("warm_up_s", {}).items():
        lines += ["", f"**{n}** compiled its graphs before timing (`warm_up_compiled`): {sec:.0f} s."]
    for n, err in res["errors"].items():
        lines += ["", f"**{n} did not compile:** `{err}`"]
    lines += ["", "Reproduce (from the repository root; each compiled shape takes minutes on a 2-core machine):", "",
              "```bash", command, "```", "", analysis, ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchCompileConfig, bench, markdown, "bench_compile", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
