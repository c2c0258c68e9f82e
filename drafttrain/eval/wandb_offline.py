"""Read a W&B offline run (``wandb/offline-run-*/run-<id>.wandb``) back without a server.

wandb 0.31 ships no reader for its offline files (``wandb.Api()`` needs a server and the old
``wandb.sdk.internal.datastore`` is gone), so tests and notebooks read them here. The format
(docs/design.md, "Platform notes", and checked against files written by wandb 0.31):

- a 7-byte header: ``b":W&B"``, magic 0xBEE1 (uint16, little endian), version 0 (uint8);
- then the LevelDB log framing, counted from the start of the file: 32 KiB blocks; each chunk has a
  7-byte header ``<crc32: uint32 LE> <length: uint16 LE> <type: uint8>`` (type 1 FULL, 2 FIRST,
  3 MIDDLE, 4 LAST) and ``length`` payload bytes; fewer than 7 bytes left in a block are zero
  padding. The crc is zlib's CRC-32 of the type byte followed by the payload;
- each reassembled payload is a ``wandb.proto.wandb_internal_pb2.Record``: ``run`` (id, project,
  name), ``config`` (updates), ``history`` (one row per step), ``summary`` (updates), ``exit``...
  Items carry ``key`` or ``nested_key`` (a path) and a JSON-encoded ``value_json``.

Logged tables (``wandb.Table``) appear in history as ``{"_type": "table-file", "path": ...}``;
:meth:`OfflineRun.table` loads the JSON file they point to under the run's ``files/`` folder.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class OfflineRunError(ValueError):
    """The file is not a W&B offline run file, or a chunk is corrupt."""


def iter_payloads(path: str | Path, strict: bool = False) -> Iterator[bytes]:
    """Yield the raw record payloads of a ``.wandb`` file in order.

    Args:
        path: the ``run-<id>.wandb`` file.
        strict: raise on a bad checksum or a truncated chunk; otherwise stop there quietly (what a
            run that is still writing, or was killed, leaves at the end of its file).

    Raises:
        OfflineRunError: wrong header (always), or corrupt data when ``strict``.
    """
    data = Path(path).read_bytes()
    if data[: len(HEADER)] != HEADER:
        raise OfflineRunError(f"{path} is not a W&B offline run file (header {data[:7]!r})")
    pos, parts = len(HEADER), None
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # block trailer: zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero-filled rest of a block (preallocated or padded)
            pos += left
            continue
        payload = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            if strict:
                raise OfflineRunError(f"{path}: corrupt or truncated chunk at byte {pos}")
            return
        pos += CHUNK_HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            parts = [payload]
        elif kind == MIDDLE and parts is not None:
            parts.append(payload)
        elif kind == LAST and parts is not None:
            yield b"".join(parts + [payload])
            parts = None
        elif strict:
            raise OfflineRunError(f"{path}: unexpected chunk type {kind} at byte {pos}")


def iter_records(path: str | Path, strict: bool = False):
    """Yield ``wandb_internal_pb2.Record`` messages of a ``.wandb`` file (see :func:`iter_payloads`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    for payload in iter_payloads(path, strict=strict):
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def _item_path(item) -> list[str]:
    return list(item.nested_key) if item.nested_key else [item.key]


def _set(d: dict, path: list[str], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _remove(d: dict, path: list[str]) -> None:
    for k in path[:-1]:
        d = d.get(k, {})
    d.pop(path[-1], None)


@dataclass
class OfflineRun:
    """What an offline run logged.

    Attributes:
        path: the ``run-<id>.wandb`` file; ``files_dir`` its ``files/`` folder (tables, media).
        run_id, project, name: from the run record.
        config: the run config (``{"_wandb": ...}`` bookkeeping removed).
        history: one dict per logged step, in order; keys as logged (``train/loss``...) plus
            wandb's ``_step``, ``_runtime``, ``_timestamp``; tables as their ``table-file`` dicts.
        summary: the final summary (last value of every key unless set explicitly).
        exit_code: the run's exit code (None when the file ends before the exit record).
    """

    path: Path
    run_id: str = ""
    project: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None

    @property
    def files_dir(self) -> Path:
        return self.path.parent / "files"

    def series(self, key: str) -> list[tuple[int, Any]]:
        """(step, value) of every history row that has ``key``."""
        return [(row["_step"], row[key]) for row in self.history if key in row]

    def table(self, key: str, step: int | None = None) -> tuple[list[str], list[list]]:
        """(columns, rows) of the table logged under ``key`` at ``step`` (default: the last one).

        Raises:
            KeyError: no table was logged under ``key`` (at ``step``).
        """
        rows = [r for r in self.history if isinstance(r.get(key), dict) and r[key].get("_type") == "table-file"]
        if step is not None:
            rows = [r for r in rows if r["_step"] == step]
        if not rows:
            raise KeyError(f"no table '{key}'" + (f" at step {step}" if step is not None else ""))
        t = json.loads((self.files_dir / rows[-1][key]["path"]).read_text())
        return t["columns"], t["data"]


def read_run(path: str | Path, strict: bool = False) -> OfflineRun:
    """Read an offline run.

    Args:
        path: a ``run-<id>.wandb`` file, an ``offline-run-*`` folder, or a folder with a ``wandb/``
            subfolder (a drafttrain run folder: its newest offline run is read).
        strict: see :func:`iter_payloads`.

    Raises:
        FileNotFoundError: no offline run under ``path``. OfflineRunError: not a W&B file.
    """
    path = find_run_file(path)
    run = OfflineRun(path=path)
    for rec in iter_records(path, strict=strict):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project, run.name = rec.run.run_id, rec.run.project, rec.run.display_name
            for item in rec.run.config.update:
                _set(run.config, _item_path(item), json.loads(item.value_json))
        elif kind == "config":
            for item in rec.config.update:
                if item.key or item.nested_key:
                    _set(run.config, _item_path(item), json.loads(item.value_json))
            for item in rec.config.remove:
                _remove(run.config, _item_path(item))
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                _set(row, _item_path(item), json.loads(item.value_json))
            row.setdefault("_step", rec.history.step.num)
            run.history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                _set(run.summary, _item_path(item), json.loads(item.value_json))
            for item in rec.summary.remove:
                _remove(run.summary, _item_path(item))
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def find_run_file(path: str | Path) -> Path:
    """The ``run-*.wandb`` file for a file, an ``offline-run-*`` folder or a folder holding ``wandb/``
    (newest run first by folder name, which starts with the date).

    Raises:
        FileNotFoundError: nothing matches.
    """
    path = Path(path)
    if path.is_file():
        return path
    for pattern in ("run-*.wandb", "offline-run-*/run-*.wandb", "wandb/offline-run-*/run-*.wandb"):
        found = sorted(path.glob(pattern))
        if found:
            return found[-1]
    raise FileNotFoundError(f"no W&B offline run file under {path}")
