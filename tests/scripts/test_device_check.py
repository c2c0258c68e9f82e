"""``bash scripts/device_check.sh --dry-run`` runs its steps on the CPU (tiny shapes, no timings), so the GPU
check cannot rot between GPU sessions: the CUDA tests are collected, every recipe's training point and both
decoding points run, and gpu.json / gpu.md are written (< 1 min here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["dry_run"] is True
    rows = data["training"]
    assert {r["recipe"] for r in rows} == {"eagle3", "parallelspec_eagle3", "parallelspec"}
    assert all(r["status"] == "ok" and r["step_s"] is None and r["loss"] > 0 for r in rows), rows
    assert [r["batch"] for r in data["decoding"]] == [1, 16]
    assert all(r["greedy_equal_rows"] == r["rows"] for r in data["decoding"]), data["decoding"]
    assert "skipped" in data["tests"] or "deselected" in data["tests"], data["tests"]
    md = (tmp_path / "gpu.md").read_text()
    assert "Dry run" in md and "bash scripts/device_check.sh --dry-run" in md
