"""One writer per job folder: an exclusive lock beside the folder, held while a job writes its shards.

Two runs of the same job (``scripts.generate_data``, the in-training self-distillation, ``scripts.cache_features``)
started at once on one folder would each see the same shards missing, write them twice and record them in one
manifest in either order. :func:`folder_lock` lets one of them in; the other refuses at once with
:class:`FolderLockedError` ("``<folder>`` is being written by pid N on HOST since T; wait for it or remove
``<folder>.lock`` if that process is gone"), or, with ``wait_s``, waits for the folder to be free first.

The lock file ``<folder>.lock`` sits beside the folder (not inside it: nothing in the job's own files, whose bytes
the feature cache counts, changes) and holds ``{"pid", "host", "started", "folder"}`` of its holder. Mutual
exclusion is ``fcntl.flock`` on it, which the kernel releases when the holder dies however it dies; the file's
contents are for the message and for one more check: a file whose named holder still runs on this host (or
runs on another host, where its pid cannot be checked) is not taken even when the flock is free (a file system
whose flock does not reach other hosts). A file left by a pid that no longer exists on this host is taken
over with a logged warning. The file is removed on release, on normal exit and on an exception alike.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import inspect
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)


class FolderLockedError(RuntimeError):
    """Another process is writing the job folder (the message names its pid, host, start time and the lock file)."""


def lock_path(folder: str | Path) -> Path:
    """The lock file of ``folder``: ``<folder>.lock`` beside it (absolute)."""
    folder = Path(folder).expanduser().resolve()
    return folder.with_name(folder.name + ".lock")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's process counts as existing)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(fd: int) -> dict | None:
    """The holder record in the open lock file (None: empty or unreadable)."""
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode()) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(folder: Path, path: Path, holder: dict | None) -> str:
    h = holder or {}
    return (f"{folder} is being written by pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('started', '?')}; "
            f"wait for it or remove {path} if that process is gone")  # fmt: skip


def _try_acquire(folder: Path, path: Path) -> tuple[int | None, dict | None]:
    """One attempt: (fd holding the lock, None), or (None, the holder record) when another process holds it."""
    host = socket.gethostname()
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
            holder = None
            for _ in range(10):  # the holder writes its record right after taking the flock
                holder = _read_holder(fd)
                if holder is not None:
                    break
                time.sleep(0.02)
            os.close(fd)
            return None, holder
        try:  # the previous holder may have removed the file between our open and our flock: take the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        holder = _read_holder(fd)
        if holder is not None and holder.get("pid") != os.getpid():
            pid = int(holder.get("pid") or 0)
            if holder.get("host") != host or _pid_alive(pid):  # a live holder whose flock did not reach us
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                return None, holder
            log.warning("taking over the lock %s left by pid %s on %s since %s: that process no longer exists",
                        path, pid, holder.get("host"), holder.get("started"))  # fmt: skip
        record = {"pid": os.getpid(), "host": host, "folder": str(folder),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return fd, None


@contextmanager
def folder_lock(folder: str | Path, wait_s: float = 0.0, poll_s: float = 0.2) -> Iterator[Path]:
    """Hold the exclusive write lock of job folder ``folder`` for the ``with`` block; yields the lock file's path.

    Args:
        folder: the job folder (need not exist yet; its parent is created).
        wait_s: seconds to wait for another holder to finish (0: refuse at once; ``float("inf")``: wait as long
            as it takes).
        poll_s: seconds between attempts while waiting.

    Raises:
        FolderLockedError: another process still holds the lock after ``wait_s`` (the message names its pid,
            host and start time, and the lock file to remove if that process is gone).
    """
    folder = Path(folder).expanduser().resolve()
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max(float(wait_s), 0.0)
    announced = False
    while True:
        fd, holder = _try_acquire(folder, path)
        if fd is not None:
            break
        if time.monotonic() >= deadline:
            raise FolderLockedError(_describe(folder, path, holder))
        if not announced:
            log.info("waiting for %s", _describe(folder, path, holder))
            announced = True
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
    try:
        yield path
    finally:
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.unlink()
        except FileNotFoundError:
            pass
        os.close(fd)  # releases the flock


def locks_folder(folder_arg: str, wait_arg: str):
    """Decorator: the call holds :func:`folder_lock` of its argument ``folder_arg`` (the job folder) throughout,
    waiting as long as its argument ``wait_arg`` says (seconds; 0 refuses at once).

    >>> @locks_folder("out_dir", "lock_wait_s")
    ... def job(out_dir, lock_wait_s=0.0): ...
    """

    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            with folder_lock(bound.arguments[folder_arg], wait_s=bound.arguments[wait_arg]):
                return fn(*args, **kwargs)

        return locked

    return wrap


__all__ = ["FolderLockedError", "folder_lock", "lock_path", "locks_folder"]
