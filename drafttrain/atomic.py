"""Atomic writes that survive a full disk: a temporary name in the same folder, fsync, one rename.

Every writer of lasting state (dataset / feature-cache shards and their manifest, training checkpoints,
the final drafter, exports) goes through this module, so a write that fails part-way leaves the previous
complete file or folder where it was and no partial temporary behind:

- :func:`atomic_write_text`: one small file (a manifest, a report, ``export_info.json``).
- :func:`atomic_dir`: a folder written by a library (``datasets``' ``save_to_disk``, ``save_pretrained``,
  accelerate's ``save_state``) into a temporary sibling, fsynced, then renamed over the old one
  (:func:`replace_dir`).
- :func:`disk_full_guard`: the translation of a full disk into :class:`DiskFullError` for writers that
  manage their own temporary folder (the checkpoint, whose folder spans a barrier across ranks).

A full disk is ``OSError`` with errno ``ENOSPC`` (no space), ``EDQUOT`` (quota) or ``EFBIG`` (a file-size
limit, ``ulimit -f`` / ``RLIMIT_FSIZE``). It becomes :class:`DiskFullError`, whose one-line message names
the disk-full cause, the folder, how many bytes had been written before the failure, the space still free
there and what to delete; the entry points print it without a traceback (exit status 1, a
:class:`~drafttrain.cliconfig.FatalError`). Other errors
pass through unchanged (after the temporary is removed).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from drafttrain.cliconfig import FatalError

#: errno values that mean "no room to write": no space, over quota, over the file-size limit.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFullError(FatalError):
    """A write failed because the disk (or quota, or file-size limit) is full; the previous complete state is kept.

    Attributes:
        folder: the folder being written (Path). nbytes: bytes written before the failure (int).
    """

    def __init__(self, message: str, folder: Path, nbytes: int):
        super().__init__(message)
        self.folder, self.nbytes = Path(folder), int(nbytes)


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` is an ``OSError`` meaning no room to write (:data:`DISK_FULL_ERRNOS`)."""
    return isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


def path_bytes(path: Path) -> int:
    """Bytes of the file ``path``, or of every file under the folder ``path`` (0 if it is gone)."""
    path = Path(path)
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def disk_full_message(folder: Path, what: str, nbytes: int, err: OSError, free_hint: str) -> str:
    """The one line of a :class:`DiskFullError` (see the module docstring)."""
    folder = Path(folder)
    try:
        free = human_bytes(shutil.disk_usage(folder if folder.exists() else folder.parent).free)
    except OSError:
        free = "unknown"
    cause = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
             errno.EFBIG: "file too large for this process's file-size limit (ulimit -f)"}.get(err.errno, str(err))  # fmt: skip
    return (f"disk full: writing {what} in {folder} failed after {human_bytes(nbytes)} ({errno.errorcode.get(err.errno, err.errno)}: "
            f"{cause}; {free} free there); the previous complete state is kept and the partial write removed. "
            f"Free space ({free_hint}) and rerun the same command: it resumes from the last complete state")  # fmt: skip


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def disk_full_guard(folder: str | Path, what: str, free_hint: str, partial: str | Path | None = None) -> Iterator[None]:
    """Inside the block, a full disk becomes :class:`DiskFullError`; ``partial`` (a temporary file or folder)
    is removed on any exception, its size reported as the bytes written.

    Args:
        folder: the folder being written (named in the message).
        what: what was being written ("checkpoint step_0000010", "shard 3").
        free_hint: what the user may delete to make room (named in the message).
        partial: the temporary written inside the block (removed when the block raises).

    Raises:
        DiskFullError: an ``OSError`` with errno in :data:`DISK_FULL_ERRNOS` was raised in the block.
    """
    try:
        yield
    except BaseException as err:
        nbytes = path_bytes(Path(partial)) if partial is not None else 0
        if partial is not None:
            _remove(Path(partial))
        full = err if is_disk_full(err) else (err.__cause__ or err.__context__)
        if is_disk_full(full):  # (libraries sometimes wrap the OSError: datasets, safetensors)
            raise DiskFullError(disk_full_message(Path(folder), what, nbytes, full, free_hint), Path(folder), nbytes) from err
        raise


def fsync_path(path: Path) -> None:
    """fsync a file, or every file under a folder and the folders themselves (contents reach the disk)."""
    path = Path(path)
    paths = [path] if not path.is_dir() else [*sorted(p for p in path.rglob("*")), path]
    for p in paths:
        if p.is_symlink():
            continue
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(folder: Path) -> None:
    """fsync a folder's entries (a rename in it reaches the disk). Ignored where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str, what: str | None = None, free_hint: str = "other files on that disk",
                      unique: bool = False) -> None:  # fmt: skip
    """Write ``text`` (UTF-8) to ``path`` via ``.<name>.tmp`` in the same folder, fsync, ``os.replace``.

    The old ``path`` stays whole until the rename; the temporary is removed if the write fails. ``unique``: the
    temporary gets a name of its own (``tempfile.mkstemp``), for a file several processes may write at once
    (the last rename wins, each whole).

    Raises:
        DiskFullError: the disk is full (the message names the folder and ``free_hint``).
        OSError: any other write error (the temporary removed).
    """
    path = Path(path)
    if unique:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    else:
        tmp = path.with_name(f".{path.name}.tmp")
    data = text.encode("utf-8")
    with disk_full_guard(path.parent, what or path.name, free_hint, partial=tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


def commit_file(tmp: str | Path, final: str | Path) -> None:
    """A finished file ``tmp`` (written beside ``final``) made durable and moved over ``final``: fsync, ``os.replace``,
    fsync of the folder. A kill leaves the old ``final`` or the new one, never a part."""
    tmp, final = Path(tmp), Path(final)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` (same file system), replacing an older ``final``.

    Both renames are atomic: a kill leaves either the old folder, or none at ``final`` (the old one
    is then at ``.old_<name>`` and removed by the next save), never a half-written ``final``.
    """
    old = final.with_name(f".old_{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def merge_dir(tmp: Path, final: Path) -> None:
    """Move every entry of the finished folder ``tmp`` into the existing folder ``final`` (``os.replace`` each,
    replacing entries of the same name, keeping the others), then remove ``tmp``."""
    final.mkdir(parents=True, exist_ok=True)
    for p in sorted(tmp.iterdir()):
        dest = final / p.name
        if dest.is_dir() and not dest.is_symlink():
            replace_dir(p, dest)
        else:
            os.replace(p, dest)
    fsync_dir(final)
    tmp.rmdir()


@contextlib.contextmanager
def atomic_dir(final: str | Path, what: str, free_hint: str, fsync: bool = True, merge: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder ``.tmp_<name>`` beside ``final``; write into it in the block. On success
    it is fsynced and renamed over ``final`` (:func:`replace_dir`; with ``merge``, its entries are moved into an
    existing ``final`` one by one, :func:`merge_dir`, keeping ``final``'s other files); if the block raises it is
    removed and ``final`` is left as it was.

    Raises:
        DiskFullError: the disk filled up inside the block (the message names ``final``'s folder and ``free_hint``).
    """
    final = Path(final)
    tmp = final.with_name(f".tmp_{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed run
    final.parent.mkdir(parents=True, exist_ok=True)
    with disk_full_guard(final.parent, what, free_hint, partial=tmp):
        tmp.mkdir()
        yield tmp
        if fsync:
            fsync_path(tmp)
        (merge_dir if merge else replace_dir)(tmp, final)


__all__ = ["DISK_FULL_ERRNOS", "DiskFullError", "atomic_dir", "atomic_write_text", "disk_full_guard", "fsync_dir",
           "fsync_path", "human_bytes", "is_disk_full", "merge_dir", "path_bytes", "replace_dir"]
