"""The one evaluation driver: a plan goes in, one record per decoding run comes out.

Every evaluation of the toolkit runs here: ``python -m scripts.evaluate`` (:mod:`drafttrain.eval.harness`: the
methods of the registry at each batch size and engine mode), the training run's own evaluation and
``scripts.evaluate preset=training`` (:mod:`drafttrain.eval.in_training`: the draft tree, the chain, the drafter
alone and the online planner in lock-step, plus the batch-1 latency prompts), and the benchmark scripts. An
:class:`EvalPlan` says what to decode (prompts, batch sizes, the speculative variants, engine modes, how the runs
of a batch size interleave); :func:`run_plan` decodes it through engines built by :meth:`drafttrain.compose.Run.engine`
and returns records (:func:`run_record`); the callers derive their figures (``results.json``, the ``eval/*`` keys)
from the records and nothing else.

At each batch size plain decoding (:class:`~drafttrain.verify.proposers.PlainProposer`) runs the same prompts in
the same engine and is the baseline: a record's ``speedup`` is its tokens/s over plain's (prompt forwards
included), ``speedup_decode`` the same ratio over the decoding steps alone. τ = tokens emitted by verification
steps / sequence-steps, the prefill excluded (docs/design.md, "Definitions"). Under greedy decoding every
lossless run is compared token for token with the plain output; where one differs it is compared again with a
one-sequence plain decoding of that prompt (:func:`plain_greedy`: batched and single matmuls may round
differently at a near tie), and only a difference from that counts (``mismatches``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from drafttrain.verify.methods.registry import Variant

__all__ = ["EvalPlan", "PLAIN", "Variant", "plain_greedy", "run_interleaved", "run_plan", "run_record"]

#: the label of every batch size's plain-decoding record
PLAIN = "plain"


@dataclass(frozen=True)
class EvalPlan:
    """What to decode. Immutable: a caller builds one and hands it to :func:`run_plan`.

    Attributes:
        prompts: token ids (chat template applied), one list per prompt.
        variants: the speculative runs (:class:`~drafttrain.verify.methods.registry.Variant`: a label and
            ``make(batch_size, plain_outputs) -> proposer``); each runs once per batch size and mode.
        batch_sizes: sequences in flight per engine (continuous batching).
        max_new_tokens: the generation cap per prompt.
        modes: the engine modes of the speculative runs (``unpadded``: EMS-SD; ``padded``; ...).
        plain_mode: the engine mode of the plain baseline.
        unit: how a batch size's runs interleave (:func:`run_interleaved`): ``run`` (one after the other, in
            plan order), ``prompt`` (one prompt through every run in turn) or ``step`` (lock-step: one decoding
            step each in turn; the ratios then hold on a host whose speed drifts).
        plain_at: where plain decoding stands among a batch size's runs: before the variants from this index on (0:
            first; ``len(variants)``: last); with ``unit="run"`` a variant after it gets plain's outputs (``make``'s
            second argument, e.g. replay's scripted acceptance), one before it or in a lock-step unit gets None.
        subsets: batch size -> the prompt indices decoded at that size (default: every prompt), e.g. the batch-1
            latency prompts.
        variants_at: batch size -> the labels of the variants run at that size (default: all).
        stop_token_ids: end-of-turn ids; None = the target's eos.
        sampling: a :class:`~drafttrain.sampling.SamplingParams`; None = greedy.
        seed: the engines' sampling seed.
        pack_inputs: the engines' ``pack_inputs`` (``auto`` | ``always``).
        compile_target: batch-1 engines run the target forward compiled (compiled first, untimed; one graph set
            per set of feature layers the proposers read).
        warm_up: ``prefill`` (an untimed plain prefill of the first wave and one step evens out the first
            prefill), ``runs`` (plain and every variant on two prompts, 8 new tokens, per mode: allocations and
            first-call overheads) or ``none``.
        check: under greedy decoding, compare every lossless run with plain decoding (else ``greedy_equal`` is None).
        progress: show progress bars.
    """

    prompts: Sequence[Sequence[int]]
    variants: Sequence[Variant]
    batch_sizes: Sequence[int] = (16,)
    max_new_tokens: int = 128
    modes: Sequence[str] = ("unpadded",)
    plain_mode: str = "unpadded"
    unit: str = "run"
    plain_at: int = 0
    subsets: dict[int, Sequence[int]] = field(default_factory=dict)
    variants_at: dict[int, Sequence[str]] = field(default_factory=dict)
    stop_token_ids: Sequence[int] | int | None = None
    sampling: Any = None
    seed: int = 0
    pack_inputs: str = "auto"
    compile_target: bool = False
    warm_up: str = "prefill"
    check: bool = True
    progress: bool = False

    def __post_init__(self):
        if self.unit not in ("run", "prompt", "step"):
            raise ValueError(f"unit must be run, prompt or step, got {self.unit!r}")
        if self.warm_up not in ("prefill", "runs", "none"):
            raise ValueError(f"warm_up must be prefill, runs or none, got {self.warm_up!r}")
        if not self.prompts or not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError("a plan needs prompts and batch sizes >= 1")
        if PLAIN in {v.label for v in self.variants}:
            raise ValueError(f"'{PLAIN}' is the baseline's label: name the variant otherwise")


@torch.no_grad()
def plain_greedy(target, prompt: Sequence[int], max_new_tokens: int,
                 stop: int | Sequence[int] | None = None) -> tuple[list[int], float]:  # fmt: skip
    """Plain greedy decoding of one prompt with the target's own KV cache (the one-sequence reference).

    Args:
        stop: end-of-turn id(s) (:meth:`drafttrain.target.Target.generate`'s ``stop_token_ids``): None = eos, -1 none.

    Returns:
        (generated token ids, prompt excluded, the stop token included when produced; seconds).
    """
    t0 = time.perf_counter()
    r = target.generate([list(prompt)], max_new_tokens, stop_token_ids=stop, return_features=False)[0]
    return r["tokens"][len(prompt) :], time.perf_counter() - t0


@torch.no_grad()
def run_interleaved(engines: dict, prompts: list[list[int]], unit: str = "run", rotate: bool = False,
                    progress: bool | str = False, warm_up: Callable[[], object] | None = None) -> dict:
    """Decode ``prompts`` through every engine, side by side, for timings that hold on a drifting host.

    ``unit="run"``: one :meth:`~drafttrain.verify.engine.SpecEngine.run` per engine, in the dict's order.
    ``unit="prompt"``: the prompts one at a time through every engine in turn. ``unit="step"``: every
    engine holds all prompts at once and the engines advance in lock-step, one decoding step each in
    turn (:meth:`~drafttrain.verify.engine.SpecEngine.advance`; each engine times its own steps), so
    two runs compared are never more than a step apart, at any batch size. Each engine keeps its
    proposer (and planner) throughout and its results and counters accumulate, so the returned run
    holds all prompts. The turn order changes from one prompt (or step) to the next: reversed every
    other time (``rotate=False``: two neighbours in the dict stay neighbours), or rotated by one
    (``rotate=True``: every engine takes every position, for comparing many variants).

    ``warm_up`` (untimed, called once before the first engine starts) evens out the first prefill: the
    first engine's prefill ran ~8% slower than the others' on a CPU (docs/benchmarks/planner.md).

    Args:
        engines: name -> :class:`~drafttrain.verify.engine.SpecEngine` (fresh: no prompts run yet).
        prompts: token ids, one list per prompt.
        unit: run | prompt | step.
        rotate: with ``unit`` prompt or step, rotate the order instead of reversing it.
        progress: a tqdm description (``True``: a default one), or ``False`` for none.
        warm_up: called once before anything is timed (its result is dropped); None = none.

    Returns:
        name -> :class:`~drafttrain.verify.engine.EngineRun` covering all ``prompts`` in their order.

    Raises:
        ValueError: an unknown ``unit``.
    """
    if unit not in ("run", "prompt", "step"):
        raise ValueError(f"unit must be run, prompt or step, got {unit!r}")
    order, runs = list(engines), {}
    if warm_up is not None:
        warm_up()
    desc = progress if isinstance(progress, str) else f"decode {'/'.join(order)}"

    def turn(i: int) -> list[str]:
        k = i % len(order)
        return order[k:] + order[:k] if rotate else (order if i % 2 == 0 else order[::-1])

    if unit == "run":
        for name in order:
            runs[name] = engines[name].run(prompts, progress=progress and f"{desc}: {name}")
    elif unit == "prompt":
        for i, p in enumerate(tqdm(prompts, desc=desc, disable=not progress, leave=False)):
            for name in turn(i):
                runs[name] = engines[name].run([p])  # results and counters accumulate in each engine
    else:
        for e in engines.values():
            e.submit(prompts)
        with tqdm(total=len(prompts) * len(order), desc=desc, disable=not progress, leave=False) as bar:
            i = 0
            while not all(e.done for e in engines.values()):
                for name in turn(i):
                    if not engines[name].done:
                        engines[name].advance()
                bar.update(sum(len(e.results) for e in engines.values()) - bar.n)
                i += 1
        runs = {name: e.result() for name, e in engines.items()}
    return runs


def run_record(run, label: str, mode: str, batch_size: int) -> dict[str, Any]:
    """One decoding run (an :class:`~drafttrain.verify.engine.EngineRun`) as a record: what it decoded and how fast.

    Returns:
        ``method`` (the run's label), ``mode``, ``batch_size``, ``tokens_per_s`` (generated tokens per second,
        prompt forwards included), ``decode_tokens_per_s`` (decoding steps alone), ``seconds``, ``prefill_seconds``,
        ``generated_tokens``, ``tau``, ``forwards``, ``sequence_steps``, ``mean_tree_nodes``, ``draft_seconds``,
        ``verify_forward_seconds``, the padding ratios and counts, ``accept_hist`` (steps per accepted-draft
        count), ``depth_acceptance``, ``tokens`` (each prompt's output, in prompt order) and ``sequence_tau`` (each
        prompt's τ); callers that write records drop the last two.
    """
    st = run.stats
    return {
        "method": label,
        "mode": mode,
        "batch_size": batch_size,
        "tokens_per_s": st.tokens_per_s,
        "decode_tokens_per_s": st.decode_tokens_per_s,  # the decoding steps alone (prompt forwards left out)
        "seconds": st.seconds,
        "prefill_seconds": st.prefill_seconds,
        "generated_tokens": st.generated,
        "tau": st.tau,
        "forwards": st.forwards,
        "sequence_steps": st.seq_steps,
        "mean_tree_nodes": st.tree_nodes / max(st.seq_steps, 1),
        "draft_seconds": st.draft_seconds,
        "verify_forward_seconds": st.forward_seconds,
        "padding_ratio": st.padding_ratio,
        "input_padding_ratio": st.input_padding_ratio,
        "kv_padding_ratio": st.kv_padding_ratio,
        "window_padding_ratio": st.window_padding_ratio,
        "input_padding": st.input_padding,
        "kv_padding": st.kv_padding,
        "input_tokens": st.input_tokens,
        "kv_tokens": st.kv_tokens,
        "prefill_padding": st.prefill_padding,
        "accept_hist": {int(k): v for k, v in sorted(st.accept_hist.items())},
        "depth_acceptance": st.depth_acceptance(),
        "tokens": [r.tokens for r in run.results],
        "sequence_tau": [r.tau for r in run.results],
    }


def _compile(engines: list, log_seconds: list[float]) -> None:
    """Compile the target forward once per set of feature layers the batch-1 engines read (before any timing)."""
    seen = set()
    for eng in engines:
        if eng.compile_target and eng.feature_layers not in seen:
            seen.add(eng.feature_layers)
            log_seconds.append(eng.warm_up_compiled())


@torch.no_grad()
def run_plan(run, plan: EvalPlan) -> list[dict[str, Any]]:
    """Decode ``plan`` on ``run``'s target (a :class:`drafttrain.compose.Run`): one record per (batch size, run).

    At each batch size, in plan order: plain decoding (``method`` ``"plain"``, ``plan.plain_mode``) and every
    variant in every mode (a fresh proposer per run: proposers keep per-sequence state), interleaved by
    ``plan.unit``. Each record is :func:`run_record`'s plus ``lossless`` (the proposer's own ``lossless``
    attribute, default True), ``speedup`` / ``speedup_decode`` over the plain record of its batch size, ``prompts``
    (the indices decoded), ``compile_seconds`` (batch 1 with ``compile_target``) and, under greedy decoding with
    ``plan.check``: ``greedy_equal``, ``equal_fraction`` and ``mismatches`` (prompt indices whose output differs
    from plain decoding, the one-sequence reference included). A variant's ``finish`` hook then adds its own fields.
    Records come out batch size by batch size, plain first, the variants in plan order, modes inner.

    Raises:
        ValueError: ``compile_target`` at a batch size other than 1 is ignored there; an engine's own errors
            (an unknown mode, a tree on a recurrent target) propagate.
    """
    from drafttrain.sampling import GREEDY
    from drafttrain.verify.proposers import PlainProposer

    target = run.target
    stop = plan.stop_token_ids if plan.stop_token_ids is not None else target.eos_token_id
    sampling = plan.sampling if plan.sampling is not None else GREEDY
    greedy = bool(getattr(sampling, "greedy", True))
    records: list[dict[str, Any]] = []

    for bs in plan.batch_sizes:
        idx = list(plan.subsets.get(bs, range(len(plan.prompts))))
        prompts = [list(plan.prompts[i]) for i in idx]
        keep = plan.variants_at.get(bs)
        chosen = [(k, v) for k, v in enumerate(plan.variants) if keep is None or v.label in keep]
        variants = [v for _, v in chosen]
        compiled = plan.compile_target and bs == 1

        def engine(proposer, mode, max_new_tokens=plan.max_new_tokens, bs=bs, compiled=compiled):
            return run.engine(proposer, batch_size=bs, max_new_tokens=max_new_tokens, mode=mode, sampling=sampling,
                              stop_token_ids=stop, seed=plan.seed, pack_inputs=plan.pack_inputs,
                              compile_target=compiled)  # fmt: skip

        # the runs of this batch size in plan order: (name, label, mode, variant or None for plain)
        slots = [(f"{v.label}/{m}" if len(plan.modes) > 1 else v.label, v.label, m, v) for v in variants for m in plan.modes]
        at = sum(k < plan.plain_at for k, _ in chosen) * len(plan.modes)  # before the variants from plain_at on
        slots.insert(at, (PLAIN, PLAIN, plan.plain_mode, None))
        if plan.warm_up == "runs" and bs == plan.batch_sizes[0]:  # once, untimed: allocations and first calls
            few = prompts[:2] if len(prompts) > 1 else prompts * 2
            for mode in sorted(set(plan.modes) | {plan.plain_mode}):
                warm = engine(PlainProposer(), mode, max_new_tokens=8, bs=2, compiled=False).run(few)
                for v in variants:
                    prop = v.warm() if v.warm is not None else v.make(2, [r.tokens for r in warm.results])
                    engine(prop, mode, max_new_tokens=8, bs=2, compiled=False).run(few)
        proposers, runs, compile_seconds = {}, {}, []
        if plan.unit == "run":  # one after the other: a variant after plain gets plain's outputs
            plain_tokens = None
            for name, label, mode, v in slots:
                prop = PlainProposer() if v is None else v.make(bs, plain_tokens)
                eng = engine(prop, mode)
                if compiled:
                    _compile([eng], compile_seconds)
                proposers[name] = prop
                runs[name] = eng.run(prompts, progress=plan.progress and f"{name} b={bs}")
                if v is None:
                    plain_tokens = [r.tokens for r in runs[name].results]
        else:
            engines = {}
            for name, label, mode, v in slots:
                proposers[name] = PlainProposer() if v is None else v.make(bs, None)
                engines[name] = engine(proposers[name], mode)
            if compiled:
                _compile(list(engines.values()), compile_seconds)

            def warm_up():  # untimed: a plain engine's prefill of the first wave and one step
                w = engine(PlainProposer(), plan.plain_mode)
                w.submit(prompts[:bs])
                w.advance()

            runs = run_interleaved(engines, prompts, unit=plan.unit, warm_up=warm_up if plan.warm_up == "prefill" else None,
                                   progress=plan.progress and f"decode {'/'.join(engines)} b={bs}")  # fmt: skip
        plain = run_record(runs[PLAIN], PLAIN, plan.plain_mode, bs)
        singles: dict[int, list[int]] = {}  # prompt index -> one-sequence plain output (computed where needed)
        out = []
        for name, label, mode, v in slots:
            rec = plain if v is None else run_record(runs[name], label, mode, bs)
            prop = proposers[name]
            rec["lossless"] = True if v is None else bool(getattr(prop, "lossless", True))
            rec["speedup"] = rec["tokens_per_s"] / max(plain["tokens_per_s"], 1e-9)
            rec["speedup_decode"] = rec["decode_tokens_per_s"] / max(plain["decode_tokens_per_s"], 1e-9)
            rec["prompts"] = idx
            rec["compile_seconds"] = sum(compile_seconds)
            if greedy and plan.check and v is not None:
                bad = []
                for j, (a, b) in enumerate(zip(rec["tokens"], plain["tokens"])):
                    if a != b:
                        if j not in singles:
                            singles[j] = plain_greedy(target, prompts[j], plan.max_new_tokens, stop=stop)[0]
                        if a != singles[j]:
                            bad.append(j)
                rec["greedy_equal"] = not bad
                rec["equal_fraction"] = 1 - len(bad) / max(len(rec["tokens"]), 1)
                rec["mismatches"] = [idx[j] for j in bad]
            if v is not None and v.finish is not None:
                v.finish(prop, rec, bs)
            out.append(rec)
        records.extend(out)
    return records
