"""One writer per job folder (drafttrain.data.lock): the self-distillation / generate_data job and the feature
cache job hold an exclusive lock beside their folder while they write it.

Why: two runs of the same job started at once on one folder each saw the same shards missing, wrote them
twice and recorded them in one manifest in either order (a shard's rows could be counted twice).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from drafttrain.data.lock import FolderLockedError, folder_lock, lock_path

ROOT = Path(__file__).resolve().parents[2]


def test_held_lock_refuses_a_second_acquirer_naming_the_holder(tmp_path):
    job = tmp_path / "job"
    with folder_lock(job) as path:
        assert path == lock_path(job) == tmp_path / "job.lock"
        holder = json.loads(path.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(FolderLockedError) as e:
            with folder_lock(job):
                pass
        assert str(e.value) == (f"{job} is being written by pid {os.getpid()} on {socket.gethostname()} since "
                                f"{holder['started']}; wait for it or remove {path} if that process is gone")  # fmt: skip
    assert not path.exists()  # released on normal exit
    with folder_lock(job):  # and free again
        pass


def test_released_on_an_exception(tmp_path):
    job = tmp_path / "job"
    with pytest.raises(KeyError):
        with folder_lock(job):
            raise KeyError("boom")
    assert not lock_path(job).exists()
    with folder_lock(job):
        pass


def test_wait_s_waits_for_the_holder_to_finish(tmp_path):
    job = tmp_path / "job"
    held, release = threading.Event(), threading.Event()

    def hold():
        with folder_lock(job):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    with pytest.raises(FolderLockedError):  # too short a wait: refused
        with folder_lock(job, wait_s=0.3):
            pass
    threading.Timer(0.3, release.set).start()
    with folder_lock(job, wait_s=10, poll_s=0.05):
        assert release.is_set()  # it got the lock only once the holder was told to let go: it waited
    t.join(10)


def test_lock_left_by_a_dead_pid_is_taken_over_with_a_warning(tmp_path, caplog):
    job = tmp_path / "job"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # exited and reaped: no such process any more
    lock_path(job).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00"}))
    with caplog.at_level(logging.WARNING, logger="drafttrain.data.lock"):
        with folder_lock(job) as path:
            assert json.loads(path.read_text())["pid"] == os.getpid()
    assert any(f"left by pid {pid}" in r.getMessage() and "no longer exists" in r.getMessage() for r in caplog.records)


def test_lock_named_by_a_live_process_or_another_host_is_not_taken(tmp_path):
    """The file's holder still runs (a file system whose flock does not reach us), or runs where its pid cannot
    be checked: refused, although no flock is held."""
    job = tmp_path / "job"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock_path(job).write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "started": "T0"}))
        with pytest.raises(FolderLockedError, match=f"pid {live.pid} on {socket.gethostname()} since T0"):
            with folder_lock(job):
                pass
    finally:
        live.kill()
        live.wait()
    lock_path(job).write_text(json.dumps({"pid": 1234, "host": "some-other-host", "started": "T1"}))
    with pytest.raises(FolderLockedError, match="pid 1234 on some-other-host since T1"):
        with folder_lock(job):
            pass


# -- both jobs take it --------------------------------------------------------------------------
def test_both_jobs_refuse_a_folder_another_process_holds(tiny_target, tmp_path):
    import datasets

    from drafttrain.config import GenerationConfig
    from drafttrain.data.feature_cache import build_feature_cache
    from drafttrain.data.selfdistill import generate_dataset

    convs = [{"id": "c0", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"}]}]
    gen_dir, cache_dir = tmp_path / "gen", tmp_path / "cache"
    with folder_lock(gen_dir):
        with pytest.raises(FolderLockedError, match=f"{gen_dir} is being written by pid {os.getpid()}"):
            generate_dataset(tiny_target, convs, gen_dir, GenerationConfig(max_new_tokens=2), progress=False)
    with folder_lock(cache_dir):
        with pytest.raises(FolderLockedError, match=f"{cache_dir} is being written by pid {os.getpid()}"):
            build_feature_cache(tiny_target, datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]}), cache_dir,
                                progress=False)  # fmt: skip
    assert not (gen_dir / "manifest.json").exists() and not (cache_dir / "manifest.json").exists()  # nothing written


_CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import datasets
    import drafttrain.data.feature_cache as fc
    from drafttrain.config import TargetConfig
    from drafttrain.data.lock import FolderLockedError
    from drafttrain.target import load_target

    out, result, started, go = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    target = load_target(TargetConfig(random_init=True))
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]})
    if started != "-":  # the writer: holds the folder until the test says go (so the other run overlaps it)
        real = fc.rows_features
        def gated(*a, **k):
            Path(started).touch()
            t0 = time.time()
            while not Path(go).exists() and time.time() - t0 < 300:
                time.sleep(0.05)
            return real(*a, **k)
        fc.rows_features = gated
    try:
        meta = fc.build_feature_cache(target, ds, out, shard_size=2, batch_size=2, progress=False)
        result.write_text(json.dumps({"wrote": meta["rows"]}))
    except FolderLockedError as err:
        result.write_text(json.dumps({"refused": str(err)}))
""")


def _spawn(out: Path, result: Path, started: str = "-", go: str = "-") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(out), str(result), started, go], env=env, cwd=ROOT)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"the child exited ({proc.returncode}) before {path.name}"
        if time.time() - t0 > timeout:  # a hung child (a guard, not a speed check)
            pytest.fail(f"no {path.name} after {timeout} s")
        time.sleep(0.05)


@pytest.mark.timeout(900)
def test_two_processes_on_one_cache_folder_one_writes_the_other_refuses(tmp_path):
    from drafttrain.data.feature_cache import load_feature_cache

    out = tmp_path / "cache"
    started, go = tmp_path / "started", tmp_path / "go"
    res_a, res_b = tmp_path / "a.json", tmp_path / "b.json"
    a = _spawn(out, res_a, str(started), str(go))
    try:
        _wait_for(started, a)  # A holds the lock and is about to write its first shard
        b = _spawn(out, res_b)
        assert b.wait(600) == 0
        go.touch()
        assert a.wait(600) == 0
    finally:
        for p in (a, locals().get("b")):
            if p is not None and p.poll() is None:
                p.kill()
    got_b = json.loads(res_b.read_text())
    assert got_b.get("refused", "").startswith(f"{out} is being written by pid {a.pid} on {socket.gethostname()}")
    assert json.loads(res_a.read_text()) == {"wrote": 4}
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1"] and sum(s["rows"] for s in manifest["shards"].values()) == 4
    assert sorted(p.name for p in out.glob("shard_*")) == ["shard_00000", "shard_00001"]
    assert len(load_feature_cache(out)) == 4  # each row once
    assert not lock_path(out).exists()
