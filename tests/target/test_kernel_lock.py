"""A build of drafttrain's CPU kernels killed midway never blocks the next launch.

Why: a launch SIGTERMed while it logged ``building drafttrain's AVX2 kernel drafttrain_decode_attention`` left torch's
extension lock (``<extensions dir>/drafttrain_decode_attention/lock``, a plain file) behind; the next launch waited
on it for 5 minutes, silently, until the file was removed by hand. drafttrain now builds under its own ``fcntl`` lock,
which dies with its holder, and removes a torch lock no live build holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from drafttrain.target import fastlinear


def test_a_stale_lock_of_a_killed_build_is_removed_and_the_build_goes_on(tmp_path, monkeypatch, caplog):
    """A process takes drafttrain's build lock, writes torch's ``lock`` file as torch does, and is SIGKILLed inside
    the build. The next build does not wait: the stale file is removed (a warning names it) and the build runs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = fastlinear.extension_dir("drafttrain_probe_kernel")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from drafttrain.target import fastlinear\n"
        f"d = Path({str(build_dir)!r})\n"
        "with fastlinear.build_lock(d):\n"
        "    (d / 'lock').write_text('')\n"
        "    print('inside', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "inside"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    assert (build_dir / "lock").exists()  # what torch's next build would wait on forever
    seen = []

    def fake_load(**kwargs):
        seen.append((build_dir / "lock").exists())
        return "loaded"

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level("WARNING", logger="drafttrain.target.fastlinear"):  # a wait here would hit the test timeout
        out = fastlinear.build_extension("drafttrain_probe_kernel", tmp_path / "x.cpp", "avx2", "the fallback")
    assert out == "loaded" and seen == [False]
    assert any(str(build_dir / "lock") in r.getMessage() and "killed" in r.getMessage() for r in caplog.records)


def test_a_live_build_is_waited_for(tmp_path, monkeypatch):
    """While another process is inside the build lock (a live build), a second build waits for it: it gets the lock
    only after the holder wrote its last file and released it, and the holder's torch lock file is not touched."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = fastlinear.extension_dir("drafttrain_probe_kernel")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from drafttrain.target import fastlinear\n"
        f"d = Path({str(build_dir)!r})\n"
        "with fastlinear.build_lock(d):\n"
        "    (d / 'lock').write_text('')\n"
        "    print('inside', flush=True); time.sleep(1.5)\n"
        "    (d / 'lock').unlink(); (d / 'done').write_text('')\n")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "inside"
    with fastlinear.build_lock(build_dir):
        finished_first = (build_dir / "done").exists()
    holder.wait(timeout=10)
    assert holder.returncode == 0 and finished_first
