"""Resumable work in shards: each shard is a ``datasets`` folder written atomically, recorded in a manifest.

A shard counts as done only once the manifest names it, and the manifest is replaced atomically
(write a temporary file, then ``os.replace``) after the shard folder has been renamed into place. A
process killed at any point (``kill -9``) therefore leaves either a recorded, complete shard, or an
unrecorded one that the next run writes again: no work is counted twice or lost. Shards and the manifest
are fsynced before their rename (:mod:`drafttrain.atomic`); a full disk stops the job with
:class:`drafttrain.atomic.DiskFullError` naming the folder, with the partial shard removed and every recorded
shard kept.

The manifest also holds the job's fingerprint; reopening a folder with a different job raises
:class:`JobMismatchError` instead of mixing two jobs' shards.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from pathlib import Path

MANIFEST = "manifest.json"


class JobMismatchError(RuntimeError):
    """The folder holds shards of a different job (other inputs or settings)."""


class CorruptFileError(RuntimeError):
    """A file or folder cannot be decoded (truncated, overwritten, a disk error). The message names it
    and says what to do (usually: delete it and rerun the same command, which rebuilds it)."""


def read_json(path: str | Path, fix: str):
    """``json.loads`` of a file; undecodable -> :class:`CorruptFileError` naming ``path`` and ``fix``.

    Raises:
        CorruptFileError: the file is not valid JSON / UTF-8.
        FileNotFoundError: the file does not exist.
    """
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{path} is corrupt ({err}); {fix}") from None


def load_dataset_folder(path: str | Path, fix: str):
    """``datasets.load_from_disk`` of a folder; unreadable -> :class:`CorruptFileError` naming it and ``fix``.

    Raises:
        CorruptFileError: a missing, truncated or corrupt Arrow file / state file in the folder.
    """
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as err:  # pyarrow (ArrowInvalid, OSError "Expected to be able to read ..."), json, missing files
        raise CorruptFileError(f"{path} cannot be read ({type(err).__name__}: {err}); {fix}") from None


def free_hint(root: Path) -> str:
    """What to delete to make room for a job folder's shards (for :class:`drafttrain.atomic.DiskFullError`)."""
    return (f"older job folders beside {root} (self-distillation / generate_data / feature-cache folders, "
            f"data.cache_dir) or older checkpoints under a run's output_dir/checkpoints")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and an atomic rename
    (:func:`drafttrain.atomic.atomic_write_text`).

    Raises:
        drafttrain.atomic.DiskFullError: the disk is full (the old file is kept, the temporary removed).
    """
    from drafttrain.atomic import atomic_write_text as write

    path = Path(path)
    write(path, text, free_hint=free_hint(path.parent))


class ShardStore:
    """Shards ``shard_00000/``, ... under ``root`` plus ``manifest.json``.

    Args:
        root: the job folder (created if missing).
        job: JSON-serialisable description; ``job["fingerprint"]`` identifies the job.

        reset_on_mismatch: wipe a folder that holds another job instead of raising (for folders
            this code owns, e.g. the in-training cache keyed by its inputs, where a mismatch can
            only mean shards of an older format).

    Raises:
        JobMismatchError: ``root`` already holds a manifest with another fingerprint.
    """

    def __init__(self, root: str | Path, job: dict, reset_on_mismatch: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / MANIFEST
        fix = f"delete the folder {self.root} and rerun the same command (its shards are made again)"
        if self.path.is_file() and reset_on_mismatch:
            old = read_json(self.path, fix).get("job", {}).get("fingerprint")
            if old != job["fingerprint"]:
                for shard in self.root.glob("shard_*"):
                    shutil.rmtree(shard)
                self.path.unlink()
        if self.path.is_file():
            manifest = read_json(self.path, fix)
            old = manifest.get("job", {}).get("fingerprint")
            if old != job["fingerprint"]:
                raise JobMismatchError(
                    f"{self.root} holds another job (fingerprint {old}, this one {job['fingerprint']}): "
                    f"the inputs or settings differ; use another folder or delete this one"
                )
            self.manifest = manifest
        else:
            self.manifest = {"job": job, "shards": {}}
            atomic_write_text(self.path, json.dumps(self.manifest, indent=1))

    def shard_dir(self, i: int) -> Path:
        return self.root / f"shard_{i:05d}"

    def is_done(self, i: int) -> bool:
        """Shard ``i`` is recorded and its folder exists (a deleted shard folder is made again)."""
        return str(i) in self.manifest["shards"] and self.shard_dir(i).is_dir()

    def info(self, i: int) -> dict:
        """What was recorded with shard ``i`` (KeyError if it is not done)."""
        return self.manifest["shards"][str(i)]

    def write(self, i: int, dataset, info: dict) -> None:
        """Save ``dataset`` (a ``datasets.Dataset``) as shard ``i`` and record ``info`` with it.

        Written to ``.tmp_shard_N``, fsynced, renamed over any unrecorded leftover of a killed run.

        Raises:
            drafttrain.atomic.DiskFullError: the disk filled up (the partial shard is removed, the manifest
                and every recorded shard are unchanged; the next run makes this shard again).
        """
        from drafttrain.atomic import atomic_dir

        with atomic_dir(self.shard_dir(i), f"shard {i} ({len(dataset)} rows)", free_hint(self.root)) as tmp:
            dataset.save_to_disk(str(tmp))
        self.manifest["shards"][str(i)] = info
        atomic_write_text(self.path, json.dumps(self.manifest, indent=1))  # the shard counts from here on

    def load(self, i: int):
        """Shard ``i`` as a memory-mapped ``datasets.Dataset``.

        Raises:
            CorruptFileError: the shard's files are truncated or corrupt (the message says to delete the
                shard folder and rerun: a recorded shard whose folder is missing is made again).
        """
        d = self.shard_dir(i)
        return load_dataset_folder(d, f"delete {d} and rerun the same command (that shard alone is made again)")

    def set(self, key: str, value) -> None:
        """Record a job-level value (e.g. that the final dataset was written)."""
        self.manifest[key] = value
        atomic_write_text(self.path, json.dumps(self.manifest, indent=1))


@contextlib.contextmanager
def quiet_datasets():
    """Silence ``datasets``' own progress bars (one per shard save) inside the block; restore after."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


def quiet(fn):
    """Decorator: run ``fn`` inside :func:`quiet_datasets` (our own tqdm bar is the one that shows)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with quiet_datasets():
            return fn(*args, **kwargs)

    return wrapper
