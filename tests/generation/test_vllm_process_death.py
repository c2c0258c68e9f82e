"""A vLLM process that dies mid-request, played by a small python script started exactly as vLLM's runner is
(:class:`VllmGenerator` starts ``<python> vllm_runner.py --serve engine.json``; here ``<python>`` is a shell
script that runs the stand-in instead). No vLLM is needed or started.

What must hold: the error is a :class:`FatalError` whose message is one line naming the signal by name (or the
exit code) and the log, the log is read only at its tail, the engine refuses later requests at once, and no
process of its group is left.
"""

from __future__ import annotations

import logging
import stat
import sys
import textwrap

import pytest

from drafttrain.cliconfig import FatalError
from drafttrain.generation.vllm_client import (VllmGenerator, VllmProcessError, exit_description, group_alive,
                                               read_tail)

STAND_IN = textwrap.dedent('''
    import json, os, signal, sys
    mode = sys.argv[1]
    print("INFO stand-in engine starting", file=sys.stderr, flush=True)
    sys.stdout.write(json.dumps({"ready": True, "vllm_version": "stand-in"}) + "\\n"); sys.stdout.flush()
    req = sys.stdin.readline()
    for i in range(5):
        print(f"INFO step {i} of a request of {len(json.loads(req)['prompts'])} prompts", file=sys.stderr, flush=True)
    print("ERROR out of memory in the engine core", file=sys.stderr, flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-request, no answer written
    sys.exit(3)
''')


def _python(tmp_path, mode: str) -> str:
    """An executable standing in for the vLLM venv's python: it ignores the runner's arguments."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    py = tmp_path / f"python-{mode}"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'stand_in.py'} {mode}\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return str(py)


@pytest.mark.parametrize("mode, how", [("kill", "killed by SIGKILL"), ("exit", "exit 3")])
def test_a_process_dying_mid_request_is_one_fatal_line(tmp_path, mode, how, caplog):
    log_path = tmp_path / "vllm.log"
    log_path.write_bytes(b"x" * 300_000 + b"\n")  # an earlier run's huge log: appended to, read only at its tail
    client = VllmGenerator(tmp_path, max_model_len=64, python=_python(tmp_path, mode), log_path=log_path, timeout_s=60)
    with caplog.at_level(logging.ERROR, logger="drafttrain.generation.vllm_client"):
        with pytest.raises(VllmProcessError) as e:
            client.generate([[1, 2, 3], [4, 5]], 4)
    msg = str(e.value)
    assert isinstance(e.value, FatalError) and "\n" not in msg
    assert f"the vLLM process ended ({how}); log {log_path}" in msg
    assert "last line: ERROR out of memory in the engine core" in msg
    assert "xxxx" not in msg and "INFO step 4 of a request of 2 prompts" in caplog.text  # the tail is logged
    assert client.proc is None and not client.running  # closed: its group ended
    with pytest.raises(VllmProcessError, match="failed earlier"):
        client.generate([[1]], 1)  # a dead engine is never restarted silently


def test_no_process_of_the_group_is_left(tmp_path):
    client = VllmGenerator(tmp_path, max_model_len=64, python=_python(tmp_path, "kill"), timeout_s=60)
    client.start()
    pid = client.proc.pid
    with pytest.raises(VllmProcessError, match="killed by SIGKILL"):
        client.generate([[1, 2]], 2)
    assert not group_alive(pid)


def test_exit_description_and_bounded_tail(tmp_path):
    assert exit_description(-9) == "killed by SIGKILL" and exit_description(-15) == "killed by SIGTERM"
    assert exit_description(2) == "exit 2" and exit_description(None) == "still running"
    p = tmp_path / "big.log"
    p.write_text("".join(f"line {i}\n" for i in range(200_000)))  # ~2 MB
    tail = read_tail(p, n=3, max_bytes=100)
    assert tail == ["line 199997", "line 199998", "line 199999"]
    assert read_tail(p, n=1000, max_bytes=100)[0].startswith("line 1999")  # only the bytes read, the cut line dropped
    assert read_tail(tmp_path / "missing.log") == []
