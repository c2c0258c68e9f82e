"""How many tokens to draft per verification step (K) for a served drafter, from measured acceptance and cost.

The cost model is the standard one of speculative decoding (Leviathan, Kalman, Matias 2023, "Fast
Inference from Transformers via Speculative Decoding", section 3: 3.1 tokens per step, eq. 1; 3.3 walltime
improvement; 3.5 choosing gamma, the number of drafts; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", section 2), with measured per-position conditional acceptance in place
of one i.i.d. rate alpha and measured forward times in place of one cost ratio c:

- **Tokens per verification step.** A chain of K drafts, position k accepted with probability
  ``cond_acc_k`` given that positions < k were (held-out ``eval/cond_acc_k`` of a training run,
  :mod:`drafttrain.metrics`), yields ``E[tokens](K) = 1 + sum_{k<K} prod_{j<=k} cond_acc_j``
  (the target's own token, plus each draft prefix that survives). ``E[tokens](0) = 1``.
- **Time per step** at batch size b: ``T(b * (K + 1)) + passes(K) * r * T(b)``, where ``T(N)`` is the
  target's forward time over N inputs in one call (b sequences of K + 1 verified inputs each),
  ``r`` the drafter pass's cost relative to a target forward over the same inputs, and ``passes(K)``
  = 1 for a parallel drafter (``DrafterSpec.drafting == "parallel"``: one pass drafts all K), K for an
  autoregressive one, 0 for K = 0.
- **Expected speedup** over plain decoding (one input per sequence per step, ``T(b)``):
  ``S(b, K) = E[tokens](K) * T(b) / time per step``; ``S(b, 0) = 1``. The chosen K maximises ``S(1, K)``
  over 1..K_max; it *pays* when ``S(1, K) > 1``.
- **Per batch size.** ``T`` grows with the inputs once the forward is compute-bound, so the extra K
  inputs per sequence cost more at larger batches and K falls; :func:`schedule` gives vLLM's
  ``num_speculative_tokens_per_batch_size`` (``[[first_batch_size, last_batch_size, K], ...]``, K = 0
  = no drafting at those sizes; vLLM's ``vllm/v1/spec_decode/dynamic/utils.py`` checks it starts at 1
  and does not overlap, clips K to ``num_speculative_tokens``, and keeps the last K past the last size).

``T`` is a :class:`CostModel`: measured on the host that exports (:func:`measure_forward_cost`: a few
target forwards of 1 and K_max + 1 inputs at batch 1 and at a bigger batch, interpolated piecewise
linearly in the number of inputs, extrapolated with the last slope), or stated for a GPU
(:meth:`CostModel.stated`: ``T(N) = 1 + ratio * (N - 1)`` in units of a one-input forward). Not modelled:
attention over a long context (the measured forwards have no KV cache), the engine's scheduling
overhead, rejected drafts' wasted KV writes; so the speedup is an upper estimate and the ranking of K
is what the export uses.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BATCH = 256  # the schedule covers batch sizes 1..this (vLLM keeps the last K beyond it)


class SpeculationError(ValueError):
    """Bad input to the cost model (acceptance outside [0, 1], a non-positive cost, K_max < 1)."""


# ==================================================================================================
# Acceptance
# ==================================================================================================


def conditional_acceptance(metrics: dict, prefix: str = "eval") -> list[float] | None:
    """Per-position conditional acceptance ``[cond_acc_0, ..., cond_acc_{n-1}]`` from a run's metrics.

    Positions run while ``{prefix}/acc_k`` is present (:func:`drafttrain.metrics.finalize` writes it for
    every position evaluated); ``cond_acc_k`` absent there means no group had positions < k all correct
    (its count was 0), so the chain never reaches k: 0.0. ``cond_acc_0`` = ``acc_0`` when absent.

    Returns:
        n floats in [0, 1], or None when the metrics hold no ``{prefix}/acc_0`` (no held-out evaluation).
    """
    out: list[float] = []
    k = 0
    while f"{prefix}/acc_{k}" in metrics:
        c = metrics.get(f"{prefix}/cond_acc_{k}")
        if c is None:
            c = metrics[f"{prefix}/acc_{k}"] if k == 0 else 0.0
        out.append(float(c))
        k += 1
    return out or None


def _check_acceptance(cond_acc: Sequence[float]) -> None:
    bad = [a for a in cond_acc if not 0.0 <= float(a) <= 1.0]
    if bad:
        raise SpeculationError(f"acceptance rates must lie in [0, 1], got {bad}; pass per-position rates "
                               "(eval/cond_acc_k), not counts")  # fmt: skip


def expected_tokens(cond_acc: Sequence[float], k: int) -> float:
    """``E[tokens](K) = 1 + sum_{i<K} prod_{j<=i} cond_acc_j``: tokens one verification step of a chain of
    ``k`` drafts yields (float >= 1).

    Raises:
        SpeculationError: ``k`` < 0 or more positions than ``cond_acc`` holds; a rate outside [0, 1].

    >>> expected_tokens([0.5, 0.5], 2)
    1.75
    """
    _check_acceptance(cond_acc)
    if not 0 <= k <= len(cond_acc):
        raise SpeculationError(f"K={k} needs acceptance for {k} positions, have {len(cond_acc)}")
    total, survive = 1.0, 1.0
    for a in cond_acc[:k]:
        survive *= float(a)
        total += survive
    return total


def draft_passes(drafting: str, k: int) -> int:
    """Drafter forward passes per step for ``k`` drafts: 1 if ``drafting == "parallel"``, else ``k`` (0 for k = 0)."""
    if k <= 0:
        return 0
    return 1 if drafting == "parallel" else k


# ==================================================================================================
# Cost
# ==================================================================================================


@dataclass(frozen=True)
class CostModel:
    """Target forward time as a function of the inputs in one forward call.

    Attributes:
        points: ``(inputs, time)`` pairs, inputs >= 1 ascending, time > 0 (seconds when measured,
            units of a one-input forward when stated); :meth:`target` interpolates them.
        source: where the figures came from, in words (written to ``export_info.json``).
    """

    points: tuple[tuple[float, float], ...]
    source: str

    def __post_init__(self):
        if not self.points:
            raise SpeculationError("a cost model needs at least one (inputs, time) point")
        if any(n < 1 or t <= 0 for n, t in self.points) or len({n for n, _ in self.points}) < len(self.points):
            raise SpeculationError(f"cost points need distinct inputs >= 1 and time > 0, got {list(self.points)}")

    @classmethod
    def stated(cls, ratio: float) -> "CostModel":
        """``T(N) = 1 + ratio * (N - 1)``: each input beyond the first costs ``ratio`` of a one-input forward
        (a GPU at small batches: ratio near 0, the forward reads the weights once whatever N is).

        Raises:
            SpeculationError: ``ratio`` < 0.
        """
        if ratio < 0:
            raise SpeculationError(f"gpu_cost_ratio must be >= 0 (cost of one more input / a one-input forward), got {ratio}")
        return cls(((1.0, 1.0), (2.0, 1.0 + ratio)), f"stated: gpu_cost_ratio={ratio:g} (T(N) = 1 + ratio * (N - 1))")

    def target(self, inputs: float) -> float:
        """T(inputs) by the one forward-cost model's rules (:class:`~drafttrain.verify.cost.ForwardCostModel`, the
        planner's, fed :attr:`points` once each, no drift): non-decreasing in inputs (a noisy decrease is pooled),
        linear between points, the first point's time below it; beyond the last point the steepest of the last
        segment's slope and the chord."""
        return self._model().predict(1, float(inputs))

    def _model(self):
        """The fitted :class:`~drafttrain.verify.cost.ForwardCostModel` of :attr:`points` (built once)."""
        from drafttrain.verify.cost import ForwardCostModel

        cached = self.__dict__.get("_fcm")
        if cached is None:
            cached = ForwardCostModel(window=1, drift=False, min_input_cost=1e-9)
            for n, t in sorted(self.points):
                cached.observe(1, n, float(t))
            object.__setattr__(self, "_fcm", cached)  # frozen dataclass: the fitted table, kept beside it
        return cached


def measure_forward_cost(forward: Callable[[int, int], None], k_max: int, big_batch: int = 16, repeats: int = 9,
                         source: str = "measured on this host") -> CostModel:  # fmt: skip
    """Time ``forward(batch, inputs)`` (one target forward of ``batch`` sequences of ``inputs`` tokens, no
    cache) at (1, 1), (1, k_max + 1), (big_batch, 1), (big_batch, k_max + 1): one warm-up call each, then
    ``repeats`` rounds over the four shapes in turn; each point is its minimum.

    Returns:
        a :class:`CostModel` in seconds whose points are (batch * inputs, median seconds).

    Raises:
        SpeculationError: ``k_max`` < 1, ``big_batch`` < 2 or ``repeats`` < 1.
    """
    if k_max < 1 or big_batch < 2 or repeats < 1:
        raise SpeculationError(f"measure_forward_cost needs k_max >= 1, big_batch >= 2, repeats >= 1; got "
                               f"{k_max}, {big_batch}, {repeats}")  # fmt: skip
    shapes = [(b, n) for b in (1, big_batch) for n in (1, k_max + 1)]
    for b, n in shapes:
        forward(b, n)  # warm-up
    times: dict[tuple[int, int], list[float]] = {sh: [] for sh in shapes}
    for _ in range(repeats):  # round-robin: a host that drifts slows every shape alike
        for b, n in shapes:
            t = time.perf_counter()
            forward(b, n)
            times[(b, n)].append(time.perf_counter() - t)
    pts: dict[float, list[float]] = {}
    for (b, n), ts in times.items():  # the minimum: interference on a shared host only ever adds time
        pts.setdefault(float(b * n), []).append(max(min(ts), 1e-9))
    return CostModel(tuple((n, statistics.mean(ts)) for n, ts in sorted(pts.items())), source)


COST_DIR = "forward_cost"


def cached_forward_cost(forward: Callable[[int, int], None], k_max: int, key: dict, big_batch: int = 16,
                        repeats: int = 9, source: str = "measured on this host", root: Path | None = None) -> CostModel:  # fmt: skip
    """:func:`measure_forward_cost` taken once per ``key`` and cached, so every export on a host of one kind,
    against one target, prices K from the same table (a short measurement taken at each export moved the main
    job's schedule from "K = 1 up to 10 sequences" to "K = 2 at 1, 0 from 6" between two exports minutes apart).

    Args:
        key: what the cost depends on (JSON-safe): the host kind, the target's fingerprint, its linear kernels,
            torch threads; ``k_max`` and ``big_batch`` are added.
        root: the cache root (null: :func:`drafttrain.assets.cache_root`); the table is
            ``<root>/forward_cost/<16 hex digits>.json``.

    Returns:
        the :class:`CostModel`, its ``source`` naming the cache file and when it was measured.

    Raises:
        SpeculationError: see :func:`measure_forward_cost`.
    """
    import hashlib

    from drafttrain.assets import cache_root

    blob = json.dumps({**key, "k_max": int(k_max), "big_batch": int(big_batch)}, sort_keys=True, default=str)
    path = Path(root or cache_root()) / COST_DIR / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            return CostModel(tuple((float(n), float(t)) for n, t in d["points"]), f"{d['source']}; cached in {path}")
        except (ValueError, KeyError, TypeError, SpeculationError):  # unreadable: measure again, write it over
            pass
    cost = measure_forward_cost(forward, k_max, big_batch=big_batch, repeats=repeats, source=source)
    stamp = f"{cost.source}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    from drafttrain.atomic import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": json.loads(blob), "points": [list(p) for p in cost.points],
                                        "source": stamp}, indent=1), what="the cached forward cost")  # fmt: skip
    return CostModel(cost.points, f"{stamp}; cached in {path}")


# ==================================================================================================
# Choosing K
# ==================================================================================================


def expected_speedup(cond_acc: Sequence[float], k: int, cost: CostModel, drafting: str, draft_ratio: float,
                     batch: int = 1) -> float:  # fmt: skip
    """``S(b, K) = E[tokens](K) * T(b) / (T(b (K + 1)) + passes(K) * r * T(b))`` (1.0 for K = 0).

    Args:
        cond_acc: per-position conditional acceptance (>= ``k`` entries, each in [0, 1]).
        k: drafts per step; cost: :class:`CostModel`; drafting: ``"parallel"`` or ``"autoregressive"``;
        draft_ratio: r, a drafter pass's cost / a target forward's over the same sequences (>= 0);
        batch: sequences decoded together (>= 1).

    Raises:
        SpeculationError: see :func:`expected_tokens`; ``draft_ratio`` < 0 or ``batch`` < 1.
    """
    if draft_ratio < 0 or batch < 1:
        raise SpeculationError(f"draft_cost_ratio must be >= 0 and batch >= 1, got {draft_ratio}, {batch}")
    if k == 0:
        return 1.0
    plain = cost.target(batch)
    step = cost.target(batch * (k + 1)) + draft_passes(drafting, k) * draft_ratio * plain
    return expected_tokens(cond_acc, k) * plain / step


def best_k(cond_acc: Sequence[float], cost: CostModel, drafting: str, draft_ratio: float, k_max: int | None = None,
           batch: int = 1, allow_zero: bool = False) -> tuple[int, float]:  # fmt: skip
    """The K in 1..k_max (0..k_max with ``allow_zero``) with the highest :func:`expected_speedup` at ``batch``
    (the smaller K on a tie), and that speedup. ``k_max``: null = every position of ``cond_acc``.

    Raises:
        SpeculationError: ``k_max`` < 1 or beyond ``cond_acc``; see :func:`expected_speedup`.
    """
    k_max = len(cond_acc) if k_max is None else int(k_max)
    if not 1 <= k_max <= len(cond_acc):
        raise SpeculationError(f"K_max={k_max} must be in 1..{len(cond_acc)} (the positions with measured acceptance)")
    best = (0, 1.0) if allow_zero else (1, expected_speedup(cond_acc, 1, cost, drafting, draft_ratio, batch))
    for k in range(2 if not allow_zero else 1, k_max + 1):
        s = expected_speedup(cond_acc, k, cost, drafting, draft_ratio, batch)
        if s > best[1] + 1e-12:
            best = (k, s)
    return best


def schedule(cond_acc: Sequence[float], cost: CostModel, drafting: str, draft_ratio: float, k_max: int,
             max_batch: int = DEFAULT_MAX_BATCH) -> list[list[int]]:  # fmt: skip
    """vLLM's ``num_speculative_tokens_per_batch_size``: ``[[first_batch_size, last_batch_size, K], ...]``
    covering 1..``max_batch`` contiguously, K = :func:`best_k` at each batch size (0 allowed: no drafting
    where nothing pays), capped by the K of every smaller batch size so it never rises with the batch
    (one more sequence never makes the verification's extra inputs cheaper).

    Raises:
        SpeculationError: ``max_batch`` < 1; see :func:`best_k`.
    """
    if max_batch < 1:
        raise SpeculationError(f"max_batch must be >= 1, got {max_batch}")
    out: list[list[int]] = []
    cap = k_max
    for b in range(1, max_batch + 1):
        k = min(cap, best_k(cond_acc, cost, drafting, draft_ratio, k_max, batch=b, allow_zero=True)[0])
        cap = k
        if out and out[-1][2] == k:
            out[-1][1] = b
        else:
            out.append([b, b, k])
    return out


def plan(cond_acc: Sequence[float], cost: CostModel, drafting: str, draft_ratio: float, k_max: int,
         max_batch: int = DEFAULT_MAX_BATCH, fixed_k: int | None = None) -> dict:  # fmt: skip
    """The whole choice, as ``export_info.json``'s ``speculation`` block figures.

    Args:
        fixed_k: a K the engine must use (e.g. DFlash's block - 1, or one the user gave): it is scored,
            not chosen, and the schedule is that K wherever it beats plain decoding, else 0.

    Returns:
        dict: ``num_speculative_tokens`` (K at batch 1), ``expected_speedup`` (at batch 1),
        ``expected_tokens_per_step``, ``pays`` (speedup > 1), ``speedup_by_k`` (K = 1..k_max at batch 1),
        ``draft_passes_per_step``, ``schedule`` (:func:`schedule`; for ``fixed_k``: K or 0 per batch size).
    """
    if fixed_k is not None:
        k = int(fixed_k)
        s = expected_speedup(cond_acc, k, cost, drafting, draft_ratio, 1)
        sched: list[list[int]] = []
        on = True
        for b in range(1, max_batch + 1):
            on = on and expected_speedup(cond_acc, k, cost, drafting, draft_ratio, b) > 1.0
            kb = k if on else 0
            if sched and sched[-1][2] == kb:
                sched[-1][1] = b
            else:
                sched.append([b, b, kb])
    else:
        k, s = best_k(cond_acc, cost, drafting, draft_ratio, k_max)
        sched = schedule(cond_acc, cost, drafting, draft_ratio, k_max, max_batch)
    return {
        "num_speculative_tokens": k,
        "expected_speedup": round(s, 4),
        "expected_tokens_per_step": round(expected_tokens(cond_acc, k), 4),
        "pays": s > 1.0,
        "speedup_by_k": [round(expected_speedup(cond_acc, j, cost, drafting, draft_ratio, 1), 4)
                         for j in range(1, k_max + 1)],  # fmt: skip
        "draft_passes_per_step": "1 (parallel drafting)" if drafting == "parallel" else "K (autoregressive drafting)",
        "schedule": sched,
    }


#: the figures of a speculation block that say what the cost model chose; a rule that overrides the choice keeps
#: them under the block's ``model`` (:func:`hold_at_loads`, :func:`drafttrain.export.vllm_profile.apply`)
MODEL_KEYS = ("num_speculative_tokens", "expected_speedup", "pays", "schedule", "chosen_by")


def hold_at_loads(block: dict, loads: Sequence[int]) -> dict:
    """The cost model's choice held to the rule a measured vLLM profile follows
    (:func:`drafttrain.export.vllm_profile.choose`): the serve line runs ONE K at every batch size (vLLM 0.32
    takes no batch-size schedule for parallel drafting, and a scheduled K = 0 still runs an EAGLE-3 chain's
    drafter), so that K must pay at every load in ``loads`` (requests in flight). Where the block's schedule
    drops K to 0 at a batch size in 2..max(loads), the line serves the target alone and the model's K becomes
    an alternative for fewer requests at a time.

    Args:
        block: a :func:`plan` / :func:`for_export` block (its ``schedule`` [[first, last, K], ...]).
        loads: requests in flight the line must serve without loss (each >= 1).

    Returns:
        ``block`` itself where the rule changes nothing (no schedule, K never 0 up to max(loads), or nothing
        pays at batch 1 already); else a copy with ``pays`` False, ``schedule`` None, the model's figures
        under ``model``, ``chosen_by`` and ``line_note`` saying why, and ``predicted_alternative``:
        ``{"loads": [1..first zero - 1], "num_speculative_tokens": K, "expected_speedup": at batch 1}`` with K the
        schedule's K just below its first 0 (the best K there, which also pays at every smaller batch size).

    Raises:
        SpeculationError: an empty ``loads`` or a load < 1.
    """
    loads = [int(n) for n in loads]
    if not loads or min(loads) < 1:
        raise SpeculationError(f"serve_loads must be requests in flight >= 1, got {loads}")
    sched = block.get("schedule") or []
    zero = next((int(lo) for lo, _hi, k in sched if int(k) == 0), None)
    if block.get("pays") is not True or zero is None or zero <= 1 or zero > max(loads):
        return block
    model = {k: block.get(k) for k in MODEL_KEYS}
    k = int(block["num_speculative_tokens"])
    # the alternative: the schedule's K just below its first 0, the best K there; a K's speedup only falls as the
    # batch grows, so it pays at every smaller batch too (at batch 1: its speedup_by_k figure)
    k_alt = int(next(kk for lo, _hi, kk in reversed(sched) if int(lo) < zero and int(kk) > 0))
    by_k = block.get("speedup_by_k") or []
    s_alt = float(by_k[k_alt - 1]) if len(by_k) >= k_alt else float(model["expected_speedup"])
    out = {kk: v for kk, v in block.items() if kk not in model}
    out.update({
        "num_speculative_tokens": k, "expected_speedup": 1.0, "pays": False, "schedule": None, "model": model,
        "chosen_by": (f"held to every load in {loads} requests in flight: the cost model expects every K to lose from "
                      f"{zero} on, and the line runs one K at every batch size; so the target alone"),
        "line_note": (f"  # the export expects speculation to pay up to {zero - 1} requests at a time and to lose "
                      f"from {zero} on, and vLLM 0.32 runs one K at every batch size: serve without speculation for "
                      f"{max(loads)} requests in flight (K={k_alt} expected {s_alt:.2f}x with 1)"),
        "predicted_alternative": {"loads": list(range(1, zero)), "num_speculative_tokens": k_alt,
                                  "expected_speedup": round(s_alt, 4)},
    })  # fmt: skip
    return out


# ==================================================================================================
# From an export: the run's metrics, the host's target, the drafter
# ==================================================================================================

METRICS_FILE = "final_metrics.json"


def run_metrics(drafter_folder: Path) -> tuple[dict | None, Path | None]:
    """The training run's ``final_metrics.json`` (beside ``drafter/``, or inside a bare drafter folder) and its path;
    (None, None) when there is none."""
    for p in (drafter_folder.parent / METRICS_FILE, drafter_folder / METRICS_FILE):
        if p.is_file():
            obj = json.loads(p.read_text())
            return (obj, p) if isinstance(obj, dict) else (None, None)
    return None, None


def param_draft_ratio(drafter, target) -> float:
    """r from parameter counts: the weights one drafter pass reads (its own, plus the target's LM head when it
    drafts over the full vocabulary) / the weights one target forward reads (every parameter, the input
    embedding only when it is the tied LM head). Decoding at small batches reads every weight once per
    forward, so time follows the bytes read; a floor of 0.01 stands for the pass's fixed overheads."""
    seen: dict[int, int] = {}
    for p in target.model.parameters():
        seen.setdefault(p.data_ptr(), p.numel())
    emb, head = target.embed_tokens.weight, target.lm_head.weight
    target_n = sum(seen.values()) - (emb.numel() if emb.data_ptr() != head.data_ptr() else 0)
    draft_n = sum(p.numel() for p in drafter.parameters())
    if not getattr(drafter, "restricted_vocab", True):
        draft_n += head.numel()
    return max(draft_n / max(target_n, 1), 0.01)


def host_forward(target) -> Callable[[int, int], None]:
    """``forward(batch, inputs)``: one no-cache forward of the target's model over random token ids (for
    :func:`measure_forward_cost`)."""
    import torch

    g = torch.Generator().manual_seed(0)
    vocab = int(target.config.vocab_size)

    def forward(batch: int, inputs: int) -> None:
        ids = torch.randint(0, vocab, (batch, inputs), generator=g).to(target.device)
        with torch.inference_mode():
            target.model(input_ids=ids, use_cache=False)

    return forward


def for_export(drafter, target, drafter_folder: Path, drafting: str, *, fixed_k: int | None = None,
               fixed_reason: str | None = None, gpu_cost_ratio: float | None = None,
               draft_cost_ratio: float | None = None, max_batch: int = DEFAULT_MAX_BATCH,
               big_batch: int = 16, cost_key: dict | None = None) -> dict:  # fmt: skip
    """``export_info.json``'s ``speculation`` block for ``drafter`` served against ``target``.

    K is chosen (:func:`plan`) from the run's held-out ``eval/cond_acc_k`` (:func:`run_metrics`), the
    target's cost (``gpu_cost_ratio``: :meth:`CostModel.stated`; null: :func:`measure_forward_cost` on this
    host: 4 shapes x (1 warm-up + 9 timed) no-cache forwards, the largest 16 x (K_max + 1) tokens; with ``cost_key``
    taken once per key and cached, :func:`cached_forward_cost`) and the drafter's
    (``draft_cost_ratio``; null: :func:`param_draft_ratio`). ``fixed_k`` (with ``fixed_reason``) is scored
    instead of chosen. Without held-out acceptance nothing is measured: K = ``fixed_k`` or the drafter's depth.

    Args:
        drafting: ``"parallel"`` or ``"autoregressive"``: how the *engine* drafts (one pass or K).

    Returns:
        dict with at least ``num_speculative_tokens`` (int >= 1), ``chosen_by`` (words), ``pays`` (bool or
        None when unknown) and ``expected_speedup`` (float or None); with acceptance also the figures of
        :func:`plan`, ``acceptance`` and ``cost``.

    Raises:
        SpeculationError: a stated ratio < 0, acceptance outside [0, 1].
    """
    depth = int(drafter.draft_depth)
    metrics, path = run_metrics(drafter_folder)
    cond = conditional_acceptance(metrics or {})
    if cond is None:
        k = int(fixed_k or depth)
        why = fixed_reason or f"the drafter's depth ({depth})"
        return {"num_speculative_tokens": k, "expected_speedup": None, "pays": None, "schedule": None,
                "chosen_by": f"{why}: no held-out acceptance (eval/acc_k in {METRICS_FILE}) beside the drafter, "
                             "so K is not chosen by measurement"}  # fmt: skip
    k_max = min(depth, len(cond)) if drafting == "parallel" else len(cond)
    if fixed_k is not None and fixed_k > len(cond):
        return {"num_speculative_tokens": int(fixed_k), "expected_speedup": None, "pays": None, "schedule": None,
                "chosen_by": f"{fixed_reason or 'given'}; acceptance measured for {len(cond)} positions only, "
                             f"so K={fixed_k} cannot be scored"}  # fmt: skip
    if gpu_cost_ratio is not None:
        cost = CostModel.stated(float(gpu_cost_ratio))
    else:
        import platform

        import torch

        where = (f"measured on this host ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                 f"torch threads): target forwards of 1 and {k_max + 1} inputs at batch 1 and {big_batch}, no cache")  # fmt: skip
        if cost_key is None:
            cost = measure_forward_cost(host_forward(target), k_max, big_batch=big_batch, source=where)
        else:
            cost = cached_forward_cost(host_forward(target), k_max, cost_key, big_batch=big_batch, source=where)
    if draft_cost_ratio is not None:
        if draft_cost_ratio < 0:
            raise SpeculationError(f"draft_cost_ratio must be >= 0, got {draft_cost_ratio}")
        r, r_source = float(draft_cost_ratio), "stated: draft_cost_ratio"
    else:
        r, r_source = param_draft_ratio(drafter, target), "parameter ratio (weights read per drafter pass / per target forward)"
    block = plan(cond, cost, drafting, r, k_max, max_batch=max_batch, fixed_k=fixed_k)
    if fixed_k is not None:
        block["chosen_by"] = f"{fixed_reason or 'given'} (scored, not chosen)"
    else:
        block["chosen_by"] = f"the highest expected speedup at batch 1 over K = 1..{k_max}"
    block["acceptance"] = {"source": f"{path} (eval/cond_acc_k, held-out)", "cond_acc": [round(a, 4) for a in cond],
                           "acc": [round(float(metrics[f'eval/acc_{i}']), 4) for i in range(len(cond))]}  # fmt: skip
    block["cost"] = {"target_source": cost.source, "target_forward": [[n, t] for n, t in cost.points],
                     "target_forward_units": "seconds" if gpu_cost_ratio is None else "one-input forwards",
                     "draft_cost_ratio": round(r, 5), "draft_cost_source": r_source, "drafting": drafting}  # fmt: skip
    return block


__all__ = ["CostModel", "DEFAULT_MAX_BATCH", "MODEL_KEYS", "SpeculationError", "best_k", "cached_forward_cost",
           "conditional_acceptance", "draft_passes", "expected_speedup", "expected_tokens", "for_export",
           "hold_at_loads", "measure_forward_cost", "plan", "run_metrics", "schedule"]
