"""Offline feature cache: the target runs once over a dataset; training then reads its features from disk.

For every row of a dataset with ``input_ids`` (length L) the cache stores the target's hidden states
f_0..f_{L-2} of the layers a drafter declares (``feature_layers``, :class:`drafttrain.drafters.base.DrafterSpec`;
default the final post-norm state, the feature f_t that EAGLE-style drafters read, docs/design.md, "Definitions";
several layers concatenated along the last dimension in the declared order) and optionally the target's top-k logits at those positions (``lm_head(f_t)``, the distribution of
token t+1). Rows are stored in dataset order, in shards with a manifest
(:class:`drafttrain.data.shards.ShardStore`), so an interrupted run resumes where it stopped.

Columns (one row per dataset row):

- ``features``: [L-1, n * d] (n = number of feature layers), ``float16``; or, with ``dtype="bfloat16"``,
  ``int16`` holding the bf16 bit patterns (Arrow has no bf16 type; the batch collate turns them back
  into bf16, :func:`drafttrain.data.batches.collate`);
- ``topk_ids`` int32 [L-1, k] and ``topk_logits`` float16 [L-1, k] (``top_k`` > 0 only), best first.

``feature_cache.json`` records :data:`SCHEMA_VERSION`, the fingerprint of the dataset's
``input_ids`` (a cache is refused for any other dataset), d, the feature layer ids (a cache is refused
for a drafter that reads other layers; a cache without them holds the final state), dtype, k, the
target, and the bytes estimated before and written after the run. Shape letters: s sequence, d hidden, v vocab, k top-k.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from drafttrain.data.lock import locks_folder
from drafttrain.data.shards import ShardStore, atomic_write_text, load_dataset_folder, quiet, read_json
from drafttrain.fingerprint import dataset_fingerprint
from drafttrain.target import resolve_feature_layers

log = logging.getLogger(__name__)

#: How feature_cache.json fingerprints the dataset's rows (:func:`drafttrain.fingerprint.dataset_fingerprint`):
#: fixed, existing caches are checked against it.
ROWS_FINGERPRINT = {"columns": ("input_ids",), "dtype": "int32", "lengths": True}
#: Bump when the stored columns or their meaning change: older caches are refused.
SCHEMA_VERSION = 1
META = "feature_cache.json"
#: Bytes a shard costs besides its column data: Arrow schema + datasets' state.json / dataset_info.json
#: (measured: ~1.9 KB with top-k columns, ~1.3 KB without).
SHARD_OVERHEAD = 2048
#: Bytes of manifest.json + feature_cache.json.
JOB_OVERHEAD = 640


class FeatureCacheError(ValueError):
    """The cache does not fit the dataset (other rows, other schema version) or is incomplete."""


def cache_features_schema(hidden_size: int, dtype: str, top_k: int):
    """``datasets.Features`` of a cache shard."""
    import datasets

    cols = {"features": datasets.Array2D(shape=(None, hidden_size), dtype="float16" if dtype == "float16" else "int16")}
    if top_k:
        cols["topk_ids"] = datasets.Array2D(shape=(None, top_k), dtype="int32")
        cols["topk_logits"] = datasets.Array2D(shape=(None, top_k), dtype="float16")
    return datasets.Features(cols)


def estimate_bytes(lengths: list[int], hidden_size: int, top_k: int, shard_size: int, num_layers: int = 1) -> int:
    """Bytes the cache of rows with these lengths will take on disk (within ~1% for real sizes).

    Per stored position: 2 n d bytes of features (n = ``num_layers``) (+ 4 k + 2 k of top-k ids and logits) plus a 4-byte
    Arrow list offset per column; per row a 4-byte offset per column; per shard :data:`SHARD_OVERHEAD`;
    per cache :data:`JOB_OVERHEAD`.

    Args:
        lengths: L of every row (positions stored: L - 1).
        hidden_size: d.
        top_k: k (0 = no top-k columns).
        shard_size: rows per shard.
        num_layers: n, the number of target layers stored per position.
    """
    positions = sum(max(n - 1, 0) for n in lengths)
    ncols = 3 if top_k else 1
    per_position = 2 * hidden_size * num_layers + (6 * top_k if top_k else 0) + 4 * ncols
    shards = -(-len(lengths) // shard_size) if lengths else 0
    return positions * per_position + len(lengths) * 4 * ncols + shards * SHARD_OVERHEAD + JOB_OVERHEAD


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (the cache's shards and json files)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _to_storage(h: torch.Tensor, dtype: str) -> np.ndarray:
    """[n, d] float -> float16 array, or int16 array of bf16 bit patterns."""
    if dtype == "float16":
        return h.to(torch.float16).numpy()
    return h.to(torch.bfloat16).view(torch.int16).numpy()


@torch.no_grad()
def rows_features(target, rows: list[list[int]], dtype: str, top_k: int, chunk: int = 256, feature_layers=None) -> list[dict]:
    """Features of ``feature_layers`` (and top-k logits) of right-padded rows in one target forward."""
    device = target.device
    lengths = [len(r) for r in rows]
    s = max(lengths)
    ids = torch.zeros((len(rows), s), dtype=torch.long)
    attn = torch.zeros((len(rows), s), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r)
        attn[i, : len(r)] = 1
    tout = target.forward(ids.to(device), attention_mask=attn.to(device), with_logits=False, feature_layers=feature_layers)
    hidden, feats = tout.hidden, tout.features  # [b, s, d] final post-norm state, [b, s, n * d] stored
    return [_split_features([r], hidden[i], feats[i], [0], target, dtype, top_k, chunk)[0] for i, r in enumerate(rows)]


def pack_rows(lengths: list[int], order: list[int], pack_tokens: int) -> list[list[int]]:
    """Rows (indices into ``lengths``, taken in ``order``) grouped into packs of at most ``pack_tokens`` tokens,
    each pack filled in order until the next row would overflow it (a row longer than ``pack_tokens`` is a pack of
    its own). Every index appears once; the packs keep ``order``."""
    packs: list[list[int]] = []
    used = 0
    for j in order:
        if packs and used + lengths[j] <= pack_tokens:
            packs[-1].append(j)
            used += lengths[j]
        else:
            packs.append([j])
            used = lengths[j]
    return packs


def packed_inputs(rows: list[list[int]], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows concatenated into one sequence: input_ids [1, T] int64, position_ids [1, T] (each row from 0) and the
    additive attention mask [1, 1, T, T] of ``dtype`` (0 where token i may attend token j: same row and j <= i;
    the dtype's most negative value elsewhere), T = sum of the row lengths. The block-diagonal causal mask of
    packed training (each row sees only itself), so one forward equals a separate forward per row."""
    ids = torch.cat([torch.as_tensor(r, dtype=torch.long) for r in rows])[None]
    pos = torch.cat([torch.arange(len(r)) for r in rows])[None]
    seg = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)])
    T = ids.shape[1]
    ar = torch.arange(T)
    allowed = (seg[:, None] == seg[None, :]) & (ar[:, None] >= ar[None, :])
    mask = torch.zeros((T, T), dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return ids.to(device), pos.to(device), mask[None, None].to(device)


#: Relative tolerance of :func:`packing_exact`'s probe by the target's dtype (a packed forward differs from a
#: separate one only by summation order).
PACK_PROBE_RTOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


@torch.no_grad()
def packing_exact(target) -> tuple[bool, str]:
    """(whether one packed forward of several rows equals a separate forward per row on ``target``, why not).

    Read from the model, not from its name: a target with recurrent layers is not packable (a block mask
    does not reset a recurrent state between rows: :attr:`drafttrain.target.Target.recurrent`); any other
    target is probed once (rows of 7 and 5 tokens, packed with :func:`packed_inputs`, against a forward of
    each alone; the final state compared at :data:`PACK_PROBE_RTOL`), so a layer that ignores the custom mask
    (its own sliding window, attention sinks, a sparse indexer) is found by the mismatch. Memoised on the target.
    """
    memo = target.__dict__.get("_packing_exact")
    if memo is not None:
        return memo
    if getattr(target, "recurrent", False):
        memo = (False, f"{type(target.model).__name__} has recurrent layers (a block mask does not reset their state)")
    else:
        g = torch.Generator().manual_seed(0)
        vocab = int(target.config.vocab_size)
        rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 5)]
        dt = target.model.get_input_embeddings().weight.dtype
        try:
            ids, pos, mask = packed_inputs(rows, dt, target.device)
            packed = target.forward(ids, attention_mask=mask, position_ids=pos, with_logits=False).hidden[0].float()
            alone = torch.cat([target.forward(torch.tensor([r], device=target.device), with_logits=False).hidden[0].float()
                               for r in rows])  # fmt: skip
            err = float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-6))
            tol = PACK_PROBE_RTOL.get(dt, 1e-2)
            memo = (err <= tol, f"a packed forward differs from separate ones by {err:.2e} (relative; tolerance {tol:g})")
        except Exception as e:  # noqa: BLE001 - any failure of the packed forward means: do not pack
            memo = (False, f"a packed forward fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    target.__dict__["_packing_exact"] = memo
    return memo


def _split_features(rows: list[list[int]], hidden: torch.Tensor, feats: torch.Tensor, starts: list[int], target,
                    dtype: str, top_k: int, chunk: int) -> list[dict]:
    out = []
    for i, n in enumerate(len(r) for r in rows):
        a = starts[i]
        h = hidden[a : a + max(n - 1, 0)]  # [n-1, d]: f_0..f_{n-2} (the LM head's input, for top-k)
        row = {"features": _to_storage(feats[a : a + max(n - 1, 0)].float().cpu(), dtype)}
        if top_k:
            vals, idx = [], []
            for b in range(0, h.shape[0], chunk):  # [chunk, v] logits at a time
                v, j = target.lm_head(h[b : b + chunk]).float().topk(top_k, dim=-1)
                vals.append(v.cpu())
                idx.append(j.cpu())
            row["topk_logits"] = torch.cat(vals).to(torch.float16).numpy() if vals else np.zeros((0, top_k), np.float16)
            row["topk_ids"] = torch.cat(idx).to(torch.int32).numpy() if idx else np.zeros((0, top_k), np.int32)
        out.append(row)
    return out


@torch.no_grad()
def packed_rows_features(target, rows: list[list[int]], dtype: str, top_k: int, chunk: int = 256,
                          feature_layers=None) -> list[dict]:
    """Features of ``feature_layers`` (and top-k logits) of rows packed into one forward (no padding):
    :func:`packed_inputs`; equal to :func:`rows_features` of the same rows up to summation order."""
    dt = target.model.get_input_embeddings().weight.dtype
    ids, pos, mask = packed_inputs(rows, dt, target.device)
    tout = target.forward(ids, attention_mask=mask, position_ids=pos, with_logits=False, feature_layers=feature_layers)
    starts, a = [], 0
    for r in rows:
        starts.append(a)
        a += len(r)
    return _split_features(rows, tout.hidden[0], tout.features[0], starts, target, dtype, top_k, chunk)


@quiet
@locks_folder("out_dir", "lock_wait_s")  # one run writes a cache folder at a time
def build_feature_cache(
    target,
    ds,
    out_dir: str | Path,
    dtype: str = "float16",
    top_k: int = 0,
    batch_size: int = 8,
    shard_size: int = 64,
    target_name: str = "target",
    progress: bool = True,
    target_fingerprint: str | None = None,
    feature_layers=None,
    lock_wait_s: float = 0.0,
    pack_tokens: int = 0,
) -> dict:
    """Run the target once over ``ds`` and store its features in ``out_dir`` (resumable; one run per folder at a
    time: :func:`drafttrain.data.lock.folder_lock` is held for the whole call).

    Args:
        target: a :class:`drafttrain.target.Target`.
        ds: a ``datasets.Dataset`` with ``input_ids`` (e.g. from :func:`drafttrain.data.selfdistill.load_generated`).
        out_dir: the cache folder (shards, ``manifest.json``, ``feature_cache.json``).
        dtype: storage dtype of the features: ``"float16"`` or ``"bfloat16"``.
        top_k: also store the target's top-k logits (0: none).
        batch_size: rows per target forward (sorted by length within a shard: little padding).
        shard_size: rows per shard (the unit of resume).
        target_name: recorded in the metadata (for messages).
        target_fingerprint: the target's content fingerprint (:func:`drafttrain.fingerprint.target_fingerprint`),
            part of the job fingerprint and checked when the cache is attached to a training run.
        feature_layers: the target layer ids to store (a drafter's declaration; default the final
            post-norm state), concatenated per position; recorded (resolved) in the metadata.
        lock_wait_s: seconds to wait while another run writes ``out_dir`` (0: refuse at once).
        pack_tokens: > 0: rows are packed into forwards of at most this many tokens with a block-diagonal causal
            mask (:func:`pack_rows`, :func:`packed_inputs`: no padding) where the target allows it
            (:func:`packing_exact`; else the padded batches of ``batch_size`` rows, said once in the log);
            0: padded batches of ``batch_size`` rows sorted by length.

    Returns:
        The metadata dict written to ``feature_cache.json`` (``bytes_estimated``, ``bytes_written``, ...).

    Raises:
        ValueError: bad ``dtype``/``top_k``; a dataset without ``input_ids``; a layer id outside the target.
        drafttrain.data.shards.JobMismatchError: ``out_dir`` holds a cache of another dataset or settings.
        drafttrain.data.lock.FolderLockedError: another process is writing ``out_dir`` (after ``lock_wait_s``).
    """
    import datasets
    from tqdm.auto import tqdm

    if dtype not in ("float16", "bfloat16") or top_k < 0:
        raise ValueError(f"dtype must be float16|bfloat16 and top_k >= 0, got {dtype!r}, {top_k}")
    if "input_ids" not in ds.column_names:
        raise ValueError("the dataset has no input_ids column")
    out_dir = Path(out_dir)
    d = target.config.hidden_size
    layers = resolve_feature_layers(feature_layers, target.num_hidden_layers)
    lengths = [len(x) for x in ds.with_format(None)["input_ids"]]
    fp = dataset_fingerprint(ds, **ROWS_FINGERPRINT)
    job = {"schema_version": SCHEMA_VERSION, "dataset_fingerprint": fp, "target": target_name, "dtype": dtype,
           "top_k": top_k, "shard_size": shard_size, "rows": len(ds), "hidden_size": d,
           "target_fingerprint": target_fingerprint}
    if layers != (target.num_hidden_layers,):  # (the final state alone keeps the fingerprints of older caches)
        job["feature_layers"] = list(layers)
    if pack_tokens > 0:
        ok, why = packing_exact(target)
        if not ok:
            log.warning("feature cache: rows are not packed on this target (%s): padded batches of %d rows", why, batch_size)
            pack_tokens = 0
    if pack_tokens > 0:  # (packing changes the floats by summation order only; recorded, older caches keep theirs)
        job["pack_tokens"] = int(pack_tokens)
    job_dtype = getattr(target, "dtype_name", "float32")
    if job_dtype != "float32":  # the target's own dtype (target.dtype=auto may load bf16); fp32 keeps old fingerprints
        job["target_dtype"] = job_dtype
    job["fingerprint"] = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    estimate = estimate_bytes(lengths, d, top_k, shard_size, num_layers=len(layers))
    store = ShardStore(out_dir, job)
    schema = cache_features_schema(d * len(layers), dtype, top_k)
    starts = list(range(0, len(ds), shard_size))
    done = sum(min(shard_size, len(ds) - a) for i, a in enumerate(starts) if store.is_done(i))
    bar = tqdm(total=len(ds), initial=done, desc="cache features", unit="row", disable=not progress, dynamic_ncols=True)
    t0, tokens = time.time(), 0
    plain = ds.with_format(None)
    for i, a in enumerate(starts):
        if store.is_done(i):
            continue
        idx = list(range(a, min(a + shard_size, len(ds))))
        rows: dict[int, dict] = {}
        by_len = sorted(idx, key=lambda j: (lengths[j], j))
        if pack_tokens > 0:
            groups = pack_rows(lengths, by_len[::-1], pack_tokens)  # longest first: the short rows fill the gaps
        else:
            groups = [by_len[b : b + batch_size] for b in range(0, len(by_len), batch_size)]
        for chunk in groups:
            fn = packed_rows_features if pack_tokens > 0 else rows_features
            chunk_rows = fn(target, [plain[j]["input_ids"] for j in chunk], dtype, top_k, feature_layers=layers)
            for j, r in zip(chunk, chunk_rows):
                rows[j] = r
            tokens += sum(lengths[j] for j in chunk)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}", refresh=False)
        cols = {k: [rows[j][k] for j in idx] for k in schema}
        store.write(i, datasets.Dataset.from_dict(cols, features=schema), {"rows": len(idx)})
        bar.update(len(idx))
    bar.close()
    meta = {**job, "feature_layers": list(layers), "num_hidden_layers": target.num_hidden_layers, "complete": True,
            "bytes_estimated": estimate, "bytes_written": 0}
    atomic_write_text(out_dir / META, json.dumps(meta, indent=1))
    while meta["bytes_written"] != folder_bytes(out_dir):  # shards + manifest + this file (its own size included)
        meta["bytes_written"] = folder_bytes(out_dir)
        atomic_write_text(out_dir / META, json.dumps(meta, indent=1))
    log.info("feature cache %s: %d rows, %d bytes written (estimated %d)", out_dir, len(ds), meta["bytes_written"], estimate)
    return meta


def cached_layers(meta: dict, num_hidden_layers: int) -> tuple[int, ...]:
    """The resolved target layer ids a cache's metadata says it holds (none recorded: the final state)."""
    return tuple(meta["feature_layers"]) if "feature_layers" in meta else (int(num_hidden_layers),)


def load_feature_cache(path: str | Path, ds=None, target_cfg=None, feature_layers=None, num_hidden_layers: int | None = None):
    """The cache as one ``datasets.Dataset`` in dataset row order.

    Args:
        path: a folder written by :func:`build_feature_cache`.
        ds: if given, the dataset the cache must belong to (same ``input_ids``, row for row).
        target_cfg: if given, the :class:`~drafttrain.config.TargetConfig` the cache must have been made
            with (compared by :func:`drafttrain.fingerprint.target_fingerprint`, not by name).
        feature_layers, num_hidden_layers: if given, the layer ids the reader needs (resolved against
            L = ``num_hidden_layers``); the cache must hold exactly these, in this order.

    Raises:
        FeatureCacheError: no finished cache there, another schema version, another dataset, or other
            feature layers.
    """
    import datasets

    path = Path(path).expanduser()
    meta_path = path / META
    if not meta_path.is_file():
        raise FeatureCacheError(f"no finished feature cache in {path}: run `python -m scripts.cache_features` to completion")
    rerun = "rerun `python -m scripts.cache_features` with the same arguments (it rebuilds what is missing)"
    meta = read_json(meta_path, f"delete it and {rerun}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise FeatureCacheError(
            f"{path}: feature cache schema version {meta.get('schema_version')}, this code reads {SCHEMA_VERSION}; rebuild it"
        )
    if target_cfg is not None:
        from drafttrain.fingerprint import target_fingerprint

        now = target_fingerprint(target_cfg)
        if meta.get("target_fingerprint") != now:
            raise FeatureCacheError(
                f"{path} holds the features of target {meta.get('target')!r} (fingerprint "
                f"{meta.get('target_fingerprint')}), not of this run's target {target_cfg.name!r} (fingerprint {now}): "
                f"rebuild it with `python -m scripts.cache_features` for this target, or use data.features=live"
            )
    if num_hidden_layers is not None:
        want = resolve_feature_layers(feature_layers, num_hidden_layers)
        have = cached_layers(meta, num_hidden_layers)
        if have != want:
            raise FeatureCacheError(
                f"{path} holds the target's hidden states of layers {list(have)}, but the drafter reads layers "
                f"{list(want)} (layer id i = the state entering decoder layer i, {num_hidden_layers} = the final "
                f"post-norm state); rebuild it with `python -m scripts.cache_features ... feature_layers=[{','.join(map(str, want))}]`"
            )
    if ds is not None:
        if len(ds) != meta["rows"] or dataset_fingerprint(ds, **ROWS_FINGERPRINT) != meta["dataset_fingerprint"]:
            raise FeatureCacheError(f"{path} was built for another dataset ({meta['rows']} rows, input_ids "
                                    f"fingerprint {meta['dataset_fingerprint']}); rebuild it for this one")
    n = -(-meta["rows"] // meta["shard_size"])
    parts = [load_dataset_folder(path / f"shard_{i:05d}", f"delete {path / f'shard_{i:05d}'} and {rerun}") for i in range(n)]
    if not parts:
        width = meta["hidden_size"] * len(meta.get("feature_layers", [None]))
        return datasets.Dataset.from_dict({k: [] for k in cache_features_schema(width, meta["dtype"], meta["top_k"])})
    return datasets.concatenate_datasets(parts)


def attach_feature_cache(ds, path: str | Path, target_cfg=None, feature_layers=None, num_hidden_layers: int | None = None):
    """``ds`` with the cache's columns (``features`` [+ ``topk_ids``, ``topk_logits``]) joined row by row.

    A ``features`` column the dataset already has is replaced by the cache's. ``feature_layers`` /
    ``num_hidden_layers``: the layers the drafter reads (checked as in :func:`load_feature_cache`).

    Raises:
        FeatureCacheError: the cache does not belong to ``ds`` or (``target_cfg`` given) was made with
            another target, or holds other feature layers than ``feature_layers`` (see :func:`load_feature_cache`).
    """
    import datasets

    cache = load_feature_cache(path, ds, target_cfg, feature_layers, num_hidden_layers)
    drop = [c for c in cache.column_names if c in ds.column_names]
    base = ds.remove_columns(drop) if drop else ds
    if base._indices is not None:  # a selection: materialise the order so the rows line up
        base = base.flatten_indices(keep_in_memory=True)
    return datasets.concatenate_datasets([base, cache], axis=1)
