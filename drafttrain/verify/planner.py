"""Speculation that never loses: per step, verify only the draft nodes that pay; stop drafting where it loses.

The rule is SSSD's (Marzollo et al. 2024, §3.2: the best speculation length maximises acceleration over
cost increase, :func:`drafttrain.verify.methods.sssd.plan_speculation_length`), applied online, per step:

- **Value.** A node is accepted exactly when its whole path is the target's continuation, so a tree emits
  ``1 + sum_j P(node j accepted)`` tokens; P is the drafter's path confidence (``DraftTree.scores``)
  calibrated online against what the verifier accepted (bins per node source; a node is never valued
  above its parent, so the best K nodes are ancestor-closed).
- **Cost.** ``t(b, M)``, seconds of a verification forward of b sequences with M inputs, from the forwards
  the engine reports (:class:`ForwardCostModel`): piecewise-linear through the measured sizes, made
  non-decreasing, beyond them growing at the measured slope and never below a per-input floor (never
  flat). Unknown slope: the first drafted step verifies the batch's best b nodes to measure it. Plain
  decoding is measured first (``plain_first`` steps). Plus measured drafting time and step overhead.
- **Choice.** With nodes sorted by value, verify the K best, K maximising
  ``(b + sum_{k<=K} v_k) / (t_draft + t(b, b + K) + o_tree)``; K = 0 is plain decoding.
- **Whether to draft.** Once 8 drafting steps are seen at a batch size, the measured tokens/s of the last
  24 against plain steps' (same run; the cost model's plain step until 8 are seen) decide, whatever the
  prediction says; before that, the predicted gain. At a batch size b > ``probe_rows`` where drafting has not
  been judged to pay (at b or a larger batch size), only ``probe_rows`` sequences draft (those with the
  least for the drafter to read first): a sequence's first drafting runs the drafter over its whole
  prompt, so a probe of every row cost several plain steps before anything was measured. The probe's
  nodes, b / ``probe_rows`` times over, and the drafting time scaled to b rows price drafting every row,
  and that prediction decides whether the next step does; a probe's step counts in neither measured rate.
  When drafting stops, a skip run follows, long enough that the next re-probe's loss is at most
  ``probe_budget`` of the run's plain time, doubling per unpaid step in a row, at most ``max_skip`` steps;
  each re-probe (a probe, or a drafting step of every row where that paid before) is judged again, so
  drafting resumes where the host comes to make it pay.

Lossless: only which nodes of the proposer's tree are verified is chosen (an ancestor-closed subset; under
sampling the kept children of a node are its first draws), so every acceptance rule keeps its guarantee and
greedy output equals plain greedy decoding. The measurements behind each rule: docs/benchmarks/planner.md.
Shape letters: b sequences in the step, n tree nodes, M verification inputs of the step (b + nodes).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from drafttrain.sampling import GREEDY
from drafttrain.verify.cost import ForwardCostModel
from drafttrain.verify.tree import DraftTree


class SpeculationPlanner:
    """The per-step choice of how many draft nodes to verify, and whether to draft (module docstring).

    Args:
        max_skip: longest run of steps without drafting after drafting stopped (the re-probe period's bound;
            the probe budget sets the run, this only bounds how late a changed host is noticed. A bound below
            the priced run makes every re-probe cost more than ``probe_budget``).
        calibration_decay: discount of old evidence in the calibration (per observed tree).
        min_gain: drafting must promise (predicted) or measure (realized) at least this factor over plain decoding.
        per_source: calibrate each node source (:attr:`DraftTree.sources`) on its own bins; False = one
            set of bins for all.
        price_overhead: add each step's measured overhead to its price; False = forward + drafting time only.
        probe_budget: the fraction of plain decoding's time a re-probe that does not pay may cost: the skip
            run after an unpaid step is at least ``loss / (probe_budget * t_plain_step) - 1`` steps.
        drift: the cost model follows the host's speed (:class:`ForwardCostModel`).
        realized: the measured rates decide whether to keep drafting (module doc); False = the prediction alone.
        min_input_cost: the cost model's floor per extra input (:class:`ForwardCostModel`).
        plain_first: plain steps at a batch size before it drafts: the median of their forwards is the
            reference of every choice (one forward at a bad moment priced every node as free).
        probe_rows: sequences a probe drafts at a batch size where drafting has not been judged to pay
            (module doc); >= the batch size: every row drafts.

    Raises:
        ValueError: ``max_skip``, ``plain_first`` or ``probe_rows`` < 1, ``probe_budget`` outside (0, 1),
            or ``min_input_cost`` outside (0, 1].
    """

    #: names of the node sources other than the drafter (:attr:`DraftTree.sources`) in :meth:`summary`
    SOURCE_NAMES = {1: "sssd", 2: "both"}
    #: upper edges of the confidence bins of the calibration
    BINS = (0.001, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    #: recent steps per (batch size, drafted) whose tokens/s are the realized rates; fewest to judge by
    REALIZED_WINDOW, REALIZED_MIN = 24, 8

    def __init__(self, max_skip: int = 256, calibration_decay: float = 0.99, min_gain: float = 1.0,
                 per_source: bool = True, price_overhead: bool = True, probe_budget: float = 0.01,
                 drift: bool = True, realized: bool = True, min_input_cost: float = 0.02, plain_first: int = 3,
                 probe_rows: int = 2):  # fmt: skip
        if probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1, got {probe_rows}")
        self.probe_rows = int(probe_rows)
        self._pays: set[int] = set()  # batch sizes whose last judgement said drafting pays
        if max_skip < 1:
            raise ValueError(f"max_skip must be >= 1, got {max_skip}")
        if not 0.0 < probe_budget < 1.0:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        if plain_first < 1:
            raise ValueError(f"plain_first must be >= 1, got {plain_first}")
        self.plain_first = int(plain_first)
        self.cost = ForwardCostModel(drift=drift, min_input_cost=min_input_cost)
        self.probe_budget = float(probe_budget)
        self.realized = bool(realized)
        self._steps_seen: dict[tuple[int, bool], deque] = {}  # (b, drafted) -> recent (tokens, wall seconds)
        self.per_source = bool(per_source)
        self.price_overhead = bool(price_overhead)
        self.max_skip = int(max_skip)
        self.decay = float(calibration_decay)
        self.min_gain = float(min_gain)
        self._n: dict[int, list[float]] = {}  # source -> discounted verified nodes per confidence bin
        self._acc: dict[int, list[float]] = {}  # source -> discounted accepted nodes per confidence bin
        self.draft_seconds: dict[int, float] = {}  # sequences drafted -> EMA of drafting time (steady steps)
        self.first_draft_seconds: dict[int, float] = {}  # the same, of calls holding a sequence's first drafting
        self.overhead_seconds: dict[tuple[int, bool], float] = {}  # (b, verified a tree) -> EMA of a step's other time
        self._skip_left = 0
        self._skip_next = 1  # the doubling part of the next skip run
        self.last_loss = 0.0  # seconds the last unpaid drafted step lost against plain decoding
        # counters (reported by the harness / tests)
        self.steps = self.skipped_steps = self.plain_steps = self.nodes_offered = self.nodes_verified = 0
        self.profiles = 0  # drafted steps that verified b nodes to measure the cost per input (module doc)
        self.realized_stops = 0  # skip runs started because the measured rates said drafting loses
        self.probes = 0  # drafted steps where only probe_rows sequences drafted (module doc)

    # -- calibration -------------------------------------------------------------------------------
    def _bin(self, raw: float) -> int:
        return min(bisect.bisect_left(self.BINS, raw), len(self.BINS) - 1)

    def calibrated(self, raw: float, source: int = 0) -> float:
        """P(node accepted) for a node of raw confidence ``raw`` from ``source`` (0 the drafter, 1 SSSD,
        2 both): its source's bin's discounted acceptance frequency with one pseudo-observation at
        ``raw`` itself as prior."""
        i = self._bin(raw)
        source = source if self.per_source else 0
        n, acc = self._n.get(source), self._acc.get(source)
        if n is None:
            return raw
        return (acc[i] + raw) / (n[i] + 1.0)

    def observe_acceptance(self, tree: DraftTree, raw: Sequence[float], accepted_tokens: Sequence[int]) -> None:
        """One verified tree: its nodes' raw values and the draft tokens the verifier accepted (in order);
        ``tree.sources`` (if set) says whose bins each node's outcome goes to."""
        if tree.n == 0:
            return
        on_path, node, kids, toks = set(), -1, tree.children(), tree.tokens.tolist()
        for t in accepted_tokens:  # the accepted nodes: follow the child holding each accepted token
            node = next((c for c in kids[node + 1] if toks[c] == t), None)
            if node is None:
                break
            on_path.add(node)
        for src in self._n:
            self._n[src] = [x * self.decay for x in self._n[src]]
            self._acc[src] = [x * self.decay for x in self._acc[src]]
        sources = tree.sources.tolist() if tree.sources is not None and self.per_source else [0] * tree.n
        for j, (r, src) in enumerate(zip(raw, sources)):
            if src not in self._n:
                self._n[src], self._acc[src] = [0.0] * len(self.BINS), [0.0] * len(self.BINS)
            i = self._bin(float(r))
            self._n[src][i] += 1.0
            self._acc[src][i] += 1.0 if j in on_path else 0.0

    # -- measured costs and rates ---------------------------------------------------------------------
    def observe_draft(self, batch: int, seconds: float, first: bool = False) -> None:
        """One drafting call's wall time (seconds) for ``batch`` sequences drafted; ``first``: the call held
        some sequence's first drafting (the drafter's prefill over its prompt, paid once per sequence),
        which only stands in for the per-step cost until a steady call is measured (:meth:`draft_cost`)."""
        table = self.first_draft_seconds if first else self.draft_seconds
        old = table.get(batch)
        table[batch] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def draft_cost(self, rows: int) -> float:
        """Predicted seconds to draft ``rows`` sequences: measured at that count, else the nearest measured
        count scaled in proportion; from steady calls, or where none was measured yet from calls holding a
        first drafting (an overestimate); 0 when nothing was measured."""
        table = self.draft_seconds or self.first_draft_seconds
        if rows in table:
            return table[rows]
        if not table:
            return 0.0
        near = min(table, key=lambda r: (abs(r - rows), -r))
        return table[near] * rows / near

    def observe_overhead(self, batch: int, drafted: bool, seconds: float) -> None:
        """One engine step's wall time outside drafting and the verification forward (seconds, >= 0);
        ``drafted``: the step verified a tree."""
        key = (batch, bool(drafted))
        old = self.overhead_seconds.get(key)
        self.overhead_seconds[key] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def observe_step(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One whole engine step: ``tokens`` committed over all its sequences in ``seconds`` of wall time
        (drafting, forward, acceptance, bookkeeping); ``drafted``: it drafted (whether or not it verified a tree)."""
        key = (int(batch), bool(drafted))
        if key not in self._steps_seen:
            self._steps_seen[key] = deque(maxlen=self.REALIZED_WINDOW)
        self._steps_seen[key].append((int(tokens), float(seconds)))

    def realized_rate(self, batch: int, drafted: bool) -> float | None:
        """Tokens per second of the recent drafting (or plain) steps at ``batch`` (sum of tokens over sum of
        seconds, last ``REALIZED_WINDOW``); None with fewer than ``REALIZED_MIN`` of them."""
        seen = self._steps_seen.get((int(batch), bool(drafted)))
        if not seen or len(seen) < self.REALIZED_MIN:
            return None
        seconds = sum(s for _, s in seen)
        return sum(t for t, _ in seen) / seconds if seconds > 0 else None

    # -- the choice -----------------------------------------------------------------------------------
    def should_draft(self, batch: int) -> bool:
        """False while a skip run is in progress, and on the first ``plain_first`` steps at a batch size:
        plain decoding's forward, the reference of every choice, is measured first."""
        if self.cost.samples(batch, batch) < self.plain_first:
            self.skipped_steps += 1
            self.steps += 1
            return False
        if self._skip_left > 0:
            self._skip_left -= 1
            self.skipped_steps += 1
            self.steps += 1
            return False
        return True

    def draft_rows(self, batch: int) -> int:
        """How many of the ``batch`` sequences draft this step: all where ``batch`` <= ``probe_rows`` or where
        drafting was last judged to pay at this or a larger batch size, else ``probe_rows`` (module doc)."""
        if batch <= self.probe_rows or any(p >= batch for p in self._pays):
            return batch
        return self.probe_rows

    @staticmethod
    def raw_values(tree: DraftTree) -> list[float]:
        """Each node's uncalibrated acceptance estimate: the tree's path scores, or (none given) the
        parent's value split evenly among siblings (a chain: 1 per node, left to the calibration)."""
        if tree.scores is not None:
            return [float(x) for x in tree.scores.tolist()]
        kids = tree.children()
        vals: list[float] = []
        for i, p in enumerate(tree.parents.tolist()):
            vals.append((1.0 if p < 0 else vals[p]) / len(kids[p + 1]))
        return vals

    def plan(self, trees: Sequence[DraftTree], drafted: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """Which nodes of each tree to verify this step (the step drafted: :meth:`should_draft` said so).

        Args:
            trees: one per sequence of the step.
            drafted: how many of them drafted (:meth:`draft_rows`; the others are empty trees); None = all.
                Fewer than ``len(trees)``: a probe, whose judgement prices drafting every row (module doc).

        Returns:
            (keep, raw): per tree, the kept node indices (ascending, ancestor-closed; [] = plain decoding
            for that sequence) and every node's raw value (for :meth:`observe_acceptance`).
        """
        b = len(trees)
        rows = b if drafted is None else max(1, min(int(drafted), b))
        self.steps += 1
        self.probes += rows < b
        raws = [self.raw_values(t) for t in trees]
        cands = []  # (-value, depth, tree, node)
        for i, (t, raw) in enumerate(zip(trees, raws)):
            depth, par, val = t.depth().tolist(), t.parents.tolist(), []
            src = t.sources.tolist() if t.sources is not None else [0] * t.n
            for j, (d, p, r) in enumerate(zip(depth, par, raw)):
                v = self.calibrated(r, src[j])
                if p >= 0:
                    v = min(v, val[p])  # never above the parent: the best K stay ancestor-closed
                val.append(v)
                cands.append((-v, d, i, j))
        cands.sort()
        self.nodes_offered += len(cands)
        t_plain = self.cost.predict(b, b)
        t_draft = self.draft_cost(rows)
        o_plain = self.overhead_seconds.get((b, False), 0.0) if self.price_overhead else 0.0
        o_tree = self.overhead_seconds.get((b, True), o_plain) if self.price_overhead else 0.0
        gain = None  # predicted rate over plain decoding's; None: nothing measured yet (verify everything)
        gain_all = None  # a probe's: the predicted rate of drafting every row over plain decoding's
        best_k = len(cands)
        if t_plain is not None:
            plain_rate = b / (t_plain + o_plain)
            if not self.cost.slope_known(b) and cands:  # the profile: measure what b more inputs cost
                best_k = min(b, len(cands))
                self.profiles += 1
            else:
                best_k, best_rate = self._best(cands, b, t_draft, t_plain + o_plain, o_tree)
                gain = best_rate / plain_rate
                if rows < b:  # a probe: what drafting every row would bring, its rows' nodes b / rows times over
                    gain_all = self._best(cands, b, self.draft_cost(b), t_plain + o_plain, o_tree, b / rows)[1] / plain_rate
        keep: list[list[int]] = [[] for _ in trees]
        gained = 0.0  # expected accepted nodes of what is verified
        for neg_v, _, i, j in cands[:best_k]:
            keep[i].append(j)
            gained -= neg_v
        for k in keep:
            k.sort()
        self.nodes_verified += best_k
        self.plain_steps += best_k == 0
        if t_plain is not None:
            self._judge(b, gain, t_draft + self.cost.predict(b, b + best_k) + (o_tree if best_k else o_plain),
                        b + gained, plain_rate, gain_all)  # fmt: skip
        return keep, raws

    def _best(self, cands: list, b: int, t_draft: float, t_plain_step: float, o_tree: float,
              scale: float = 1.0) -> tuple[int, float]:
        """(K, tokens/s) maximising ``(b + scale * sum_{k<=K} v_k) / (t_draft + t(b, b + scale * K) + o_tree)``
        over the sorted candidates (K = 0: a plain step with the drafting spent, ``b / (t_draft + t_plain_step)``);
        ``scale`` > 1 prices every row's drafting from a probe's rows (module doc)."""
        expected = float(b)
        best_k, best_rate = 0, b / (t_draft + t_plain_step)
        for k, (neg_v, *_rest) in enumerate(cands, start=1):
            expected -= scale * neg_v
            rate = expected / (t_draft + self.cost.predict(b, b + round(scale * k)) + o_tree)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def _judge(self, b: int, gain: float | None, t_step: float, tokens: float, plain_rate: float,
               gain_all: float | None = None) -> None:  # fmt: skip
        """Whether the next step drafts (module doc): the measured rates once known, else ``gain`` (None: a
        profile, no judgement); where not, a skip run priced by this step's predicted loss (or the
        measured loss of a drafting step), doubling per unpaid step in a row, at most ``max_skip``.
        ``gain_all`` (a probe's): drafting every row pays from the next step where it reaches ``min_gain``;
        else the probe's own ``gain`` says whether to probe again or skip."""
        if gain_all is not None and gain_all >= self.min_gain:
            self._skip_next = 1
            self._pays.add(b)
            return
        done = self.realized_rate(b, True) if self.realized else None
        if done is not None:
            plain = self.realized_rate(b, False) or plain_rate
            unpaid = done < self.min_gain * plain
            if unpaid:
                seen = self._steps_seen[(b, True)]
                n = len(seen)
                t_step = sum(s for _, s in seen) / n  # the measured drafting step, not the prediction
                tokens, plain_rate = sum(t for t, _ in seen) / n, plain
                self.realized_stops += gain is None or gain >= self.min_gain
        elif gain is None:
            return
        else:
            unpaid = gain < self.min_gain or tokens <= b  # verifying nothing: the drafting brought nothing
        if not unpaid:
            self._skip_next = 1
            if gain_all is None:  # a probe that pays for itself probes again: drafting every row does not yet pay
                self._pays.add(b)
            return
        self._pays.discard(b)
        self.last_loss = max(0.0, t_step - tokens / plain_rate)
        priced = math.ceil(self.last_loss * plain_rate / (self.probe_budget * b) - 1.0)  # t_plain_step = b / plain_rate
        self._skip_left = min(max(self._skip_next, priced), self.max_skip)
        self._skip_next = min(2 * self._skip_next, self.max_skip)

    def summary(self) -> dict:
        return {"steps": self.steps, "skipped_drafting": self.skipped_steps, "plain_steps": self.plain_steps,
                "drafted_steps": self.steps - self.skipped_steps, "profiles": self.profiles, "probes": self.probes,
                "realized_stops": self.realized_stops, "host_speed": round(self.cost.speed, 3),
                "nodes_offered": self.nodes_offered, "nodes_verified": self.nodes_verified,
                "overhead_ms": {f"b{b}_{'drafted' if d else 'plain'}": round(1e3 * v, 2)
                                for (b, d), v in sorted(self.overhead_seconds.items())},
                # the costs the last choices were made on: forward ms by batch size and inputs, drafting ms by sequences
                "forward_ms": {f"b{b}": {m: round(1e3 * t, 2) for m, t in self.cost.measured(b).items()}
                               for b in sorted(self.cost.batch_sizes())},
                "draft_ms": {r: round(1e3 * t, 2) for r, t in sorted(self.draft_seconds.items())},
                # what the recent steps did, tokens per second (the realized rates: module doc)
                "realized_tok_s": {f"b{b}_{'drafted' if d else 'plain'}": round(r, 1) for (b, d) in sorted(self._steps_seen)
                                   if (r := self.realized_rate(b, d)) is not None},
                "calibration": {f"<={e}" if src == 0 else f"{self.SOURCE_NAMES.get(src, src)} <={e}":
                                round((a + 1e-9) / (n + 1e-9), 3)
                                for src in sorted(self._n) for e, a, n in zip(self.BINS, self._acc[src], self._n[src])
                                if n > 0.5}}  # fmt: skip


def subtree(tree: DraftTree, keep: Sequence[int]) -> DraftTree:
    """The nodes ``keep`` (ascending, ancestor-closed) of ``tree`` as a tree of their own (re-indexed;
    draft_probs rows, dist_index, scores and sources carried over)."""
    if len(keep) == tree.n:
        return tree
    if not keep:
        return DraftTree.empty()
    new_index = {j: k for k, j in enumerate(keep)}
    par = tree.parents.tolist()
    idx = torch.tensor(list(keep), dtype=torch.long, device="cpu")  # host-side tree bookkeeping (verify.tree)
    parents = torch.tensor([new_index[par[j]] if par[j] >= 0 else -1 for j in keep], dtype=torch.long, device="cpu")
    return DraftTree.trusted(tree.tokens[idx], parents, tree.draft_probs,
                             None if tree.dist_index is None else tree.dist_index[idx],
                             None if tree.scores is None else tree.scores[idx],
                             sources=None if tree.sources is None else tree.sources[idx])  # fmt: skip


class PlannedProposer:
    """Wraps a proposer so that a :class:`SpeculationPlanner` decides, every step, how much of its
    trees the engine verifies, and whether to draft at all.

    Steps without drafting return empty trees (plain decoding). The items the engine hands over
    meanwhile (``start`` of a new sequence, ``commit`` after each step) are kept and given to the inner
    proposer just before its next ``draft``: consecutive commits as one (their items are consecutive:
    zip(tokens, hidden) stays the item stream), a start followed by commits as one start whose prompt
    runs up to the last committed token. So a drafter with its own KV cache (ParallelSpec, EAGLE)
    stays in step with the target. The engine reports every verification forward's time through
    :meth:`observe_forward`.

    Args:
        inner: a proposer whose trees the engine's own acceptance rule verifies (no ``accept`` of its own).
        planner: default a fresh :class:`SpeculationPlanner`.
        clock: seconds now (default :func:`time.perf_counter`): every time the planner decides by (drafting,
            steps) is read from it; a simulation passes a fake one (the engine reports forward times itself).

    Raises:
        ValueError: ``inner`` brings its own acceptance rule (its trees' meaning is its own).
    """

    def __init__(self, inner, planner: SpeculationPlanner | None = None, clock: Callable[[], float] = time.perf_counter):
        if getattr(inner, "accept", None) is not None:
            raise ValueError(f"proposer {getattr(inner, 'name', inner)!r} has its own acceptance rule; plan=false for it")
        self.inner = inner
        self.planner = planner or SpeculationPlanner()
        self.clock = clock
        self.name = getattr(inner, "name", "proposer")
        self.lossless = getattr(inner, "lossless", True)
        self._starts: dict[int, tuple[list[int], torch.Tensor, int]] = {}  # slot -> start not yet handed on
        self._pending: dict[int, list[tuple[list[int], torch.Tensor]]] = {}  # slot -> commits not yet handed on
        self._inner_live: set[int] = set()
        self._verified: dict[int, tuple[DraftTree, list[float]]] = {}  # slot -> (verified tree, raw values)
        # the step in progress, for its overhead (module doc): [start, b, verified a tree, drafting seconds,
        # forward seconds, drafted]
        self._step: list | None = None
        self._step_tokens = 0  # tokens committed by the step in progress (its realized rate)

    def __getattr__(self, name):  # widths, budget, template, ... of the inner proposer
        if name in ("inner", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self._step = None  # a prefill ran since the last step started: that step's wall time is not its own
        self._pending.pop(slot, None)
        self._verified.pop(slot, None)
        self._starts[slot] = (list(prompt_ids), hidden, int(first_token))

    def _behind(self, slot) -> tuple[int, int]:
        """How much the inner proposer must read before ``slot`` can draft: (1 for a first drafting, whose
        prompt it has not seen; 0 else, tokens held since its last drafting): a probe's choice of rows."""
        held = sum(len(tk) for tk, _ in self._pending.get(slot, []))
        return (1, len(self._starts[slot][0]) + held) if slot in self._starts else (0, held)

    def _close_step(self, now: float) -> None:
        """The previous step ended now: report its time outside drafting and its forward."""
        st, self._step = self._step, None
        if st is not None and st[4] is not None:
            start, b, verified, t_draft, t_fwd, drafted = st
            self.planner.observe_overhead(b, verified, max(0.0, now - start - t_draft - t_fwd))
            # a step that drafted counts as drafting even where it verified nothing: its drafting was spent
            if drafted is not None:  # None: a probe (SpeculationPlanner.draft_rows)
                self.planner.observe_step(b, drafted, now - start, self._step_tokens)

    def step_done(self) -> None:
        """The engine finished this step (committed every sequence): its overhead is measured up to
        here, so that steps of other engines run in between (lock-step timing) do not count."""
        self._close_step(self.clock())

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        t0 = self.clock()
        self._close_step(t0)  # an engine that does not call step_done: the step ends at the next draft
        slots = list(slots)
        b = len(slots)
        self._verified.clear()
        self._step_tokens = 0
        if not slots:
            return []
        if not self.planner.should_draft(b):
            self._step = [t0, b, False, 0.0, None, False]
            return [DraftTree.empty() for _ in slots]
        rows = self.planner.draft_rows(b)
        drafting = slots if rows >= b else sorted(slots, key=self._behind)[:rows]  # a probe: the rows in step first
        starts = any(s in self._starts for s in drafting)  # a sequence's first drafting: its prompt's prefill
        self._flush(drafting)  # catching the drafter up (after a skip run: several tokens) is drafting time
        drafted = dict(zip(drafting, self.inner.draft(drafting, sampling, generator)))
        trees = [drafted.get(s, DraftTree.empty()) for s in slots]
        t_draft = self.clock() - t0
        self.planner.observe_draft(len(drafting), t_draft, first=starts)
        # a probe's step is neither a drafting nor a plain step of the measured rates (its rows drafted, not the batch)
        self._step = [t0, b, True, t_draft, None, True if rows >= b else None]
        keep, raws = self.planner.plan(trees, drafted=len(drafting))
        self._step[2] = any(keep)  # a tree was verified: the step's overhead is a drafted step's
        out = []
        for s, t, k, raw in zip(slots, trees, keep, raws):
            sub = subtree(t, k)
            self._verified[s] = (sub, [raw[j] for j in k])
            out.append(sub)
        return out

    def commit(self, slot, tokens, hidden) -> None:
        ver = self._verified.pop(slot, None)
        if ver is not None:
            self.planner.observe_acceptance(ver[0], ver[1], list(tokens)[:-1])
        # handed on just before the inner proposer's next draft (which may be steps away: the inner
        # proposer keeps only the last commit until it drafts)
        self._pending.setdefault(slot, []).append((list(tokens), hidden))
        self._step_tokens += len(tokens)

    def release(self, slot) -> None:
        self._starts.pop(slot, None)
        self._pending.pop(slot, None)
        self._verified.pop(slot, None)
        if slot in self._inner_live:
            self._inner_live.discard(slot)
            self.inner.release(slot)

    def observe_forward(self, batch: int, inputs: int, seconds: float) -> None:
        """The engine's report of one verification forward (b sequences, M inputs, wall seconds)."""
        self.planner.cost.observe(batch, inputs, seconds)
        if self._step is not None and self._step[4] is None:
            self._step[4] = seconds

    def _flush(self, slots) -> None:
        for s in slots:
            items = self._pending.pop(s, None) or []
            toks = [t for tk, _ in items for t in tk]
            hid = (torch.cat([h for _, h in items]) if len(items) > 1 else items[0][1]) if items else None
            st = self._starts.pop(s, None)
            if st is not None:  # start(prompt, h, first) + commits (T, H) == start(prompt + [first] + T[:-1], [h; H], T[-1])
                prompt, h0, first = st
                if toks:
                    prompt, first, h0 = prompt + [first] + toks[:-1], toks[-1], torch.cat([h0, hid])
                self.inner.start(s, prompt, h0, first)
                self._inner_live.add(s)
            elif toks:
                self.inner.commit(s, toks, hid)
