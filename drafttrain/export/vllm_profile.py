"""The served K chosen from vLLM itself: a profile of vLLM's plain and speculative throughput on this host.

The export's first choice of K (:mod:`drafttrain.export.speculation`) prices a speculative step with
drafttrain's own engine: target forwards timed here, and a draft pass priced by the drafter's share of the
parameters. vLLM's own speculative step costs more than that on a CPU, and vLLM 0.32 cannot stop
speculating at large batch sizes (parallel drafting takes no batch-size schedule; where a schedule is taken,
its K = 0 still runs the drafter's machinery each step; docs/benchmarks/serving.md measures both). So a
line chosen by the model can lose in vLLM where the model says it pays.

This module does what vLLM's dynamic speculation does with its cost table: measure once, then choose from
the measurements. A **profile** holds, for each K tried, vLLM's generated tokens per second with that K and
without speculation, on the same prompts at each number of requests in flight (``scripts.serve_check
profile_k=[...]`` measures it), and whether every output equalled plain greedy decoding.

**The rule.** The served line must hold at every load in ``loads`` (requests in flight; default 1 and 8).
A K scores its worst measured speedup over those loads; serving the target alone scores 1.0 at every load.
The line takes the K with the highest score, and only if its speedup at every load is at least ``1 + margin``
(the margin over timing noise: ``min_gain``, or at a load where the profile timed plain decoding before and
after the speculative runs, their relative difference there if larger: vLLM's throughput on a shared CPU
drifts by several percent between engines started minutes apart); otherwise it serves the target alone. A K whose outputs differed from plain decoding is
never chosen. So the line is never measured to lose at a load it must serve. For each load alone, the best
K is recorded as an alternative (for a user who knows the load, e.g. one request at a time).

**Cache.** ``<cache root>/vllm_profiles/<key>.json`` (cache root: ``$DRAFTTRAIN_CACHE`` or
``~/.cache/drafttrain``); the key is a digest of the host (CPU model, ISA level, usable CPUs), the export
format, the exported weights' sha256 and the target's fingerprint, so a profile is reused only for the
same drafter, target and host kind. The vLLM version is stored in the profile, not in the key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

DEFAULT_LOADS = (1, 8)
DEFAULT_MIN_GAIN = 0.02
PROFILE_DIR = "vllm_profiles"


class ProfileError(ValueError):
    """A profile that cannot choose for the loads asked (a load it did not measure, a malformed row)."""


def host_key(host: dict | None = None) -> dict:
    """The host facts a profile is keyed by: ``cpu_model``, ``isa``, ``usable_cpus`` (:func:`drafttrain.host.describe`)."""
    from drafttrain.host import describe

    d = host if host is not None else describe()
    return {"cpu_model": d.get("cpu_model"), "isa": d.get("isa"), "usable_cpus": d.get("usable_cpus")}


def profile_key(info: dict, host: dict | None = None) -> str:
    """16 hex digits naming the profile of an export on a host.

    Args:
        info: the export's ``export_info.json`` (its ``format``, ``files`` digests and ``target.fingerprint``);
        host: :func:`drafttrain.host.describe`'s dict (None: this host).

    Raises:
        ProfileError: ``info`` has no weight digests (an export written before they were recorded).
    """
    files = info.get("files") or {}
    if not files:
        raise ProfileError("the export records no weight digests: export it again with scripts.export")
    blob = {"host": host_key(host), "format": info.get("format"),
            "weights": sorted((name, f["sha256"]) for name, f in files.items()),
            "target": (info.get("target") or {}).get("fingerprint")}  # fmt: skip
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def profile_path(key: str, root: Path | None = None) -> Path:
    """Where the profile ``key`` is cached (``root``: null = :func:`drafttrain.assets.cache_root`)."""
    from drafttrain.assets import cache_root

    return Path(root or cache_root()) / PROFILE_DIR / f"{key}.json"


def save(profile: dict, info: dict, root: Path | None = None) -> Path:
    """Cache ``profile`` for the export ``info`` on this host (atomically: written beside, then renamed)."""
    from drafttrain.atomic import atomic_write_text

    path = profile_path(profile_key(info), root)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(profile, indent=1), what="the vLLM profile")
    return path


def lookup(info: dict, root: Path | None = None) -> tuple[dict, Path] | None:
    """The cached profile of the export ``info`` on this host and its path, or None (none measured, or
    an export without weight digests)."""
    try:
        path = profile_path(profile_key(info), root)
    except ProfileError:
        return None
    if not path.is_file():
        return None
    return json.loads(path.read_text()), path


def _speedups(row: dict) -> dict[int, float]:
    try:
        return {int(n): float(s) for n, s in row["speedup"].items()}
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(f"a profile row needs 'k' and 'speedup' {{load: x}}, got {row}") from err


def choose(profile: dict, loads=DEFAULT_LOADS, min_gain: float = DEFAULT_MIN_GAIN) -> dict:
    """The served K from a measured profile (module docstring: the rule).

    Args:
        profile: ``{"rows": [{"k": int >= 1, "speedup": {load: spec tok/s / plain tok/s}, "equal": bool}, ...]}``,
            optionally ``"plain_drift": {load: |plain before - plain after| / their mean}``;
        loads: requests in flight the line must hold at (each measured in the profile);
        min_gain: the least margin above 1.0 a K must reach at every load to be served (fraction; 0.02 = 2%);
            a load's plain drift, where larger, is its margin.

    Returns:
        ``{"k": the served K (0 = the target alone), "worst_speedup": its score (1.0 for K = 0),
        "speedup": {load: measured x} for the served K (all 1.0 for K = 0), "best_alone": {load: [K, x]},
        (``best_alone``: each load's best K on its own, K = 0 where none clears its margin), "margin": {load: x}}``.

    Raises:
        ProfileError: no loads, a load the profile did not measure, or a malformed row.
    """
    loads = [int(n) for n in loads]
    if not loads:
        raise ProfileError("loads must name at least one number of requests in flight")
    rows = [(int(r["k"]), _speedups(r), bool(r.get("equal", False))) for r in profile.get("rows", [])]
    for k, sp, _ in rows:
        missing = [n for n in loads if n not in sp]
        if missing:
            raise ProfileError(f"the profile measured K={k} at {sorted(sp)} requests in flight, not at {missing}: "
                               f"measure it there (scripts.serve_check profile_k=... concurrency={loads})")  # fmt: skip
    ok = [(k, sp) for k, sp, eq in rows if eq]
    drift = {int(n): float(x) for n, x in (profile.get("plain_drift") or {}).items()}
    margin = {n: max(min_gain, drift.get(n, 0.0)) for n in loads}
    best_k, best = 0, 1.0
    for k, sp in sorted(ok):
        worst = min(sp[n] for n in loads)
        if all(sp[n] >= 1.0 + margin[n] for n in loads) and worst > best:
            best_k, best = k, worst
    served = dict(next(sp for k, sp in ok if k == best_k)) if best_k else {n: 1.0 for n in loads}
    alone = {}
    for n in loads:
        kn, sn = 0, 1.0
        for k, sp in sorted(ok):
            if sp[n] >= 1.0 + margin[n] and sp[n] > sn:
                kn, sn = k, sp[n]
        alone[n] = [kn, round(sn, 4)]
    return {"k": best_k, "worst_speedup": round(best, 4), "speedup": {n: round(served[n], 4) for n in loads},
            "best_alone": alone, "margin": {n: round(margin[n], 4) for n in loads}}  # fmt: skip


def apply(block: dict, profile: dict, path: Path | str, loads=DEFAULT_LOADS, min_gain: float = DEFAULT_MIN_GAIN) -> dict:
    """The export's ``speculation`` block with K taken from a measured profile (:func:`choose`).

    The model's figures stay under ``model`` (what the cost model expected); ``num_speculative_tokens`` is the
    served K (where the profile serves the target alone, the K of the best single-load alternative, else the
    model's, with ``pays`` False); ``expected_speedup`` is the measured worst speedup over ``loads``;
    ``schedule`` is None (each K was measured as one K at every batch size, which is how vLLM 0.32 runs it);
    ``vllm_profile`` records the loads, the measured rows and the choice; ``line_note`` is the comment the
    serve line carries.
    """
    from drafttrain.export.speculation import MODEL_KEYS

    c = choose(profile, loads, min_gain)
    model = {k: block.get(k) for k in MODEL_KEYS}
    out = {kk: v for kk, v in block.items() if kk not in model}
    load_txt = ", ".join(f"{n} request{'s' if n != 1 else ''}" for n in c["speedup"])
    meas = ", ".join(f"{c['speedup'][n]:.2f}x at {n}" for n in c["speedup"])
    alt = [(n, k, s) for n, (k, s) in c["best_alone"].items() if k and k != c["k"]]
    alt_txt = "; ".join(f"at {n} alone K={k} measured {s:.2f}x" for n, k, s in alt)
    if c["k"]:
        k_served, pays = c["k"], True
        note = f"  # measured in vLLM on this host ({profile.get('vllm_version', 'vLLM')}): K={c['k']} {meas} requests in flight"
    else:
        k_served = alt[0][1] if alt else int(block["num_speculative_tokens"])
        pays = False
        per_k = "; ".join(f"K={r['k']} " + ", ".join(f"{_speedups(r)[n]:.2f}x at {n}" for n in c["speedup"])
                          for r in profile.get("rows", []))  # fmt: skip
        note = (f"  # measured in vLLM on this host: no K holds at {load_txt} ({per_k}): serve without speculation"
                + (f" ({alt_txt})" if alt_txt else ""))  # fmt: skip
    out.update({"num_speculative_tokens": int(k_served), "expected_speedup": c["worst_speedup"], "pays": pays,
                "schedule": None, "model": model, "line_note": note,
                "chosen_by": (f"measured in vLLM on this host ({path}): the K whose worst speedup over {list(c['speedup'])} "
                              f"requests in flight is highest, if >= {1 + min_gain:g}x; else the target alone"),
                "vllm_profile": {"path": str(path), "loads": list(c["speedup"]), "min_gain": min_gain, "choice": c,
                                 "rows": profile.get("rows", []), "vllm_version": profile.get("vllm_version"),
                                 "host": profile.get("host"), "measured_at": profile.get("measured_at")}})  # fmt: skip
    return out


__all__ = ["DEFAULT_LOADS", "DEFAULT_MIN_GAIN", "ProfileError", "apply", "choose", "host_key", "lookup",
           "profile_key", "profile_path", "save"]
