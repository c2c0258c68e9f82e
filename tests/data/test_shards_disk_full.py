"""A full disk while writing shards (self-distillation / generate_data / feature cache): the job stops with one
line naming the folder, the recorded shards and the manifest stay whole, no partial shard is left, and the same
command resumes where it stopped.

Why: ``ShardStore.write`` used to leave ``.tmp_shard_N`` behind and raise a bare ``OSError`` deep inside
``datasets``; the manifest was not fsynced.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from drafttrain.atomic import DiskFullError
from drafttrain.data.shards import MANIFEST, ShardStore, atomic_write_text

JOB = {"fingerprint": "job-a"}


def _ds(n: int, start: int = 0):
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [[start + i] * (3 + i) for i in range(n)]})


def _fill_disk_on(monkeypatch, calls: set[int], partial: bytes = b"\0" * 4096):
    """``Dataset.save_to_disk`` writes part of a file, then raises ENOSPC on the given call numbers (1-based)."""
    import datasets

    real = datasets.Dataset.save_to_disk
    count = [0]

    def save(self, path, *a, **k):
        count[0] += 1
        if count[0] in calls:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "data-00000-of-00001.arrow"), "wb") as f:
                f.write(partial)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path, *a, **k)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    return count


def test_full_disk_keeps_recorded_shards_and_the_next_run_resumes(tmp_path, monkeypatch):
    root = tmp_path / "job"
    store = ShardStore(root, JOB)
    store.write(0, _ds(2), {"rows": 2})
    manifest = (root / MANIFEST).read_text()
    _fill_disk_on(monkeypatch, {1})
    with pytest.raises(DiskFullError) as err:
        store.write(1, _ds(3, 10), {"rows": 3})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("disk full: writing shard 1 (3 rows)")
    assert f"in {root} failed after 4.0 KiB" in msg and "ENOSPC" in msg and "older job folders" in msg
    assert sorted(p.name for p in root.iterdir()) == [MANIFEST, "shard_00000"]  # no .tmp_shard_00001
    assert (root / MANIFEST).read_text() == manifest and "1" not in store.manifest["shards"]
    again = ShardStore(root, JOB)  # the next launch
    assert again.is_done(0) and not again.is_done(1)
    assert again.load(0)["input_ids"] == [[0, 0, 0], [1, 1, 1, 1]]
    again.write(1, _ds(3, 10), {"rows": 3})
    assert again.is_done(1) and len(again.load(1)) == 3


def test_full_disk_on_the_manifest_keeps_the_old_one(tmp_path, monkeypatch):
    import drafttrain.atomic as atomic

    root = tmp_path / "job"
    ShardStore(root, JOB)
    old = (root / MANIFEST).read_text()

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    with pytest.raises(DiskFullError, match=f"writing {MANIFEST} in {root} failed"):
        atomic_write_text(root / MANIFEST, json.dumps({"job": JOB, "shards": {"0": {}}}))
    assert (root / MANIFEST).read_text() == old
    assert [p.name for p in root.iterdir()] == [MANIFEST]  # the temporary is gone


def test_feature_cache_stops_on_a_full_disk_and_resumes(tiny_target, tmp_path, monkeypatch):
    """build_feature_cache: the disk fills on the second shard; the rerun computes only the missing shards and the
    finished cache equals one built in one go."""
    from drafttrain.data import feature_cache as fc

    ds = _ds(6)
    out = tmp_path / "cache"
    forwards = []
    real_rows = fc.rows_features
    monkeypatch.setattr(fc, "rows_features", lambda t, rows, *a, **k: forwards.append(len(rows)) or real_rows(t, rows, *a, **k))
    _fill_disk_on(monkeypatch, {2})
    with pytest.raises(DiskFullError, match=f"writing shard 1 .* in {out} failed"):
        fc.build_feature_cache(tiny_target, ds, out, batch_size=2, shard_size=2, progress=False)
    assert not (out / fc.META).exists() and sorted(p.name for p in out.glob("*shard*")) == ["shard_00000"]
    assert sum(forwards) == 4  # shards 0 and 1 computed
    forwards.clear()
    monkeypatch.undo()
    monkeypatch.setattr(fc, "rows_features", lambda t, rows, *a, **k: forwards.append(len(rows)) or real_rows(t, rows, *a, **k))
    fc.build_feature_cache(tiny_target, ds, out, batch_size=2, shard_size=2, progress=False)
    assert sum(forwards) == 4  # shards 1 and 2 only: shard 0 was kept
    whole = tmp_path / "whole"
    fc.build_feature_cache(tiny_target, ds, whole, batch_size=2, shard_size=2, progress=False)
    got, want = fc.load_feature_cache(out, ds), fc.load_feature_cache(whole, ds)
    assert got["features"] == want["features"]
