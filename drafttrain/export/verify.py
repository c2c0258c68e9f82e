"""An exported folder checked when it is read back: every check runs before any engine or model starts.

The export (:func:`drafttrain.export.export_drafter`, :func:`drafttrain.export.export_run`) records in
``export_info.json`` what a reader needs to trust the folder (:func:`export_record`):

- ``files``: ``{"model.safetensors": {"sha256": hex, "bytes": int}}``, every weight file written;
- ``target``: the target the drafter was trained for: ``hidden_size``, ``vocab_size``,
  ``num_hidden_layers`` and, when the export knows its folder, ``fingerprint``
  (:func:`drafttrain.fingerprint.folder_fingerprint`: config + weights, not the folder's name);
- ``format`` and ``draft_vocab_size`` (N; N = the target's v for a full vocabulary).

:func:`verify_export` (called by :func:`drafttrain.export.load_exported` and ``scripts.serve_check``) refuses,
naming the cause: no ``export_info.json`` / ``config.json`` / weight file; a weight file of another size
(truncated) or digest; a safetensors header that does not parse; a restricted draft vocabulary without
the ``d2t`` / ``t2d`` (EAGLE-3, DFlash) or ``token_map`` (Medusa) tensors that map draft ids to target ids;
``config.json`` sizes that the weights' shapes contradict, or that differ from the recorded facts; a
target whose hidden size or vocabulary differs, or whose fingerprint is another model's. A folder exported
before the record existed (no ``files``) is accepted with one warning per folder, after the checks that
need no record (headers, shapes, vocabulary maps, sizes against the target).

Only the safetensors headers are read (``safetensors.safe_open``: names, shapes), plus one pass over
each weight file's bytes for its SHA-256 (not remembered anywhere: a tampered file keeps no stale hash).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from drafttrain.export.common import REEXPORT, ExportError
from drafttrain.export.formats import FORMATS, module

log = logging.getLogger(__name__)

INFO = "export_info.json"
WEIGHTS = "model.safetensors"  # the one weight file every format writes (each format module's ``WEIGHTS``)
#: the formats :func:`verify_export` knows the layout of: every format (each module's ``layout(cfg, shapes)``)
CHECKED_FORMATS = tuple(FORMATS)
_WARNED_OLD: set[str] = set()  # folders already warned about (an export without digests): once each


# -- writing the record ---------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    """SHA-256 (hex) of the file's bytes, read in 16 MiB blocks.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def weight_files(fmt: str) -> tuple[str, ...]:
    """The weight files format ``fmt`` writes: :data:`WEIGHTS` for every format."""
    return (WEIGHTS,)


def export_record(out_dir: str | Path, fmt: str, drafter, target_config=None, target_dir: str | Path | None = None) -> dict:
    """The keys :func:`verify_export` checks, for ``export_info.json`` (module docstring).

    Args:
        out_dir: the folder just written; fmt: its format; drafter: the drafter written (its target's
            vocabulary v = ``drafter.vocab_size``, its draft vocabulary N = ``drafter.d2t.numel()``);
        target_config: the target's transformers config (None: the drafter's shared one);
        target_dir: the target's folder, fingerprinted (None: no fingerprint recorded).

    Returns:
        ``{"format", "draft_vocab_size", "target": {...}, "files": {name: {"sha256", "bytes"}}}``.
    """
    out = Path(out_dir)
    tcfg = target_config if target_config is not None else drafter.shared.model_config
    target = {"hidden_size": int(tcfg.hidden_size), "vocab_size": int(drafter.vocab_size),
              "num_hidden_layers": int(tcfg.num_hidden_layers), "fingerprint": None}  # fmt: skip
    if target_dir is not None:
        from drafttrain.fingerprint import folder_fingerprint

        try:
            target["fingerprint"] = folder_fingerprint(target_dir)
        except (FileNotFoundError, ValueError) as err:  # a folder without weights: shapes are still checked
            log.warning("no fingerprint of target %s recorded in %s (%s)", target_dir, INFO, err)
    files = {name: {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
             for name in weight_files(fmt) if (out / name).is_file()}  # fmt: skip
    return {"format": fmt, "draft_vocab_size": int(drafter.d2t.numel()), "target": target, "files": files}


# -- reading it back ------------------------------------------------------------------------------
def read_export_info(folder: str | Path) -> dict:
    """``folder/export_info.json`` parsed.

    Raises:
        ExportError: ``folder`` is not a folder, or has no readable ``export_info.json``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder; pass the folder scripts.export wrote (output_dir)")
    path = folder / INFO
    if not path.is_file():
        raise ExportError(f"{folder} has no {INFO}: not a folder written by scripts.export, or the file was "
                          f"removed; {REEXPORT}")  # fmt: skip
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{path} cannot be read ({type(err).__name__}: {err}); {REEXPORT}") from None
    if not isinstance(info, dict):
        raise ExportError(f"{path} is not a JSON object; {REEXPORT}")
    return info


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a safetensors file, from its header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(int(x) for x in f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError) on a bad file
        raise ExportError(f"{path.name} in {path.parent} is not a readable safetensors file "
                          f"({type(err).__name__}: {err}): it was truncated or corrupted after export; {REEXPORT}") from None  # fmt: skip


def _check_file(folder: Path, name: str, want: dict | None) -> None:
    path = folder / name
    if not path.is_file():
        raise ExportError(f"{folder} has no {name} ({INFO} lists it); the folder is incomplete; {REEXPORT}")
    if want is None:
        return
    size = path.stat().st_size
    if "bytes" in want and size != int(want["bytes"]):
        raise ExportError(f"{name} is {size} bytes, {INFO} recorded {want['bytes']}: the file was truncated or "
                          f"modified after export; {REEXPORT}")  # fmt: skip
    if "sha256" in want and sha256_file(path) != want["sha256"]:
        raise ExportError(f"{name} does not match {INFO}'s sha256: the folder was modified or truncated after "
                          f"export; {REEXPORT}")  # fmt: skip


def _target_facts(target) -> dict[str, Any]:
    """hidden size, vocabulary, folder and a display name of ``target``: a :class:`~drafttrain.target.Target`,
    a transformers config, a config dict, or a model folder (its ``config.json`` is read, nothing loads)."""
    folder = None
    if isinstance(target, (str, Path)):
        folder = Path(target).expanduser()
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ExportError(f"target {folder} is not a model folder (no config.json); pass the target's Hugging Face folder")
        cfg = json.loads(cfg_path.read_text())
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        return {"hidden_size": cfg.get("hidden_size"), "vocab_size": cfg.get("vocab_size"), "folder": folder,
                "name": str(folder)}  # fmt: skip
    if hasattr(target, "model") and hasattr(target, "config"):  # a Target
        head = target.lm_head.weight.shape[0] if getattr(target, "lm_head", None) is not None else None
        src = getattr(target, "source_dir", None)
        return {"hidden_size": target.config.hidden_size, "vocab_size": head or getattr(target.config, "vocab_size", None),
                "folder": Path(src) if src else None, "name": str(src) if src else "the in-memory target"}  # fmt: skip
    get = target.get if isinstance(target, dict) else (lambda k: getattr(target, k, None))
    return {"hidden_size": get("hidden_size"), "vocab_size": get("vocab_size"), "folder": None, "name": "the given target config"}


def verify_export(folder: str | Path, target=None, fmt: str | None = None) -> dict:
    """Check an exported folder before anything loads it (module docstring); its ``export_info.json``.

    Args:
        folder: a folder written by ``scripts.export`` (or :func:`drafttrain.export.export_drafter`).
        target: what it will be served with: a :class:`~drafttrain.target.Target`, a transformers config, a
            config dict, or a model folder (None: only the folder's own consistency is checked).
        fmt: the format the caller will read it as (None: the recorded one).

    Returns:
        The parsed ``export_info.json``.

    Raises:
        ExportError: one line naming what is wrong and what to do (module docstring lists the checks).
    """
    folder = Path(folder)
    info = read_export_info(folder)
    rec_fmt = info.get("format")
    if fmt is not None and rec_fmt != fmt:
        raise ExportError(f"{folder} holds a '{rec_fmt}' export ({INFO}), not '{fmt}'; read it as format={rec_fmt}")
    if not (folder / "config.json").is_file():
        raise ExportError(f"{folder} has no config.json; the folder is incomplete; {REEXPORT}")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except ValueError as err:
        raise ExportError(f"{folder / 'config.json'} is not valid JSON ({err}); {REEXPORT}") from None

    # 1. the weight files: present, their recorded size and digest, a header that parses
    files = info.get("files")
    if files is None:
        key = str(folder.resolve())
        if key not in _WARNED_OLD:
            _WARNED_OLD.add(key)
            log.warning("%s has no weight digests in %s (exported before they were recorded): its files cannot be "
                        "checked against tampering or truncation, only their headers and shapes; %s to record them",
                        folder, INFO, REEXPORT)  # fmt: skip
        files = {name: None for name in weight_files(str(rec_fmt))} if rec_fmt in CHECKED_FORMATS else {}
    for name, want in files.items():
        _check_file(folder, name, want)
    if rec_fmt not in CHECKED_FORMATS:
        raise ExportError(f"{INFO} names format '{rec_fmt}', which this drafttrain cannot check; {REEXPORT}")
    weights = weight_files(rec_fmt)[0]
    shapes = _header(folder / weights)

    # 2. config.json against the weights' shapes, and against the recorded facts
    lay = module(rec_fmt).layout(cfg, shapes)  # the sizes config.json states, per the format's own module
    for name, shape in lay["expect"].items():
        if name not in shapes:
            raise ExportError(f"{weights} has no {name}, which the {rec_fmt} format needs; {REEXPORT}")
        if tuple(shapes[name]) != tuple(shape):
            raise ExportError(f"config.json is inconsistent with {weights}: its sizes give {name} {list(shape)}, the "
                              f"file holds {list(shapes[name])}; config.json was edited after export or belongs to "
                              f"another folder; {REEXPORT}")  # fmt: skip
    rec_target = info.get("target") or {}
    v = lay["target_vocab"] if lay["target_vocab"] is not None else rec_target.get("vocab_size")
    for key, said, recorded in (("draft_vocab_size", lay["draft_vocab"], info.get("draft_vocab_size")),
                                ("target hidden size", lay["target_hidden"], rec_target.get("hidden_size")),
                                ("target vocab size", lay["target_vocab"], rec_target.get("vocab_size"))):  # fmt: skip
        if said is not None and recorded is not None and int(said) != int(recorded):
            raise ExportError(f"config.json gives {key} {said}, {INFO} recorded {recorded} at export: config.json was "
                              f"edited after export; {REEXPORT}")  # fmt: skip

    # 3. a restricted draft vocabulary needs the tensors that map draft ids to target ids
    n = lay["draft_vocab"]
    if n is not None and v is not None and int(n) < int(v):
        for name in lay["vocab_map"]:
            if name not in shapes:
                raise ExportError(f"{weights} has no {name}: a draft vocabulary of {n} < the target's {v} tokens needs "
                                  f"{'/'.join(lay['vocab_map'])} to map draft ids to target tokens (without it the "
                                  f"engine drafts the wrong tokens or refuses the folder); {REEXPORT}")  # fmt: skip
        lengths = {"d2t": (int(n),), "token_map": (int(n),), "t2d": (int(v),)}
        for name in lay["vocab_map"]:
            if name in lengths and tuple(shapes[name]) != lengths[name]:
                raise ExportError(f"{weights}: {name} has shape {list(shapes[name])}, the draft vocabulary of {n} (target "
                                  f"{v}) needs {list(lengths[name])}; {REEXPORT}")  # fmt: skip

    # 4. the target it will be served with
    if target is not None:
        t = _target_facts(target)
        want_h = lay["target_hidden"]
        if t["hidden_size"] is not None and int(t["hidden_size"]) != int(want_h):
            raise ExportError(f"{folder} was exported for a target with hidden size {want_h}; {t['name']} has "
                              f"{t['hidden_size']}: serve it with the target it was trained for "
                              f"({info.get('target_path', 'see ' + INFO)})")  # fmt: skip
        if t["vocab_size"] is not None and v is not None and int(t["vocab_size"]) != int(v):
            raise ExportError(f"{folder} was exported for a target with a vocabulary of {v}; {t['name']} has "
                              f"{t['vocab_size']}: serve it with the target it was trained for "
                              f"({info.get('target_path', 'see ' + INFO)})")  # fmt: skip
        fp = rec_target.get("fingerprint")
        if fp and t["folder"] is not None:
            from drafttrain.fingerprint import folder_fingerprint

            try:
                got = folder_fingerprint(t["folder"])
            except FileNotFoundError as err:
                raise ExportError(f"target {t['folder']}: {err}; pass the target's Hugging Face folder") from None
            if got != fp:
                raise ExportError(f"{folder} was exported for target {info.get('target_path', '?')} (fingerprint {fp}); "
                                  f"{t['name']} is another model (fingerprint {got}): serve it with the target it was "
                                  f"trained for, or re-export with target_path=<that folder>")  # fmt: skip
    return info


__all__ = ["export_record", "read_export_info", "sha256_file", "verify_export", "weight_files"]
