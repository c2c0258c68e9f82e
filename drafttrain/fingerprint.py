"""Identify a target by its content (config + weights), not by ``target.name`` or a folder's basename.

Caches and checks that depend on the target (the self-distillation cache, ``scripts.generate_data``'s
job fingerprint, the feature cache, the harness's checkpoint/target check, ``resume=true``) use
:func:`target_fingerprint`: two different models that share a name get different fingerprints, and
the same model under two names gets the same one.

Hashing is cheap after the first time: a weight file's SHA-256 is computed once and remembered in
``<cache_root>/file_hashes.json`` keyed by (absolute path, size, mtime), so the 517 MB SmolLM2 folder
costs one read (~1-3 s), then nothing until the file changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
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
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=store.parent, prefix=".file_hashes.")  # unique: ranks may write at once
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        os.replace(tmp, store)
    except OSError:  # a read-only cache is fine: we just hash again next time
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


def target_label(cfg) -> str:
    """``"<name>@<fingerprint>"``: readable in a message, exact in a key."""
    return f"{cfg.name}@{target_fingerprint(cfg)}"
