"""Identify a target by its content (config + weights), not by ``target.name`` or a folder's basename.

Caches and checks that depend on the target (the self-distillation cache, ``scripts.generate_data``'s
job fingerprint, the feature cache, the harness's checkpoint/target check, ``resume=true``) use
:func:`target_fingerprint`: two different models that share a name get different fingerprints, and
the same model under two names gets the same one.

Hashing is cheap after the first time: a weight file's SHA-256 is computed once and remembered in
``<cache_root>/file_hashes.json`` keyed by (absolute path, size, mtime), so the 517 MB SmolLM2 folder
costs one read (~1-3 s), then nothing until the file changes.

The code and the data have theirs too: :func:`git_sha` (the commit a checkpoint or an evaluation ran)
and :func:`dataset_fingerprint` (the token rows a run trained on, the rows a feature cache holds).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

#: Architecture fields of a random tiny target (``target.random_init``): with the seed they fix its weights.
_TINY_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "seed")
#: config.json keys that do not change the model (bookkeeping written by whichever library saved it).
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.gguf")


def _hash_cache_path() -> Path:
    from drafttrain.assets import cache_root

    return cache_root() / "file_hashes.json"


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, remembered by (absolute path, size, mtime_ns).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    store = _hash_cache_path()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    digest = h.hexdigest()
    known = {k: v for k, v in known.items() if not k.startswith(f"{path}|")}  # drop stale entries of this file
    known[key] = digest
    from drafttrain.atomic import DiskFullError, atomic_write_text

    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(store, json.dumps(known), "the file-hash cache", unique=True)  # unique: ranks may write at once
    except (OSError, DiskFullError):  # a read-only or full cache is fine: we just hash again next time
        pass
    return digest


def folder_fingerprint(folder: str | Path) -> str:
    """16 hex digits from a model folder's ``config.json`` (bookkeeping keys dropped) and its weight files' bytes.

    Raises:
        FileNotFoundError: no ``config.json`` or no weight file in ``folder``.
    """
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in _CONFIG_NOISE}
    weights = sorted({p for g in _WEIGHT_GLOBS for p in folder.glob(g)})
    if not weights:
        raise FileNotFoundError(f"{folder} has no weight file ({', '.join(_WEIGHT_GLOBS)})")
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for p in weights:
        h.update(f"|{p.name}:{file_sha256(p)}".encode())
    return h.hexdigest()[:16]


def target_fingerprint(cfg) -> str:
    """Content fingerprint of the target a :class:`~drafttrain.config.TargetConfig` describes (no model loads).

    ``random_init``: its architecture fields and seed (they fix the weights; every tiny target shares the
    packaged tokenizer). Otherwise: :func:`folder_fingerprint` of :func:`~drafttrain.target.resolve_target_dir`
    (the packaged GGUF: its converted folder). ``target.name`` and ``target.dtype`` play no part.

    Raises:
        FileNotFoundError / MissingAssetError: as :func:`~drafttrain.target.resolve_target_dir`.
    """
    from drafttrain.target import resolve_target_dir

    if cfg.random_init:
        spec = {k: getattr(cfg, k) for k in _TINY_FIELDS}
        return "tiny-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:11]
    return folder_fingerprint(resolve_target_dir(cfg))


def git_sha() -> str | None:
    """The commit of the code checked out here (``git rev-parse HEAD``); None where git cannot tell
    (no git, not a repository, no answer within 5 s)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.returncode == 0 and out.stdout.strip()) or None


def dataset_fingerprint(ds, columns: tuple[str, ...], dtype: str = "int64", lengths: bool = False) -> str:
    """sha256 (16 hex digits) of a ``datasets.Dataset``'s token ``columns``, row by row, in order.

    Each row hashes its value of every column in ``columns`` the dataset has (others, e.g. features, play
    no part), as ``dtype`` integers, each preceded by its length (8 bytes, little-endian) with ``lengths``.
    Two formats are stored on disk and so fixed: ``train_data_sha`` (``input_ids`` and ``loss_mask``, int64)
    and a feature cache's (``input_ids``, int32, lengths; :mod:`drafttrain.data.feature_cache`).
    Read in Arrow batches: memory stays bounded and no Python object is made per token.
    """
    present = [k for k in columns if k in ds.column_names]
    h = hashlib.sha256()
    for batch in ds.select_columns(present).with_format("arrow").iter(batch_size=1000):
        cols = []
        for k in present:
            col = batch.column(k).combine_chunks()  # a list array: row i is values[offsets[i]:offsets[i + 1]]
            cols.append((col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False).astype(dtype)))
        for i in range(batch.num_rows):
            for offsets, values in cols:
                row = values[offsets[i]:offsets[i + 1]]
                if lengths:
                    h.update(len(row).to_bytes(8, "little"))
                h.update(row.tobytes())
    return h.hexdigest()[:16]
