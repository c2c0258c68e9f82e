"""Speculation that never loses: per step, verify only the draft nodes whose expected gain pays for their cost.

SSSD (Marzollo et al. 2024, §3.2, Fig. 2) picks the speculation length once per batch size from a measured
forward-time table: "the theoretical end-to-end speedup and the optimal speculation length are obtained
by dividing the algorithmic acceleration by the increase in cost" (:func:`drafttrain.verify.sssd.plan_speculation_length`:
size n maximising ``b * tau(n) / t(b, n + 1)``). :class:`SpeculationPlanner` does the same **online and
per step**, with the drafter's own confidence in place of a fixed tau table:

- **Acceleration.** A draft node is accepted exactly when its whole path is the target's continuation;
  siblings exclude each other, so the expected tokens a tree emits are ``1 + sum_j P(node j accepted)``
  (bonus included). The drafter's path confidence (:attr:`~drafttrain.verify.tree.DraftTree.scores`:
  product of its probabilities along the path) estimates P after calibration against what the
  verifier actually accepted: verified nodes are binned by confidence and each bin's discounted
  acceptance frequency, with one pseudo-observation at the bin's own confidence as prior, is the
  estimate (a histogram calibration, learnt online). Each node source
  (:attr:`~drafttrain.verify.tree.DraftTree.sources`: the drafter, SSSD's training-free candidates
  in a hybrid tree, or both) has its own bins: a drafter probability and an SSSD pseudo-probability
  of the same value do not mean the same chance of acceptance. A node is never valued above its parent, so the
  best K nodes of the batch are always ancestor-closed.
- **Cost.** ``t(b, M)``: the measured seconds of one verification forward of b sequences with M inputs in
  total (every verification forward is reported by the engine: :meth:`PlannedProposer.observe_forward`),
  median of the recent measurements per (b, M) in units of the host's current speed (a shared CPU's
  speed drifts; :class:`ForwardCostModel`), linear interpolation between measured M (as SSSD's
  planner interpolates its table), beyond the measured range the per-input slope measured at the
  nearest batch size (continuous batching changes b each time a sequence ends), and where no batch
  size has measured one *optimistic* (flat) up to twice the largest measured M, so a size up to
  double is tried once and gives the slope, then each further input at the largest measured forward's
  average cost per input (a first step at batch 16 would otherwise verify ~200 nodes at ~5x a plain
  step); plus the measured drafting time; plus each step's
  **overhead**, measured too: the wall time of a whole engine step (from its ``draft`` call to the
  engine's ``step_done``, else to the next ``draft``:
  drafting, building the tree inputs, the forward, acceptance, KV-cache moves, committing to the
  drafter) minus its drafting and forward time, kept per batch size apart for drafted and plain steps.
  A drafting call that holds a sequence's first drafting (the drafter's prefill over its whole prompt,
  paid once per sequence: ~35 ms against ~5 ms for a step at batch 1) is kept out of the drafting-time
  estimate once a steady step has been measured (it only stands in before that); fed to it, that one
  call kept drafting looking unprofitable for the next tens of steps of every new prompt (the estimate
  is a moving average, and skip runs bring no new measurement).
  A tree step's bookkeeping grows with the batch, so at batch 16 the forward time alone
  under-prices a drafted step; a prefill between two steps (continuous batching) is never counted
  (with ``step_done`` the step has ended before it; without, that step is dropped).
- **Choice.** With the batch's nodes sorted by value v_(1) >= v_(2) >= ..., the step verifies the K
  best, K maximising ``(b + sum_{k<=K} v_(k)) / (t_draft + t(b, b + K) + o_tree(b))`` (SSSD's ratio with
  b sequences and a tree size summed over the batch; ``o_tree`` the measured overhead of a step that
  verifies a tree, ``o_plain`` of one that does not); K = 0 is plain decoding,
  ``b / (t_draft + t(b, b) + o_plain(b))``. When even the best K does not beat plain decoding
  (``b / (t(b, b) + o_plain(b))``, no drafting), the next steps skip drafting altogether, then draft
  again to re-measure. That next drafting is a probe: each sequence's best node is verified whatever
  its estimate, so an under-confident drafter's calibration still gets evidence.
- **Priced probes.** A step that drafts and does not pay loses ``L = T - E / r_plain`` seconds against
  plain decoding (T its predicted time: drafting, the forward of the nodes it verifies, its overhead;
  E its expected tokens; r_plain plain decoding's tokens per second at this batch size). The skip run
  after it is long enough that this loss is at most ``probe_budget`` of the run's plain time,
  ``n >= L / (probe_budget * t_plain_step) - 1`` steps, and at least the doubling run (1, 2, 4, ...)
  of consecutive unpaid steps; at most ``max_skip``. So a cheap drafter at batch 1 (one drafter pass
  beside a ~100 ms forward) is re-tried every few steps, while at batch 16 on a compute-bound CPU,
  where drafting 16 sequences and verifying 16 probe nodes costs about a whole plain step, probes
  come tens of steps apart: a drafter that never pays costs about ``probe_budget`` of plain speed.
  With ``probe_decay`` the budget halves with every further unpaid drafted step in a row (the k-th
  is priced at ``probe_budget / 2^(k-1)``, the same doubling as the unpriced runs), so a drafter that
  keeps not paying costs less and less. Measured on the main job's batch-16 evaluation (127 steps, a
  probe losing 7-38 ms against a ~80 ms plain step): the gaps between probes were 8, 6, 5, 9, 17, 33
  steps without it (priced runs of a few steps, then the doubling runs), 7 probes in all.
- **Row probes.** Above ``probe_rows`` sequences, a probe drafts only ``probe_rows`` of them (those the
  drafter already follows first, so a probe's catch-up is the tokens since the last one) and returns
  empty trees for the others. Whether drafting pays is then
  judged for the whole batch: each drafted node stands for ``b / probe_rows`` of them, and drafting b
  sequences is priced at the probe's drafting time scaled in proportion; where that pays, the next step
  drafts every sequence, else a skip run follows. So at batch 16, where drafting rarely pays on a
  2-core CPU, a probe no longer pays the drafter's catch-up over all 16 prompts (its first drafting
  runs the drafter over every prompt and builds every SSSD state: ~0.6 s, 2-3% of a 127-step run).
  A row probe verifies only the share of its nodes that the extrapolated whole-batch step would verify
  (the best ``k`` of its nodes, where ``k * b / probe_rows`` is that step's choice): before, the first
  probe at a batch size, whose cost model is still flat up to twice the plain forward's inputs, verified
  every node of its sequences' trees (16 at batch 16: +89 ms against a ~80 ms plain step, measured),
  which no step drafting every sequence would have done.
  With ``probe_grow`` a probe that pays does not commit the whole batch at once: the next drafted steps
  draft twice as many sequences each (4, 8, ... at batch 16), each judged for the whole batch like the
  probe, until all are drafted; a step that does not pay keeps the count (or, once the average gain
  falls below ``min_gain``, starts a skip run, after which a probe drafts ``probe_rows`` again). Two
  sequences are a small sample: in 2 of 6 lock-step runs of the main job's batch-16 evaluation without
  it, a probe's extrapolation said drafting pays and the next step drafted all 16 sequences, whose
  drafting took 565 ms (the drafter's catch-up over 14 prompts, against ~8 ms for a probe) before
  drafting was found not to pay: +0.6 to +0.8 s against plain decoding, 5-7% of the run's time. Growing,
  such a step catches up two more sequences.

- **Realized rates.** The choice above rests on predictions: calibrated acceptance and the cost model.
  Before a skip run starts, the planner also asks what drafting did: the tokens committed per second of
  wall time by the last 24 steps at this batch size that verified a tree, against the same for steps that
  did not draft (the cost model's plain step where fewer than 8 were seen). While drafting measured
  faster, no skip run starts, whatever the predicted gain. Seen without it in batch-1 evaluations of
  main jobs' drafters (lock-step against plain decoding): runs where the planner skipped drafting on
  30-50% of the steps (395 of 799 in one main job, 1.07x) were 0.02-0.15x slower than runs of the same
  drafter and prompts that drafted on nearly every step (1.22-1.26x). Whether drafting measured faster
  than plain steps inside those runs was not recorded; the rule makes the planner ask. In a 10-round
  lock-step bench at batch 1 (docs/benchmarks/planner.md): 1.27x against 1.25x without it, ahead in 7
  rounds of 10.

Lossless: the planner only chooses which nodes of the proposer's tree are verified (an ancestor-closed
subset; under sampling the kept children of a node are its first draws and the choice reads the
sorted probabilities, never which tokens were drawn), so every acceptance rule keeps its guarantee.
Greedy output stays equal to plain greedy decoding token for token.

Shape letters: b sequences in the step, n tree nodes, M verification inputs of the step (b + nodes).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from typing import Sequence

import torch

from drafttrain.sampling import GREEDY
from drafttrain.verify.tree import DraftTree


class ForwardCostModel:
    """Online estimate of ``t(b, M)``, the seconds of one verification forward (b sequences, M inputs in total).

    **Host drift.** The table holds each forward's time divided by the host's speed factor at that moment
    (``drift``): ``speed`` is the median, over the last ``drift_window`` forwards, of measured seconds over
    what the table predicted for that (b, M) before it (a measured size, or between two measured sizes),
    and :meth:`predict` multiplies the table by the current ``speed``. The speed reacts within a few
    forwards (window 5) while the table's median is over more (15), so a change of the host's speed moves
    the speed, not the table (with equal windows the table absorbed it and the speed fell back to 1).
    A shared CPU's speed drifts by 10-15% within a minute; without it a size that stopped being chosen
    kept the time it was measured at, while the plain forward, measured every step, followed the host.
    Seen in lock-step batch-1 evaluations of a main job's drafter: in one, the planner decoded plainly for hundreds of steps (433 of ~700 forwards
    plain, tau 1.35, 1.12x), its table holding t(1, 2) 23% above t(1, 1) where a 2-token forward costs
    about what a 1-token one does (docs/benchmarks/forward_cost.md); another of the same drafter and
    prompts drafted throughout (tau 1.73, 1.25x). Over 19 such evaluations tau spread over 1.14-1.75.

    Args:
        window: recent measurements kept per (b, M) (their median is the estimate); None = 15 with
            ``drift``, 5 without (the model before it).
        explore: "double" (flat up to twice the largest measured M, then the average cost per input, where
            no slope is known: :meth:`predict`) or "flat" (flat however far: the model before "double").
        drift: follow the host's speed (above); False = absolute times (the model before it).
        drift_window: forwards whose ratios set ``speed``.
        min_samples: a forward size measured fewer times than this and far dearer than the well-measured
            sizes say is taken at their value (:meth:`_table`); 1 = each size's own median however few
            its measurements (the model before it).

    Raises:
        ValueError: an unknown ``explore``, or ``drift_window`` or ``min_samples`` < 1.
    """

    #: a sparsely measured size dearer than this times what the well-measured sizes say is an outlier (:meth:`_table`)
    OUTLIER = 1.3

    def __init__(self, window: int | None = None, explore: str = "double", drift: bool = True, drift_window: int = 5,
                 min_samples: int = 3):  # fmt: skip
        if explore not in ("double", "flat"):
            raise ValueError(f"explore must be double or flat, got {explore!r}")
        if drift_window < 1:
            raise ValueError(f"drift_window must be >= 1, got {drift_window}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = int(min_samples)
        self.window = int(window) if window is not None else (15 if drift else 5)
        self.explore = explore
        self.drift = bool(drift)
        self._ratios: deque = deque(maxlen=int(drift_window))  # measured / predicted, the last forwards
        self.speed = 1.0  # the host's speed factor now: measured seconds over the table's (1.0 until measured)
        self._obs: dict[int, dict[int, deque]] = {}  # b -> M -> recent seconds
        self._tables: dict[int, dict[int, float]] = {}  # b -> measured(b), until the next observation at b
        self._raw: dict[int, dict[int, float]] = {}  # b -> the medians alone (no optimism), the speed's reference
        self._slopes: dict[int, float | None] = {}  # b -> marginal(b), until the next observation

    def observe(self, batch: int, inputs: int, seconds: float) -> None:
        """One forward of ``batch`` sequences with ``inputs`` inputs in total took ``seconds`` (wall time)."""
        seconds = float(seconds)
        if self.drift:
            ref = self._within(batch, inputs, self._raw_table(batch))
            if ref is not None and ref > 0.0 and seconds > 0.0:
                self._ratios.append(seconds / ref)
                self.speed = statistics.median(self._ratios)
            seconds /= self.speed
        self._obs.setdefault(int(batch), {}).setdefault(int(inputs), deque(maxlen=self.window)).append(seconds)
        self._tables.pop(int(batch), None)
        self._raw.pop(int(batch), None)
        self._slopes.clear()

    def _within(self, batch: int, inputs: int, table: dict[int, float] | None = None) -> float | None:
        """The table's value (speed-free) for (b, M) where M was measured at b or lies between two measured
        sizes; None outside (an extrapolation is no reference for the host's speed). ``table``: default
        :meth:`_table` (the one predictions use)."""
        return _between(self._table(batch) if table is None else table, inputs)

    def batch_sizes(self) -> list[int]:
        """The batch sizes some forward was measured at."""
        return list(self._obs)

    def measured(self, batch: int) -> dict[int, float]:
        """{M: seconds} measured at batch size ``batch`` (the median of the recent forwards of each size, at
        the host's current speed)."""
        return {m: self.speed * t for m, t in self._table(batch).items()}

    def _raw_table(self, batch: int) -> dict[int, float]:
        """{M: median of the recent forwards} at ``batch`` (speed-free), cached until the next observation."""
        table = self._raw.get(int(batch))
        if table is None:
            table = {m: statistics.median(d) for m, d in sorted(self._obs.get(int(batch), {}).items())}
            self._raw[int(batch)] = table
        return table

    def _table(self, batch: int) -> dict[int, float]:
        """measured(batch) in speed-free units, cached until the next observation (the planner asks for every
        candidate tree size of every step): the medians, except that a size with fewer than ``min_samples``
        measurements and more than ``OUTLIER`` times dearer than the well-measured sizes (those with
        ``min_samples`` or more) say it should be (:func:`_no_dearer`: between two of them, below the
        smallest, or beyond them along their last slope; a size beyond a single well-measured one keeps
        its own median) is taken at their value until its own median rests on ``min_samples`` forwards.
        One forward at a bad moment (a 6-input forward measured at 2.2x a 1-input one, seen in a main
        job's batch-1 evaluation, where forward_cost.md measures 1.2x) otherwise kept that size and every
        size above it looking dear for the rest of the run: the planner stopped choosing it, so nothing
        re-measured it. Only outliers: a first version that took every sparsely measured size at the
        well-measured sizes' value had the planner measure every size up to 12 inputs at batch 1 and
        read 1.22x against 1.24x without it in one bench (docs/benchmarks/planner.md)."""
        table = self._tables.get(int(batch))
        if table is None:
            table = dict(self._raw_table(batch))
            obs = self._obs.get(int(batch), {})
            well = {m: t for m, t in table.items() if len(obs[m]) >= self.min_samples}
            if well and len(well) < len(table):
                for m in table:
                    bound = None if m in well else _no_dearer(well, m)
                    if bound is not None and table[m] > self.OUTLIER * bound:
                        table[m] = bound
            self._tables[int(batch)] = table
        return table

    def marginal(self, batch: int) -> float | None:
        """Seconds per extra input beyond the plain forward (in the table's speed-free units: times
        ``speed`` for the host now), from the batch size nearest to ``batch`` that has both t(b', b') and a
        larger measured size (None when none has)."""
        if batch in self._slopes:
            return self._slopes[batch]
        best = None
        for b2, obs in self._obs.items():
            if b2 in obs and max(obs) > b2:
                table = self._table(b2)
                top = max(table)
                slope = max(0.0, (table[top] - table[b2]) / (top - b2))
                key = (abs(b2 - batch), -b2)
                if best is None or key < best[0]:
                    best = (key, slope)
        self._slopes[batch] = None if best is None else best[1]
        return self._slopes[batch]

    def predict(self, batch: int, inputs: int) -> float | None:
        """Seconds for (b, M) at the host's current speed (:meth:`_predict_table`); None when nothing was
        measured at this batch size."""
        t = self._predict_table(batch, inputs)
        return None if t is None else self.speed * t

    def _predict_table(self, batch: int, inputs: int) -> float | None:
        """Seconds for (b, M): the median where measured, linear between measured M; beyond the largest
        measured M, the per-input slope measured at the nearest batch size (:meth:`marginal`; under
        continuous batching b changes every time a sequence ends, and each new b would otherwise get
        one full-tree verification to learn what a neighbour already knows); where no batch size has
        a slope yet, flat up to twice the largest measured M (optimistic, so a size up to double is
        tried once and gives the slope) and beyond that each further input at the largest forward's
        average cost per input (compute-bound: at batch 16 a first full-tree verification of ~200
        inputs would cost ~5 plain steps to learn what 16 extra inputs show); None when nothing was
        measured at this batch size."""
        table = self._table(batch)
        if not table:
            return None
        inside = self._within(batch, inputs)
        if inside is not None:
            return inside
        ms = list(table)
        if inputs < ms[0]:
            return table[ms[0]]
        top = ms[-1]
        slope = self.marginal(batch)
        if slope is not None:
            return table[top] + slope * (inputs - top)
        if self.explore == "flat":
            return table[top]
        return table[top] + max(0, inputs - 2 * top) * table[top] / top


def _between(points: dict[int, float], x: int) -> float | None:
    """``points[x]`` ({M: seconds}, sorted by M) where x is one of them, linear between the two around it;
    None outside their range (or with no points)."""
    if x in points:
        return points[x]
    xs = list(points)
    i = bisect.bisect_left(xs, x)
    if i == 0 or i == len(xs):
        return None
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def _no_dearer(points: dict[int, float], x: int) -> float | None:
    """What the well-measured forward sizes ``points`` ({M: seconds}, sorted by M, at least one) say a forward
    of ``x`` inputs costs at most: linear between the two around it (:func:`_between`); before the first,
    the first's time (a forward with fewer inputs costs no more); beyond the last, along the last two sizes'
    slope (not below flat); None beyond a single point (no slope is known: at batch 16 only the plain
    forward is measured often, and a flat guess there would price every draft node as free)."""
    inside = _between(points, x)
    if inside is not None:
        return inside
    xs = list(points)
    if x < xs[0]:
        return points[xs[0]]
    if len(xs) == 1:
        return None
    x0, x1 = xs[-2], xs[-1]
    return points[x1] + max(0.0, (points[x1] - points[x0]) / (x1 - x0)) * (x - x1)


class SpeculationPlanner:
    """The per-step choice of how many draft nodes to verify (module docstring).

    Args:
        max_skip: longest run of steps without drafting after a step where drafting did not pay.
        probe_budget: the fraction of plain decoding's time a step that drafted and did not pay may cost
            (module doc, "Priced probes"): its loss sets the length of the next skip run; None = the
            doubling runs alone (1, 2, 4, ... up to ``max_skip``: the planner before priced probes).
        skip_on_average: start a skip run only when drafting does not pay *on average* at this batch
            size (the moving average of the drafted steps' gain, weight 0.3 on the newest, below
            ``min_gain``), not at every step whose own best choice did not pay; a batch size without
            that average yet uses the step's own gain. False = the step's own gain (the planner before
            this option; ``scripts.bench_planner`` variants ``full`` and ``priced``).
        explore: the cost model's guess beyond what was measured (:class:`ForwardCostModel`).
        calibration_decay: discount of old evidence in the per-depth calibration (per observed step).
        min_gain: drafting must promise at least this factor over plain decoding (1.0 = any gain).
        per_source: calibrate each node source (:attr:`DraftTree.sources`) on its own bins; False = one
            set of bins for all (the planner before per-source calibration; ``scripts.bench_planner``).
        price_overhead: add each step's measured overhead to its price; False = forward + drafting
            time only (measured and reported all the same).
        probe_rows: at a batch size above it, a probe (the first drafting at a batch size, and the first
            after a skip run) drafts only this many sequences, not the whole batch (module doc,
            "Row probes"); None = every probe drafts the whole batch (the planner before row probes).
        probe_decay: halve the budget of each further unpaid drafted step in a row (module doc, "Priced
            probes"); False = every unpaid step priced at ``probe_budget`` (the planner before it).
        probe_share: a row probe verifies only its share of what the whole-batch step would verify
            (module doc, "Row probes"); False = the probe's own best choice (the planner before it).
        probe_grow: where a row probe says drafting pays, the next drafted steps double the sequences
            drafted (2, 4, 8, ..., judged each time like a probe) instead of drafting the whole batch at
            once (module doc, "Row probes"); False = the whole batch right after the probe (the planner
            before it).
        drift: the cost model follows the host's speed (:class:`ForwardCostModel`); False = absolute
            times (the planner before it).
        min_samples: the cost model's trust in a forward size's own median (:class:`ForwardCostModel`); 1 =
            trusted from its first measurement (the planner before it).
        realized: before a skip run, also ask what drafting *did* (module doc, "Realized rates"): while the
            recent drafted steps at this batch size emitted more tokens per second (measured: tokens
            committed over each step's wall time) than plain decoding does, no skip run starts, whatever
            the predicted gain; False = the prediction alone (the planner before it).

    Raises:
        ValueError: ``max_skip`` < 1, ``probe_budget`` outside (0, 1), ``probe_rows`` < 1, or an unknown
            ``explore``.
    """

    #: names of the node sources other than the drafter (:attr:`DraftTree.sources`) in :meth:`summary`
    SOURCE_NAMES = {1: "sssd", 2: "both"}
    #: upper edges of the confidence bins of the calibration
    BINS = (0.001, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

    def __init__(self, max_skip: int = 64, calibration_decay: float = 0.99, min_gain: float = 1.0,
                 per_source: bool = True, price_overhead: bool = True, probe_budget: float | None = 0.03,
                 skip_on_average: bool = True, explore: str = "double", probe_rows: int | None = 2,
                 probe_decay: bool = True, probe_share: bool = True, probe_grow: bool = True,
                 drift: bool = True, min_samples: int = 3, realized: bool = True):  # fmt: skip
        if max_skip < 1:
            raise ValueError(f"max_skip must be >= 1, got {max_skip}")
        if probe_budget is not None and not 0.0 < probe_budget < 1.0:
            raise ValueError(f"probe_budget must be in (0, 1) or None, got {probe_budget}")
        if probe_rows is not None and probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1 or None, got {probe_rows}")
        self.probe_rows = None if probe_rows is None else int(probe_rows)
        self.probe_decay = bool(probe_decay)
        self.probe_share = bool(probe_share)
        self.probe_grow = bool(probe_grow)
        self._grow: int | None = None  # sequences the next drafted step drafts while growing from a row probe
        self.cost = ForwardCostModel(explore=explore, drift=drift, min_samples=min_samples)
        self.probe_budget = None if probe_budget is None else float(probe_budget)
        self.skip_on_average = bool(skip_on_average)
        self.realized = bool(realized)
        # b -> recent steps' (tokens committed, wall seconds), drafted (a tree verified) and plain apart
        self._steps_seen: dict[tuple[int, bool], deque] = {}
        self.gain_average: dict[int, float] = {}  # b -> moving average of the drafted steps' best gain
        self.per_source = bool(per_source)
        self.price_overhead = bool(price_overhead)
        self.max_skip = int(max_skip)
        self.decay = float(calibration_decay)
        self.min_gain = float(min_gain)
        self._n: dict[int, list[float]] = {}  # source -> discounted verified nodes per confidence bin
        self._acc: dict[int, list[float]] = {}  # source -> discounted accepted nodes per confidence bin
        self.draft_seconds: dict[int, float] = {}  # sequences drafted -> EMA of drafting time (steady steps)
        self.first_draft_seconds: dict[int, float] = {}  # the same, of calls holding a sequence's first drafting
        self.overhead_seconds: dict[tuple[int, bool], float] = {}  # (b, drafted) -> EMA of a step's other time
        self._skip_left = 0
        self._skip_next = 1
        self._probe = False
        self.last_loss = 0.0  # seconds the last unpaid drafted step lost against plain decoding (priced probes)
        # counters (reported by the harness / tests)
        self.steps = self.skipped_steps = self.plain_steps = self.nodes_offered = self.nodes_verified = 0
        self.row_probes = 0  # drafted steps that drafted only some of the sequences (probes, growing steps)

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

    def observe_draft(self, batch: int, seconds: float, first: bool = False) -> None:
        """One drafting call's wall time (seconds) for ``batch`` sequences drafted; ``first``: the call held
        some sequence's first drafting (the drafter's prefill over its prompt, paid once per sequence),
        which only stands in for the per-step cost until a steady call is measured (:meth:`draft_cost`)."""
        table = self.first_draft_seconds if first else self.draft_seconds
        old = table.get(batch)
        table[batch] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def draft_cost(self, rows: int) -> float:
        """Predicted seconds to draft ``rows`` sequences: measured at that count, else the nearest measured
        count scaled in proportion (linear in the sequences drafted: a fixed per-call part makes this a
        slight overestimate above the measured count); from steady calls, or where none was measured yet
        from calls holding a first drafting (an overestimate); 0 when nothing was measured."""
        table = self.draft_seconds or self.first_draft_seconds
        if rows in table:
            return table[rows]
        if not table:
            return 0.0
        near = min(table, key=lambda r: (abs(r - rows), -r))
        return table[near] * rows / near

    def draft_rows(self, batch: int) -> int:
        """How many of the ``batch`` sequences the next drafted step drafts: ``probe_rows`` for a probe
        (the first drafting at this batch size, or the first after a skip run) when the batch is larger,
        twice the last drafted step's count while growing from a probe that paid (``probe_grow``), else all."""
        if self.probe_rows is not None and batch > self.probe_rows:
            if self._probe or batch not in self.gain_average:
                return self.probe_rows
            if self._grow is not None and self._grow < batch:
                return self._grow
        return batch

    def observe_overhead(self, batch: int, drafted: bool, seconds: float) -> None:
        """One engine step's wall time outside drafting and the verification forward (seconds, >= 0)."""
        key = (batch, bool(drafted))
        old = self.overhead_seconds.get(key)
        self.overhead_seconds[key] = seconds if old is None else 0.7 * old + 0.3 * seconds

    #: recent steps per (batch size, drafted) whose tokens/s are the realized rates; fewest to judge by
    REALIZED_WINDOW, REALIZED_MIN = 24, 8

    def observe_step(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One whole engine step: ``tokens`` committed over all its sequences in ``seconds`` of wall time
        (drafting, forward, acceptance, bookkeeping); ``drafted``: it verified a tree."""
        key = (int(batch), bool(drafted))
        if key not in self._steps_seen:
            self._steps_seen[key] = deque(maxlen=self.REALIZED_WINDOW)
        self._steps_seen[key].append((int(tokens), float(seconds)))

    def realized_rate(self, batch: int, drafted: bool) -> float | None:
        """Tokens per second of the recent drafted (or plain) steps at ``batch`` (sum of tokens over sum of
        seconds, last ``REALIZED_WINDOW``); None with fewer than ``REALIZED_MIN`` of them."""
        seen = self._steps_seen.get((int(batch), bool(drafted)))
        if not seen or len(seen) < self.REALIZED_MIN:
            return None
        seconds = sum(s for _, s in seen)
        return sum(t for t, _ in seen) / seconds if seconds > 0 else None

    # -- the choice -----------------------------------------------------------------------------------
    def should_draft(self, batch: int) -> bool:
        """False while a skip run (drafting did not pay at the last drafted step) is in progress, and
        once per batch size to measure plain decoding's forward first (the reference of every choice)."""
        if batch not in self.cost.measured(batch):
            self.skipped_steps += 1
            self.steps += 1
            return False
        if self._skip_left > 0:
            self._skip_left -= 1
            self.skipped_steps += 1
            self.steps += 1
            return False
        return True

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
        """Which nodes of each tree to verify this step.

        Args:
            trees: one per sequence of the step (an empty tree for a sequence that was not drafted).
            drafted: sequences drafted (default all); fewer is a row probe: what a step drafting every
                sequence would gain is extrapolated from the drafted ones (module doc, "Row probes").

        Returns:
            (keep, raw): per tree, the kept node indices (ascending, ancestor-closed; [] = plain decoding
            for that sequence) and every node's raw value (for :meth:`observe_acceptance`).
        """
        b = len(trees)
        self.steps += 1
        raws = [self.raw_values(t) for t in trees]
        cands = []  # (value, depth, tree, node)
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
        drafted = b if drafted is None else int(drafted)
        t_draft = self.draft_cost(drafted)
        o_plain = self.overhead_seconds.get((b, False), 0.0) if self.price_overhead else 0.0  # a plain step's time outside its forward
        o_spec = self.overhead_seconds.get((b, True), o_plain) if self.price_overhead else 0.0  # a step verifying a tree
        best_k, best_rate, gain = len(cands), None, None  # nothing measured yet: verify everything (explore)
        if t_plain is not None:
            plain_rate = b / (t_plain + o_plain)
            expected = float(b)
            best_k, best_rate = 0, b / (t_draft + t_plain + o_plain)  # K = 0: a plain step (drafting spent)
            for k, (neg_v, *_rest) in enumerate(cands, start=1):
                expected -= neg_v
                rate = expected / (t_draft + self.cost.predict(b, b + k) + o_spec)
                if rate > best_rate:
                    best_k, best_rate = k, rate
            gain = best_rate / plain_rate
            if drafted < b:  # a row probe: would drafting all b sequences pay? each node stands for b / drafted
                scale, expected, full, k_full = b / drafted, float(b), 0.0, 0
                t_full = self.draft_cost(b)  # measured at b, else scaled from the nearest measured count
                for k, (neg_v, *_rest) in enumerate(cands, start=1):
                    expected -= neg_v * scale
                    rate = expected / (t_full + self.cost.predict(b, b + round(k * scale)) + o_spec)
                    if rate > full:
                        full, k_full = rate, k
                gain = full / plain_rate
                if self.probe_share:  # the probe's share of what the whole-batch step would verify
                    best_k = min(best_k, k_full)
        keep: list[list[int]] = [[] for _ in trees]
        gained = 0.0  # expected accepted nodes of what is verified
        for neg_v, _, i, j in cands[:best_k]:
            keep[i].append(j)
            gained -= neg_v
        if self._probe:  # first drafting after a skip run: verify each sequence's best node regardless
            self._probe = False
            for neg_v, _, i, j in cands:
                if not keep[i] and trees[i].parents[j] < 0:
                    keep[i].append(j)
                    best_k += 1
                    gained -= neg_v
        for k in keep:
            k.sort()
        self.nodes_verified += best_k
        if best_k == 0:
            self.plain_steps += 1
        unpaid = gain is not None and ((best_k == 0 and drafted == b) or gain < self.min_gain)
        self.row_probes += drafted < b
        if gain is not None:
            avg = self.gain_average.get(b)
            self.gain_average[b] = gain if avg is None else 0.7 * avg + 0.3 * gain
            if unpaid and self.skip_on_average:  # one unpaid step does not stop drafting that pays on average
                unpaid = self.gain_average[b] < self.min_gain
            if unpaid and self.realized and drafted == b:  # ... nor drafting that pays as measured
                done = self.realized_rate(b, True)
                plain = self.realized_rate(b, False) or plain_rate
                unpaid = done is None or done < self.min_gain * plain
        self._grow = None  # set again below where a row probe (or growing step) keeps drafting
        if unpaid:  # drafting did not pay: skip the next steps' drafting
            t_step = t_draft + self.cost.predict(b, b + best_k) + (o_spec if best_k else o_plain)
            self.last_loss = max(0.0, t_step - (b + gained) / plain_rate)
            run = self._skip_next
            if self.probe_budget is not None:  # long enough that this step's loss is <= the budget of the run
                budget = self.probe_budget / (self._skip_next if self.probe_decay else 1)  # halved per unpaid step in a row
                run = max(run, math.ceil(self.last_loss / (budget * max(t_plain + o_plain, 1e-9)) - 1.0))
            self._skip_left = min(run, self.max_skip)
            self._skip_next = min(2 * self._skip_next, self.max_skip)
            self._probe = True
        else:
            self._skip_next = 1
            if self.probe_grow and drafted < b:  # judged from some of the sequences
                paid = gain is not None and gain >= self.min_gain  # None: nothing measured yet (explore)
                self._grow = min(b, 2 * drafted) if paid else drafted  # twice as many where this step paid, else as many
        return keep, raws

    def summary(self) -> dict:
        return {"steps": self.steps, "skipped_drafting": self.skipped_steps, "plain_steps": self.plain_steps,
                "host_speed": round(self.cost.speed, 3),
                "drafted_steps": self.steps - self.skipped_steps, "row_probes": self.row_probes,
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

    Raises:
        ValueError: ``inner`` brings its own acceptance rule (its trees' meaning is its own).
    """

    def __init__(self, inner, planner: SpeculationPlanner | None = None):
        if getattr(inner, "accept", None) is not None:
            raise ValueError(f"proposer {getattr(inner, 'name', inner)!r} has its own acceptance rule; plan=false for it")
        self.inner = inner
        self.planner = planner or SpeculationPlanner()
        self.name = getattr(inner, "name", "proposer")
        self.lossless = getattr(inner, "lossless", True)
        self._starts: dict[int, tuple[list[int], torch.Tensor, int]] = {}  # slot -> start not yet handed on
        self._pending: dict[int, list[tuple[list[int], torch.Tensor]]] = {}  # slot -> commits not yet handed on
        self._inner_live: set[int] = set()
        self._verified: dict[int, tuple[DraftTree, list[float]]] = {}  # slot -> (verified tree, raw values)
        # the step in progress, for its overhead (module doc): (start, b, drafted, drafting seconds, forward seconds)
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

    def _close_step(self, now: float) -> None:
        """The previous step ended now: report its time outside drafting and its forward."""
        st, self._step = self._step, None
        if st is not None and st[4] is not None:
            start, b, drafted, t_draft, t_fwd = st
            self.planner.observe_overhead(b, drafted, max(0.0, now - start - t_draft - t_fwd))
            if drafted or t_draft == 0.0:  # a step that drafted and verified nothing is neither kind
                self.planner.observe_step(b, drafted, now - start, self._step_tokens)

    def step_done(self) -> None:
        """The engine finished this step (committed every sequence): its overhead is measured up to
        here, so that steps of other engines run in between (lock-step timing) do not count."""
        self._close_step(time.perf_counter())

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        t0 = time.perf_counter()
        self._close_step(t0)  # an engine that does not call step_done: the step ends at the next draft
        slots = list(slots)
        b = len(slots)
        self._verified.clear()
        self._step_tokens = 0
        if not slots:
            return []
        if not self.planner.should_draft(b):
            self._step = [t0, b, False, 0.0, None]
            return [DraftTree.empty() for _ in slots]
        rows = self.planner.draft_rows(b)
        drafted = slots if rows >= b else self._probe_slots(slots, rows)
        starts = any(s in self._starts for s in drafted)  # a sequence's first drafting: its prompt's prefill
        self._flush(drafted)  # catching the drafter up (after a skip run: several tokens) is drafting time
        got = dict(zip(drafted, self.inner.draft(drafted, sampling, generator)))
        trees = [got[s] if s in got else DraftTree.empty() for s in slots]
        t_draft = time.perf_counter() - t0
        self.planner.observe_draft(len(drafted), t_draft, first=starts)
        self._step = [t0, b, True, t_draft, None]
        keep, raws = self.planner.plan(trees, drafted=len(drafted))
        self._step[2] = any(keep)  # a tree was verified: the step's overhead is a drafted step's
        out = []
        for s, t, k, raw in zip(slots, trees, keep, raws):
            sub = subtree(t, k)
            self._verified[s] = (sub, [raw[j] for j in k])
            out.append(sub)
        return out

    def _probe_slots(self, slots: list[int], rows: int) -> list[int]:
        """``rows`` of ``slots`` for a row probe: sequences the drafter already follows first (their catch-up
        is the tokens since their last drafting, not the whole prompt), then the lowest slots."""
        return sorted(sorted(slots, key=lambda s: (s not in self._inner_live, s))[:rows])

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
