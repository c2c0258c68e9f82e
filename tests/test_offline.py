"""Offline by construction: every entry point sets HF_HUB_OFFLINE=1 unless the user set
it, and a hub id given where a local folder is expected fails with our message and no network call.

Why: transformers resolves a string that is not a local folder as a hub id and downloads it. The
project promises no network at run time (docs/design.md, "Real inputs"); this proves it instead of trusting it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drafttrain.assets import OFFLINE_ENV, offline_by_default

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "HuggingFaceTB/SmolLM2-135M"

# Loaded at interpreter start-up through PYTHONPATH: every socket connect raises and is recorded, and the
# HF_HUB_OFFLINE the process ended with is written out.
SITECUSTOMIZE = """
import atexit, json, os, socket
_attempts = []
def _refuse(self, address, *a, **k):
    _attempts.append(repr(address))
    raise OSError(f"network call refused by the test: {address!r}")
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
@atexit.register
def _report():
    with open(os.environ["NETWORK_REPORT"], "w") as f:
        json.dump({"attempts": _attempts, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE")}, f)
"""


def test_offline_by_default_keeps_the_users_setting(monkeypatch):
    for name in OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert offline_by_default() == {name: "1" for name in OFFLINE_ENV}
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert offline_by_default()["HF_HUB_OFFLINE"] == "0"


def _run_offline(tmp_path: Path, cmd: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    env.update(PYTHONPATH=str(site), NETWORK_REPORT=str(tmp_path / "report.json"), WANDB_MODE="offline")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads((tmp_path / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_hub_id_as_target_path_fails_clearly_without_network(entry, tmp_path):
    if entry == "train":
        cmd = [sys.executable, "train.py", f"target.path={HUB_ID}", f"output_dir={tmp_path / 'run'}",
               "logging.wandb=false", "trainer.progress=false"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "scripts.evaluate", f"target.path={HUB_ID}", "untrained_drafter=true",
               f"output_dir={tmp_path / 'eval'}", "progress=false"]  # fmt: skip
    proc, report = _run_offline(tmp_path, cmd)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"target.path={HUB_ID} is not a local folder" in text and "never downloads" in text, text[-3000:]
    assert report == {"attempts": [], "HF_HUB_OFFLINE": "1"}, report
