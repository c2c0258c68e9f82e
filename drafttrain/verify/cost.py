"""The one forward-cost model: ``t(b, M)``, the seconds of one target forward of b sequences with M inputs in total.

Two consumers read it. The online planner (:mod:`drafttrain.verify.planner`) feeds it every verification forward
the engine reports and follows the host's speed as it drifts; the export (:mod:`drafttrain.export.speculation`)
feeds it the shapes it measured once per host kind and target (:func:`~drafttrain.export.speculation.
measure_forward_cost`, cached), or a stated GPU rule, and prices K for every batch size from it. The rules are one
set: each measured size's median, made non-decreasing in M (a forward with more inputs never costs less: noisy
neighbours are pooled), linear between measured sizes, beyond them the steepest of the last segment's slope and the
chord, never below a per-input floor.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque


class ForwardCostModel:
    """Online estimate of ``t(b, M)``, the seconds of one verification forward (b sequences, M inputs in total).

    Per batch size, each measured size's median over its recent forwards, made non-decreasing in M (a
    forward with more inputs never costs less: count-weighted pool-adjacent-violators, so one noisy size is
    pooled with its neighbours), linear between measured sizes. Beyond the largest measured size the cost
    grows at the steepest of the last segment's slope and the slope from the smallest to the largest
    measured size (the cost is convex in M: flat while memory-bound, then linear, so neither overstates the
    slope beyond), never below ``min_input_cost`` times the plain forward's cost per input. A batch size
    with a single measured size borrows the slope (seconds per input) of the nearest batch size that has
    one (continuous batching changes b every time a sequence ends); where none has, the slope is unknown
    (:meth:`slope_known`) and :meth:`predict` prices each extra input at the plain forward's average cost
    per input (right on a compute-bound host; the planner profiles the slope before it drafts).

    **Host drift.** The table holds each forward's time divided by the host's speed factor at that moment
    (``drift``): ``speed`` is the median, over the last ``drift_window`` forwards, of measured seconds over
    the table's medians for that (b, M) (a measured size, or between two), and :meth:`predict` multiplies
    the table by it, so sizes no longer chosen follow the host with the plain forward measured every step.

    Args:
        window: recent measurements kept per (b, M) (their median is the size's estimate).
        drift: follow the host's speed (above); False = absolute times.
        drift_window: forwards whose ratios set ``speed``.
        min_input_cost: floor of the extrapolated cost per extra input, as a fraction of the plain forward's
            average cost per input ``t(b, b) / b`` (> 0: the extrapolation is never flat).

    Raises:
        ValueError: ``window`` or ``drift_window`` < 1, or ``min_input_cost`` outside (0, 1].
    """

    def __init__(self, window: int = 15, drift: bool = True, drift_window: int = 5, min_input_cost: float = 0.02):
        if window < 1 or drift_window < 1:
            raise ValueError(f"window and drift_window must be >= 1, got {window} and {drift_window}")
        if not 0.0 < min_input_cost <= 1.0:
            raise ValueError(f"min_input_cost must be in (0, 1], got {min_input_cost}")
        self.window = int(window)
        self.drift = bool(drift)
        self.min_input_cost = float(min_input_cost)
        self._ratios: deque = deque(maxlen=int(drift_window))  # measured / table, the last forwards
        self.speed = 1.0  # the host's speed factor now: measured seconds over the table's (1.0 until measured)
        self._obs: dict[int, dict[int, deque]] = {}  # b -> M -> recent seconds (speed-free)
        self._raw: dict[int, dict[int, float]] = {}  # b -> {M: median}, cached until the next observation at b
        self._tables: dict[int, dict[int, float]] = {}  # b -> the non-decreasing fit of _raw(b)

    def observe(self, batch: int, inputs: int, seconds: float) -> None:
        """One forward of ``batch`` sequences with ``inputs`` inputs in total took ``seconds`` (wall time)."""
        seconds = float(seconds)
        if self.drift:
            ref = _between(self._raw_table(batch), inputs)
            if ref is not None and ref > 0.0 and seconds > 0.0:
                self._ratios.append(seconds / ref)
                self.speed = statistics.median(self._ratios)
            seconds /= self.speed
        self._obs.setdefault(int(batch), {}).setdefault(int(inputs), deque(maxlen=self.window)).append(seconds)
        self._raw.pop(int(batch), None)
        self._tables.pop(int(batch), None)

    def samples(self, batch: int, inputs: int) -> int:
        """How many recent forwards of (b, M) the estimate rests on (0: never measured)."""
        return len(self._obs.get(int(batch), {}).get(int(inputs), ()))

    def batch_sizes(self) -> list[int]:
        """The batch sizes some forward was measured at."""
        return list(self._obs)

    def measured(self, batch: int) -> dict[int, float]:
        """{M: seconds} at batch size ``batch`` for the measured sizes (the non-decreasing fit of their
        medians, at the host's current speed)."""
        return {m: self.speed * t for m, t in self._table(batch).items()}

    def _raw_table(self, batch: int) -> dict[int, float]:
        """{M: median of the recent forwards} at ``batch``, sorted by M, speed-free."""
        table = self._raw.get(int(batch))
        if table is None:
            table = {m: statistics.median(d) for m, d in sorted(self._obs.get(int(batch), {}).items())}
            self._raw[int(batch)] = table
        return table

    def _table(self, batch: int) -> dict[int, float]:
        """:meth:`_raw_table` made non-decreasing in M (weights: each size's measurement count)."""
        table = self._tables.get(int(batch))
        if table is None:
            raw, obs = self._raw_table(batch), self._obs.get(int(batch), {})
            table = _non_decreasing(raw, {m: len(obs[m]) for m in raw})
            self._tables[int(batch)] = table
        return table

    def _own_slope(self, batch: int) -> float | None:
        """Speed-free seconds per extra input beyond the largest size measured at ``batch`` (class doc);
        None with fewer than two measured sizes."""
        table = self._table(batch)
        if len(table) < 2:
            return None
        ms = list(table)
        last = (table[ms[-1]] - table[ms[-2]]) / (ms[-1] - ms[-2])
        chord = (table[ms[-1]] - table[ms[0]]) / (ms[-1] - ms[0])
        return max(last, chord, self.min_input_cost * table[ms[0]] / ms[0])

    def slope_known(self, batch: int) -> bool:
        """Whether ``batch`` or another batch size has two measured sizes (else :meth:`predict` assumes a
        compute-bound host)."""
        return any(len(obs) >= 2 for obs in self._obs.values())

    def marginal(self, batch: int) -> float | None:
        """Speed-free seconds per input beyond the largest size measured at ``batch``: its own slope, else the
        nearest batch size's (ties: the larger), floored at ``min_input_cost`` of this batch size's plain
        cost per input; None when no batch size has two measured sizes."""
        own = self._own_slope(batch)
        if own is not None:
            return own
        others = [b2 for b2, obs in self._obs.items() if len(obs) >= 2]
        if not others:
            return None
        near = min(others, key=lambda b2: (abs(b2 - batch), -b2))
        table = self._table(batch)
        floor = self.min_input_cost * min(table.values()) / min(table) if table else 0.0
        return max(self._own_slope(near), floor)

    def predict(self, batch: int, inputs: int) -> float | None:
        """Seconds for (b, M) at the host's current speed (class doc); None when nothing was measured at
        this batch size."""
        table = self._table(batch)
        if not table:
            return None
        t = _between(table, inputs)
        if t is None:
            ms = list(table)
            if inputs < ms[0]:
                t = table[ms[0]]
            else:
                slope = self.marginal(batch)
                if slope is None:  # no slope known anywhere: compute-bound, the average cost per input
                    slope = table[ms[-1]] / ms[-1]
                t = table[ms[-1]] + slope * (inputs - ms[-1])
        return self.speed * t


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


def _non_decreasing(points: dict[int, float], weights: dict[int, int]) -> dict[int, float]:
    """The weighted least-squares non-decreasing fit of ``points`` ({M: seconds}, sorted by M): adjacent
    sizes that decrease are pooled into their weighted mean (pool-adjacent-violators)."""
    blocks: list[list[float]] = []  # [value, weight, sizes pooled]
    for m, v in points.items():
        blocks.append([v, float(weights[m]), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    values = [v for v, _, n in blocks for _ in range(int(n))]
    return dict(zip(points, values))
