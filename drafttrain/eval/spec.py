"""Greedy chain speculative decoding, one sequence at a time (the in-training evaluation).

Each step: the drafter proposes a chain of ``depth`` tokens (ParallelSpec: K + 1 in one forward pass,
Algorithm 1 with a chain instead of a tree; Medusa: K heads; EAGLE: D autoregressive drafter passes),
the target verifies ``[last token, d_1..d_depth]`` in one forward pass, the
longest prefix of drafts equal to the target's own argmax is accepted, and the target's argmax after
it is the bonus token. Greedy acceptance makes the output identical to plain greedy decoding of the
target (checked by :func:`evaluate_prompts` on every prompt). Rejected positions are cropped from
both KV caches. The bundled batched tree verifier is a separate component (docs/design.md, "The verifier").

τ (acceptance length) = tokens emitted by verification steps / verification forwards; the prefill
forward (which emits the first token in both plain and speculative decoding) is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from drafttrain.verify.hybrid import DEFAULT_EXTRA_NODES


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    target_forwards: int  # verification forwards (prefill excluded)
    emitted: int  # tokens emitted by verification forwards
    accept_lengths: list[int] = field(default_factory=list)  # drafts accepted per step (0..K+1)
    seconds: float = 0.0


def _truncate(tokens: list[int], max_new_tokens: int, stop: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if stop is not None and stop in tokens:
        tokens = tokens[: tokens.index(stop) + 1]
    return tokens


@torch.no_grad()
def plain_greedy(target, prompt: list[int], max_new_tokens: int, stop: int | None = None) -> tuple[list[int], float]:
    """Plain greedy decoding with the target's KV cache. Returns (generated tokens, seconds)."""
    t0 = time.perf_counter()
    r = target.generate_greedy([prompt], max_new_tokens, stop_token_id=stop, return_features=False)[0]
    return r["tokens"][len(prompt) :], time.perf_counter() - t0


@torch.no_grad()
def speculative_greedy(target, drafter, prompt: list[int], max_new_tokens: int, stop: int | None = None) -> SpecResult:
    """Greedy chain speculative decoding of one prompt with any drafter.

    Args:
        target: :class:`drafttrain.target.Target`.
        drafter: a drafter with ``propose(next_ids [1, n], features [1, n, F], cache) -> [1, depth, v]``
            (row j: the (j+1)-th token after the last item's x_{i+1}); it keeps its own ``cache``
            (a ``DynamicCache`` of the real items, created here) consistent. It is handed what it
            declares (``drafter.spec``): the features of its ``feature_layers`` (F = len(ids) * d), for
            every new item (``step_input="items"``) or the last one (``"last"``).
        prompt: prompt token ids.
        max_new_tokens: generation cap; ``stop``: end-of-turn id (default the target's eos).

    Returns:
        :class:`SpecResult`.
    """
    from transformers import DynamicCache

    stop = target.eos_token_id if stop is None else stop
    device = target.device
    t0 = time.perf_counter()
    tcache, dcache = DynamicCache(), DynamicCache()
    layers = drafter.feature_layers  # the declared target layers (drafters/base.py)
    keep = -1 if drafter.spec.step_input == "last" else 0  # "last": only the last item's feature is handed over
    ids = torch.tensor([prompt], device=device)
    out = target.forward(ids, cache=tcache, use_cache=True, feature_layers=layers)
    last = int(out.logits[0, -1].argmax())
    generated = [last]
    # drafter items for the prompt: (x_{i+1}, f_i), i = 0..n-1, with x_n = the first generated token
    item_ids = torch.tensor([prompt[1:] + [last]], device=device)[:, keep:]
    item_feats = out.features[:, keep:]
    res = SpecResult(tokens=[], target_forwards=0, emitted=0)
    while len(generated) < max_new_tokens and generated[-1] != stop:
        draft = drafter.propose(item_ids, item_feats, dcache)[0].argmax(-1)  # [depth]
        k1 = draft.numel()
        cache_len = tcache.get_seq_length()
        verify = torch.cat([torch.tensor([last], device=device), draft])[None]  # [1, depth + 1]
        pos = torch.arange(cache_len, cache_len + k1 + 1, device=device)[None]
        tout = target.forward(verify, position_ids=pos, cache=tcache, use_cache=True, feature_layers=layers)
        preds = tout.logits[0].argmax(-1)  # [depth + 1] target's next token after each verify input
        match = (draft == preds[:k1]).long()
        m = int(torch.cumprod(match, 0).sum())  # accepted drafts
        bonus = int(preds[m])
        new = draft[:m].tolist() + [bonus]
        tcache.crop(-(k1 - m))  # keep last + accepted drafts; drop the rejected ones
        if stop is not None and stop in new:  # an accepted draft may already end the answer
            new = new[: new.index(stop) + 1]
        new = new[: max_new_tokens - len(generated)]  # emitted tokens past the cap do not count
        res.target_forwards += 1
        res.emitted += len(new)
        res.accept_lengths.append(m)
        generated.extend(new)
        item_ids = torch.tensor([new], device=device)[:, keep:]
        item_feats = tout.features[:, : m + 1][:, keep:]
        last = bonus
    res.tokens = _truncate(generated, max_new_tokens, stop)
    res.seconds = time.perf_counter() - t0
    return res


def evaluate_prompts(
    target, drafter, prompts: list[list[int]], max_new_tokens: int, progress: bool = True, timing_prompts: int = 2
) -> dict:
    """Speculative vs plain greedy decoding on each prompt.

    The plain greedy reference of all prompts comes from one batched generation (much cheaper than
    one sequence at a time on a CPU); where a speculative output differs from it, the prompt is
    decoded again alone and only a difference from that single-sequence reference counts as a
    mismatch (batched and single matmuls may round differently at a near tie). Wall-clock speedup
    is timed side by side, one sequence at a time, on the first ``timing_prompts`` prompts.

    Returns:
        dict with ``tau`` (emitted / verification forwards over all prompts), ``greedy_equal`` (bool:
        every prompt's speculative output equals plain greedy token for token), ``mismatches`` (prompt
        indices that differ), ``accept_hist`` (count of steps per accepted-draft count),
        ``plain_tokens_per_s`` and ``spec_tokens_per_s`` (batch 1, timed prompts), ``speedup``,
        ``num_prompts``, ``generated_tokens``, ``outputs`` (per prompt: tokens, tau).
    """
    batch_ref = target.generate_greedy(prompts, max_new_tokens, return_features=False)
    emitted = forwards = 0
    plain_s = spec_s = 0.0
    timed_tokens = n_tokens = 0
    mismatches, outputs = [], []
    hist: dict[int, int] = {}
    for i, p in enumerate(tqdm(prompts, desc="spec-eval", disable=not progress, leave=False)):
        r = speculative_greedy(target, drafter, p, max_new_tokens)
        ref = batch_ref[i]["tokens"][len(p) :]
        if r.tokens != ref:
            ref, _ = plain_greedy(target, p, max_new_tokens)
            if r.tokens != ref:
                mismatches.append(i)
        if i < timing_prompts:
            _, dt = plain_greedy(target, p, max_new_tokens)
            plain_s += dt
            spec_s += r.seconds
            timed_tokens += len(ref)
        emitted += r.emitted
        forwards += r.target_forwards
        n_tokens += len(ref)
        for a in r.accept_lengths:
            hist[a] = hist.get(a, 0) + 1
        outputs.append({"tokens": r.tokens, "tau": r.emitted / max(r.target_forwards, 1), "equal": i not in mismatches})
    return {
        "tau": emitted / max(forwards, 1),
        "greedy_equal": not mismatches,
        "mismatches": mismatches,
        "accept_hist": dict(sorted(hist.items())),
        "plain_tokens_per_s": timed_tokens / max(plain_s, 1e-9),
        "spec_tokens_per_s": timed_tokens / max(spec_s, 1e-9),
        "speedup": plain_s / max(spec_s, 1e-9),
        "num_prompts": len(prompts),
        "generated_tokens": n_tokens,
        "outputs": outputs,
    }


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
    first engine's prefill ran ~8% slower than the others' on this CPU (batch 16: 2.87 vs 2.66 s and
    2.79 vs 2.63 s with the two engines' places swapped, the same work in both; +2-3% of a batch-16
    run's wall time, whichever engine went first); after one throwaway prefill both took the same
    time (2.70 / 2.66 s, 2.52 / 2.49 s). :func:`evaluate_prompts_batched` passes one (a plain engine's
    prefill of the first wave and one step).

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


@torch.no_grad()
def evaluate_prompts_batched(
    target, drafter, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16, mode: str = "unpadded",
    progress: bool = True, tree_widths: list[int] | None = None, tree_budget: int | None = None,
    also_chain: bool = False, also_alone: bool = False, plan: bool = False, full_tree: bool = True, sssd=None, sssd_nodes: int = DEFAULT_EXTRA_NODES,
    interleave: str = "run", compile_target: bool = False,
) -> dict:
    """The same evaluation as :func:`evaluate_prompts`, through the bundled batched verifier.

    Plain decoding (:class:`~drafttrain.verify.proposers.PlainProposer`) and greedy chain speculative
    decoding (the drafter's own proposer, :func:`~drafttrain.verify.proposers.proposer_for`, with its
    default chain: ParallelSpec K + 1, Medusa K heads, EAGLE D autoregressive steps) both run in
    :class:`~drafttrain.verify.engine.SpecEngine` with ``batch_size`` sequences at a time (continuous
    batching, EMS-SD unpadded KV cache). On a CPU a batch-1 forward of the target is bound by reading
    its weights, so a batch of 16 costs little more than one sequence: the evaluation takes minutes
    instead of most of a training budget. τ has the same definition (tokens emitted by verification
    steps / sequence-steps, prefill excluded; docs/design.md, "Definitions"); ``speedup`` is the tokens/s ratio of the
    two engine runs **at this batch size** (for batch-1 latency use :func:`evaluate_prompts`), prompt
    forwards included; ``speedup_decode`` the same ratio of the decoding steps alone
    (:attr:`~drafttrain.verify.engine.EngineStats.decode_tokens_per_s`: both runs make the same prompt
    forwards, which only add their noise). Stops at the target's eos, as :func:`evaluate_prompts` does.
    ``tree_widths`` / ``tree_budget`` verify a draft tree instead of the chain
    (:func:`~drafttrain.verify.tree.parallelspec_tree`: candidates per depth, maximum nodes;
    ParallelSpec Appendix A.3); greedy acceptance keeps the output lossless.
    ``also_chain`` (with a tree) decodes the prompts a third time with the chain and adds its numbers as
    ``tau_chain``, ``speedup_chain``, ``spec_tokens_per_s_chain``, ``accept_hist_chain``; ``also_alone`` decodes
    them with the drafter's own chain and no SSSD candidates (the drafter alone; the chain run itself when there
    is no ``sssd``) and adds ``tau_alone``, ``accept_hist_alone``;
    ``greedy_equal`` then covers both runs. ``plan`` decodes them once more with the online planner
    (:mod:`drafttrain.verify.planner`: per step only the nodes that pay, none and no drafting when
    nothing does) and adds ``speedup_planned``, ``speedup_planned_decode``, ``spec_tokens_per_s_planned``,
    ``tau_planned`` and ``planner`` (its counters); ``tau`` stays the full tree's (the drafter's quality),
    ``greedy_equal`` covers the planned run too. ``full_tree=False`` (with ``plan``) skips the full-tree
    run: the planned run then also gives ``tau``, ``speedup``, ``speedup_decode``, ``spec_tokens_per_s``
    and ``accept_hist`` (a cheaper latency measurement where the drafter's full-tree τ is known from
    another run). ``sssd`` (an :class:`~drafttrain.verify.methods.sssd.SSSDDrafter`) merges up to
    ``sssd_nodes`` training-free candidates into every tree (:class:`~drafttrain.verify.hybrid.HybridProposer`)
    in the tree, chain and planned runs alike.

    Timing (:func:`run_interleaved`): the runs go in the order full tree, chain, plain, planned, so that
    plain decoding and the speedup's speculative run (the planned one, else the tree) are next to each
    other. ``interleave="run"`` runs them one after the other; ``"prompt"`` decodes the prompts one at a
    time through every run in turn; ``"step"`` advances the runs' engines in lock-step, one decoding
    step each in turn (the order reversed every other step), each run keeping its engine, proposer and
    planner throughout: the ratios then hold on a host whose speed drifts by 10-15% within a minute
    (whole batch-16 runs ~20 s apart, both plain decoding on all but 2-3 steps, differed by up to 20%).
    Before any of them, an untimed plain prefill of the first wave evens out the first prefill (which ran
    ~8% slower than the next ones: ``run_interleaved``'s ``warm_up``).

    A speculative output that differs from the batched plain output is decoded again alone with
    :func:`plain_greedy`; only a difference from that single-sequence reference counts as a mismatch
    (batched and single matmuls may round differently at a near tie).

    ``compile_target`` (batch 1 only) runs every engine's target forward through the compiled backbone
    (``SpecEngine(compile_target=True)``), compiled before the timed runs; ``compile_seconds`` says how long.

    Returns:
        the keys of :func:`evaluate_prompts` plus ``batch_size``, ``mode`` and ``compile_seconds``.

    Raises:
        ValueError: ``compile_target`` with ``batch_size`` > 1, or ``full_tree=False`` without ``plan``.
    """
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.proposers import PlainProposer, proposer_for

    stop = target.eos_token_id
    if compile_target and batch_size != 1:
        raise ValueError(f"compile_target needs batch_size=1, got {batch_size}")

    def engine(proposer):
        return SpecEngine(target, proposer, batch_size=batch_size, max_new_tokens=max_new_tokens, mode=mode,
                          stop_token_ids=stop, compile_target=compile_target)  # fmt: skip

    tree = tree_widths is not None or tree_budget is not None
    if not full_tree and not plan:
        raise ValueError("full_tree=False needs plan=True (there would be no speculative run)")
    engines = {}  # in timing order: plain next to the speedup's run
    if full_tree:
        engines["tree" if tree else "chain"] = engine(proposer_for(drafter, widths=tree_widths, budget=tree_budget, sssd=sssd,
                                                                   sssd_nodes=sssd_nodes))  # fmt: skip
    if tree and also_chain:
        engines["chain"] = engine(proposer_for(drafter, sssd=sssd, sssd_nodes=sssd_nodes))
    alone_key = None  # the run that decodes with the drafter alone (its chain, no SSSD)
    if also_alone:
        if sssd is None and ((not tree and full_tree) or (tree and also_chain)):
            alone_key = "chain"  # a run already is
        else:
            engines["alone"] = engine(proposer_for(drafter))
            alone_key = "alone"
    engines["plain"] = engine(PlainProposer())
    if plan:
        planned_prop = proposer_for(drafter, widths=tree_widths, budget=tree_budget, plan=True, sssd=sssd,
                                    sssd_nodes=sssd_nodes)  # fmt: skip
        engines["planned"] = engine(planned_prop)
    compile_seconds = 0.0
    if compile_target:  # before any timed step; one set of graphs per set of feature layers the proposers read
        seen = set()
        for eng in engines.values():
            if eng.feature_layers not in seen:
                seen.add(eng.feature_layers)
                compile_seconds += eng.warm_up_compiled()

    def warm_up():  # untimed: a plain engine's prefill of the first wave and one step (run_interleaved)
        warm = engine(PlainProposer())
        warm.submit(prompts[:batch_size])
        warm.advance()

    runs = run_interleaved(engines, prompts, unit=interleave, warm_up=warm_up,
                           progress=progress and f"spec-eval {'/'.join(engines)} b={batch_size}")  # fmt: skip
    plain, planned = runs["plain"], runs.get("planned")
    spec = runs.get("tree", runs.get("chain") if full_tree else planned)
    chain = runs.get("chain") if tree and also_chain else None
    alone = runs.get(alone_key) if alone_key else None
    mismatches, outputs = [], []
    for i, (p, s, r) in enumerate(zip(prompts, spec.results, plain.results)):
        outs = [s.tokens] + [x.results[i].tokens for x in (chain, planned, runs.get("alone")) if x is not None]
        if any(o != r.tokens for o in outs):
            single = plain_greedy(target, p, max_new_tokens)[0]
            if any(o != single for o in outs):
                mismatches.append(i)
        outputs.append({"tokens": s.tokens, "tau": s.tau, "equal": i not in mismatches})
    st, pt = spec.stats, plain.stats

    def decode_ratio(x) -> float:  # decoding steps only: the same prompt forwards left out of both runs
        return x.decode_tokens_per_s / max(pt.decode_tokens_per_s, 1e-9)

    extra = {}
    if chain is not None:
        ct = chain.stats
        extra = {"tau_chain": ct.tau, "speedup_chain": ct.tokens_per_s / max(pt.tokens_per_s, 1e-9),
                 "spec_tokens_per_s_chain": ct.tokens_per_s, "accept_hist_chain": dict(sorted(ct.accept_hist.items()))}  # fmt: skip
    if alone is not None:
        at = alone.stats
        extra.update(tau_alone=at.tau, accept_hist_alone=dict(sorted(at.accept_hist.items())))
    if planned is not None:
        qt = planned.stats
        extra.update(speedup_planned=qt.tokens_per_s / max(pt.tokens_per_s, 1e-9), tau_planned=qt.tau,
                     speedup_planned_decode=decode_ratio(qt),
                     spec_tokens_per_s_planned=qt.tokens_per_s, planner=planned_prop.planner.summary())  # fmt: skip
    return {
        "tau": st.tau,
        "greedy_equal": not mismatches,
        "mismatches": mismatches,
        "accept_hist": dict(sorted(st.accept_hist.items())),
        "plain_tokens_per_s": pt.tokens_per_s,
        "spec_tokens_per_s": st.tokens_per_s,
        "speedup": st.tokens_per_s / max(pt.tokens_per_s, 1e-9),
        "speedup_decode": decode_ratio(st),
        "num_prompts": len(prompts),
        "generated_tokens": sum(len(r.tokens) for r in plain.results),
        "outputs": outputs,
        "batch_size": batch_size,
        "compile_seconds": compile_seconds,
        "mode": mode,
        "tree_nodes_per_step": st.tree_nodes / max(st.seq_steps, 1),
        **extra,
    }
