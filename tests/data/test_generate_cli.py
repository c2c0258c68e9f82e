"""The real generation CLI (`python -m scripts.generate_data target=tiny ...`), killed with SIGKILL mid-run.

Slow (subprocesses, ~1 min): run with `pytest -m slow`. Why: "resumable" is only worth something if a
run killed at any instant - while a shard or the manifest is being written - restarts with the same
command and ends with exactly the rows an uninterrupted run writes: same ids, same order, none
missing, none twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafttrain.data.selfdistill import load_generated

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def write_source(path: Path, n: int) -> None:
    """n multi-turn conversations plus three bad records (counted as skipped)."""
    lines = []
    for i in range(n):
        turns = [{"role": "user", "content": f"question {i}: " + "why " * (i % 7)},
                 {"role": "assistant", "content": "because"},
                 {"role": "user", "content": f"follow-up {i}"},
                 {"role": "assistant", "content": "indeed"}]  # fmt: skip
        lines.append(json.dumps({"id": f"conv-{i:03d}", "messages": turns}))
    lines.insert(3, "{broken json")
    lines.insert(7, json.dumps({"id": "noasst", "messages": [{"role": "user", "content": "hello?"}]}))
    lines.insert(11, json.dumps({"id": "empty", "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}))
    path.write_text("\n".join(lines) + "\n")


def command(source: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "scripts.generate_data", "target=tiny", f"source={source}", f"output_dir={out}",
            "max_conversations=null", "generation.max_new_tokens=16", "generation.batch_size=2",
            "generation.shard_size=2", "num_threads=1", "progress=false"]  # fmt: skip


def shards_done(out: Path) -> int:
    try:
        return len(json.loads((out / "manifest.json").read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def test_sigkill_mid_run_then_restart_equals_uninterrupted(tmp_path):
    source = tmp_path / "convs.jsonl"
    n = 24
    write_source(source, n)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}

    full_dir = tmp_path / "full"
    proc = subprocess.run(command(source, full_dir), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"input {n + 3} = generated {n} + skipped 3 + failed 0" in proc.stdout

    killed_dir = tmp_path / "killed"
    p = subprocess.Popen(command(source, killed_dir), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while shards_done(killed_dir) < 3 and time.time() < deadline and p.poll() is None:
        time.sleep(0.01)
    assert p.poll() is None, "the run finished before it could be killed: make it longer"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    done_at_kill = shards_done(killed_dir)
    assert 3 <= done_at_kill < n // 2  # killed mid-way: 12 shards in all
    assert not (killed_dir / "report.json").exists() and not (killed_dir / "dataset").exists()

    proc = subprocess.run(command(source, killed_dir), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    full, resumed = load_generated(full_dir), load_generated(killed_dir)
    ids = list(resumed["id"])
    assert ids == [f"conv-{i:03d}" for i in range(n)]  # same order, none missing, none twice
    assert resumed.to_list() == full.to_list()  # same tokens, masks and metadata
    report = json.loads((killed_dir / "report.json").read_text())
    assert report["skip_reasons"] == {"malformed json": 1, "no assistant turn": 1, "empty content": 1}
    assert (report["input"], report["generated"], report["skipped"], report["failed"]) == (n + 3, n, 3, 0)
    # the restarted run generated only the shards the killed one had not recorded
    first = json.loads((full_dir / "report.json").read_text())["this_run"]["generated_tokens"]
    assert 0 < report["this_run"]["generated_tokens"] < first
