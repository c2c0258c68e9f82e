"""vLLM from drafttrain's own venv: find its python, and drive one engine in its own process.

vLLM's CPU build lives in a second venv (``bash scripts/install_vllm.sh`` -> ``.venv-vllm``: it needs older
transformers/datasets than drafttrain). drafttrain never imports it: :mod:`drafttrain.generation.vllm_runner` (a
plain file that imports only vLLM and the standard library) runs under that venv's python.

- :func:`vllm_install_state`: whether ``scripts/install_vllm.sh`` finished (``ready``), never ran (``absent``) or
  left a venv without its stamp (``incomplete``: still installing, or failed). The one place that decides it.
- :func:`vllm_python`: the venv's python (explicit, ``$DRAFTTRAIN_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
  of a finished install; a half-installed venv raises :class:`VllmInstallError`, it is never used).
- :func:`vllm_env`: the environment vLLM's CPU backend needs on a small machine (docs/design.md, "Platform notes": it
  binds one core and reserves the other unless told otherwise).
- :class:`VllmGenerator`: one engine for a whole generation job (``generation.backend=vllm``), started on the
  first request, answering greedy requests over JSON lines (``vllm_runner.py --serve``), shut down by
  :meth:`VllmGenerator.close` (a context manager; also at interpreter exit) with every process it started.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from drafttrain.cliconfig import ConfigError, FatalError

log = logging.getLogger(__name__)

RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
REPO = Path(__file__).resolve().parents[2]
INSTALL = "bash scripts/install_vllm.sh"


STAMP = ".drafttrain-vllm-stamp"  # written into the venv by scripts/install_vllm.sh as its last step


class VllmInstallError(ConfigError):
    """The vLLM venv exists but its install did not finish (no stamp): it is reported, never used."""


def vllm_venv() -> Path:
    """The venv ``scripts/install_vllm.sh`` installs into: ``$DRAFTTRAIN_VLLM_VENV`` (relative to the repository,
    as the script reads it) else ``.venv-vllm`` in the repository."""
    return REPO / os.environ.get("DRAFTTRAIN_VLLM_VENV", ".venv-vllm")


def vllm_install_state(venv: str | Path | None = None) -> tuple[str, str]:
    """Whether vLLM's venv is a finished install: the one check behind every "is vLLM available" decision.

    ``scripts/install_vllm.sh`` writes ``<venv>/.drafttrain-vllm-stamp`` (its input hash, then what it installed)
    only after every install step and the import check succeeded, so a folder without it is an install still
    running or one that failed part-way (pip leaves a venv without vllm behind).

    Args:
        venv: the venv folder; None: ``$DRAFTTRAIN_VLLM_PYTHON`` when it names a file (``ready``: a python the
            user installed vLLM in, no stamp asked), else :func:`vllm_venv`.

    Returns:
        ``(state, message)``: ``("ready", "vLLM installed in <venv>: <versions>")``, ``("absent", "vLLM is not
        installed (no <venv>): bash scripts/install_vllm.sh")`` or ``("incomplete", "<venv> has no <stamp> (an
        install still running or one that failed): incomplete install: rerun bash scripts/install_vllm.sh")``.
        A stamp without ``bin/python`` is ``incomplete`` too. Reads two files; raises nothing.
    """
    if venv is None:
        env = os.environ.get("DRAFTTRAIN_VLLM_PYTHON")
        if env and Path(env).expanduser().is_file():
            return "ready", f"vLLM's python from $DRAFTTRAIN_VLLM_PYTHON ({env})"
    venv = Path(venv) if venv is not None else vllm_venv()
    rerun = f"incomplete install: rerun {INSTALL}"
    if not venv.exists():
        return "absent", f"vLLM is not installed (no {venv.name}): {INSTALL} (a second venv)"
    stamp = venv / STAMP
    if not stamp.is_file():
        return "incomplete", f"{venv} has no {STAMP} (an install still running, or one that failed): {rerun}"
    if not (venv / "bin" / "python").is_file():
        return "incomplete", f"{venv} has its {STAMP} but no bin/python: {rerun}"
    try:
        lines = stamp.read_text(errors="replace").splitlines()
    except OSError as e:
        lines = ["", f"stamp unreadable ({e})"]
    what = lines[1].strip() if len(lines) > 1 else "installed by an older install_vllm.sh"
    return "ready", f"vLLM installed in {venv.name}: {what}"


def vllm_python(explicit: str | None = None) -> Path | None:
    """The vLLM venv's python: ``explicit`` (only it, when given), else ``$DRAFTTRAIN_VLLM_PYTHON``, else
    ``bin/python`` of :func:`vllm_venv` when :func:`vllm_install_state` says ``ready`` (``bash
    scripts/install_vllm.sh``). None if there is none (an explicit path that is not a file, no venv).

    Raises:
        VllmInstallError: the venv exists without its stamp (half-installed); the message says to rerun the script.
    """
    if explicit:
        return Path(explicit).expanduser() if Path(explicit).expanduser().is_file() else None
    state, message = vllm_install_state()
    if state == "incomplete":
        raise VllmInstallError(message)
    if state == "absent":
        return None
    env = os.environ.get("DRAFTTRAIN_VLLM_PYTHON")
    return Path(env).expanduser() if env and Path(env).expanduser().is_file() else vllm_venv() / "bin" / "python"


def cpu_list() -> str:
    """The cores this process may run on, as VLLM_CPU_OMP_THREADS_BIND writes them ("0-1", "0,2,4")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_env(threads: str | None = None, kv_cache_gb: int = 4) -> dict[str, str]:
    """The environment of a vLLM process: the CPU backend on ``threads`` (VLLM_CPU_OMP_THREADS_BIND; None: every
    core of this process) with no core reserved and ``kv_cache_gb`` GiB of KV cache; no PYTHONPATH (the vLLM venv
    must not see drafttrain's packages)."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads or cpu_list(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb))}  # fmt: skip
    env.pop("PYTHONPATH", None)
    return env


class VllmProcessError(FatalError):
    """The vLLM process could not start, died, or did not answer in time (the job cannot go on with it): a
    :class:`~drafttrain.cliconfig.FatalError`, so the entry points print its one line without a traceback."""


def exit_description(returncode: int | None) -> str:
    """How a process ended, in words: ``"exit 3"``, ``"killed by SIGKILL"`` (a negative ``returncode`` is the
    signal's number, as :class:`subprocess.Popen` reports it), ``"still running"`` for None."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def read_tail(path: Path, n: int = 30, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``n`` lines of ``path`` within its last ``max_bytes`` bytes (a huge log is never read whole);
    ``[]`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - max_bytes, 0))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first one was cut
    return lines[-n:]


class VllmRequestError(RuntimeError):
    """vLLM refused or failed one request (the engine still serves the next)."""


class VllmGenerator:
    """One vLLM engine in its own process (the vLLM venv), serving greedy generation of token-id prompts.

    Nothing starts until the first :meth:`generate` (a job with nothing left to do costs no engine start-up:
    ~1 min eager on 2 cores, several with torch.compile). :meth:`close` (or leaving the ``with`` block, or the
    interpreter's exit) asks the engine to shut down, then ends the process group it was started in (the
    runner and the engine-core process vLLM spawns), so no process outlives the job, on errors too.

    Args:
        model_dir: the target's Hugging Face folder (what vLLM loads; its tokenizer too).
        max_model_len: the longest sequence (prompt + generated tokens) a request may reach.
        max_num_seqs: sequences vLLM decodes together (it batches a request's prompts itself).
        dtype: the model dtype name ("float32", "bfloat16", "float16").
        python: the vLLM venv's python (:func:`vllm_python` finds one when None).
        threads, kv_cache_gb: :func:`vllm_env`.
        memory_utilization: vLLM's ``gpu_memory_utilization`` (CPU memory on the CPU backend).
        eager: no torch.compile in vLLM (faster start-up, slower decoding).
        timeout_s: the engine's start-up and each request at most (seconds).
        log_path: where the process's stderr (vLLM's log) goes; None: a temporary file.

    Raises:
        VllmProcessError: (at the first request) no vLLM python, a half-installed vLLM venv, or the engine could
            not be built.
    """

    def __init__(self, model_dir: str | Path, max_model_len: int, max_num_seqs: int = 32, dtype: str = "float32",
                 python: str | Path | None = None, threads: str | None = None, kv_cache_gb: int = 4,
                 memory_utilization: float = 0.3, eager: bool = False, timeout_s: float = 3600,
                 log_path: str | Path | None = None):  # fmt: skip
        self.job = {"model": str(Path(model_dir).resolve()), "dtype": dtype, "max_model_len": int(max_model_len),
                    "max_num_seqs": int(max_num_seqs), "gpu_memory_utilization": float(memory_utilization),
                    "eager": bool(eager)}  # fmt: skip
        self.python = python
        self.env = vllm_env(threads, kv_cache_gb)
        self.timeout_s = float(timeout_s)
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}  # the engine's ready line: vllm_version, startup_seconds
        self.seconds = 0.0  # time spent in requests (generation only)
        self._failed: str | None = None  # why the engine is unusable (it died or hung): later requests fail at once
        self._buf = b""
        self._tmp: tempfile.TemporaryDirectory | None = None

    # -- life cycle ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the engine and wait until it is ready (no-op when it runs).

        Raises:
            VllmProcessError: no vLLM python or a half-installed venv (the message names ``bash
                scripts/install_vllm.sh``), or the engine failed to build (the tail of its log in the message),
                or it took over ``timeout_s``.
        """
        if self._failed:
            raise VllmProcessError(f"the vLLM engine failed earlier: {self._failed}")
        if self.running:
            return
        if self.proc is not None:
            self._failed = self._ended()
            raise VllmProcessError(self._failed)
        try:
            py = vllm_python(str(self.python) if self.python else None)
        except VllmInstallError as e:
            raise VllmProcessError(str(e)) from None
        if py is None:
            raise VllmProcessError(f"no vLLM python ({self.python or '.venv-vllm/bin/python, $DRAFTTRAIN_VLLM_PYTHON'}): "
                                   f"run `{INSTALL}` (creates .venv-vllm)")  # fmt: skip
        self._tmp = tempfile.TemporaryDirectory(prefix="drafttrain-vllm-")
        job_path = Path(self._tmp.name) / "engine.json"
        job_path.write_text(json.dumps(self.job))
        if self.log_path is None:
            self.log_path = Path(self._tmp.name) / "vllm.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([str(py), str(RUNNER), "--serve", str(job_path)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=logf, env=self.env, cwd=self._tmp.name,
                                         bufsize=0, start_new_session=True)  # fmt: skip
        atexit.register(self.close)
        t0 = time.perf_counter()
        log.info("starting vLLM on %s (log %s)", self.job["model"], self.log_path)
        try:
            ready = self._read(self.timeout_s)
        except BaseException:
            self.close()
            raise
        if not ready.get("ready"):
            if ready.get("traceback"):
                log.error("vLLM could not start:\n%s", ready["traceback"])
            first = (str(ready.get("error")).strip().splitlines() or ["?"])[0]
            message = f"vLLM could not start: {first}; {self._log_tail()}"  # before close() removes a temporary log
            self.close()
            raise VllmProcessError(message)
        self.info = {"vllm_version": ready.get("vllm_version"), "startup_seconds": round(time.perf_counter() - t0, 1)}
        log.info("vLLM %s ready after %.0f s", self.info["vllm_version"], self.info["startup_seconds"])

    def close(self) -> None:
        """Shut the engine down and end every process of its group; idempotent."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.close)
        if proc is None:
            return
        try:
            if proc.poll() is None:
                try:
                    _send(proc, b'{"shutdown": true}\n')
                    proc.stdin.close()
                except OSError:
                    pass
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self._signal(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        self._signal(proc.pid, signal.SIGKILL)
                        proc.wait(timeout=15)
            # the runner is gone; end what is left of its group (an engine core it could not stop)
            if group_alive(proc.pid):
                self._signal(proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and group_alive(proc.pid):
                    time.sleep(0.2)
                if group_alive(proc.pid):
                    self._signal(proc.pid, signal.SIGKILL)
        finally:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            if self._tmp is not None and self.log_path is not None and Path(self._tmp.name) in self.log_path.parents:
                self.log_path = None  # the temporary log goes with its folder
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)  # the session started for the runner: only processes we started
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "VllmGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 stop_token_ids: Iterable[int] = ()) -> list[dict]:  # fmt: skip
        """Greedy continuations of ``prompts``, all in one request (vLLM batches them itself).

        Args:
            prompts: b token id lists (each non-empty).
            max_new_tokens: generated tokens per prompt at most (>= 1): one int, or one per prompt.
            stop_token_ids: ids that end a sequence (included in its output when produced). The model's own
                eos stops nothing unless it is among them (the same rule as ``Target.generate``).

        Returns:
            One dict per prompt, in order: ``tokens`` (prompt + generated, list[int]), ``num_prompt`` (int),
            ``finish_reason`` ("stop": ended by a stop id | "length"): ``Target.generate``'s contract
            without features.

        Raises:
            ValueError: an empty prompt or a cap < 1.
            VllmRequestError: vLLM failed this request (e.g. a sequence longer than ``max_model_len``).
            VllmProcessError: the engine could not start, died, or did not answer within ``timeout_s``.
        """
        b = len(prompts)
        caps = [int(max_new_tokens)] * b if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
        if len(caps) != b or min(caps, default=1) < 1 or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs >= 1 token and a max_new_tokens >= 1")
        if not b:
            return []
        stops = sorted({int(t) for t in stop_token_ids})
        self.start()
        req = {"prompts": [[int(t) for t in p] for p in prompts], "max_new_tokens": caps, "stop_token_ids": stops}
        t0 = time.perf_counter()
        try:
            try:
                _send(self.proc, (json.dumps(req) + "\n").encode())
            except OSError as err:
                raise VllmProcessError(f"the vLLM process is gone ({err}); {self._log_tail()}") from err
            ans = self._read(self.timeout_s)
        except VllmProcessError as err:  # dead or hung: never read a late answer as the next request's
            self._failed = str(err)
            self.close()
            raise
        self.seconds += time.perf_counter() - t0
        if "error" in ans:
            raise VllmRequestError(f"vLLM: {ans['error']}")
        outs = ans["outputs"]
        if len(outs) != b:
            raise VllmProcessError(f"vLLM answered {len(outs)} outputs for {b} prompts")
        stop_set = set(stops)
        results = []
        for p, o, cap in zip(prompts, outs, caps):
            if len(o) > cap or any(t in stop_set for t in o[:-1]):
                raise VllmRequestError(f"vLLM output breaks the request's caps or stops: {len(o)} tokens, cap {cap}")
            results.append({"tokens": list(p) + list(o), "num_prompt": len(p),
                            "finish_reason": "stop" if o and o[-1] in stop_set else "length"})  # fmt: skip
        return results

    def _read(self, timeout: float) -> dict:
        """The next JSON line from the process, within ``timeout`` seconds."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise VllmProcessError(f"vLLM did not answer within {timeout:.0f} s (generation.vllm.timeout_s); "
                                       f"{self._log_tail()}")  # fmt: skip
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise VllmProcessError(self._ended())
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass  # its stdout closed but it lingers: reported as still running, close() ends it
                raise VllmProcessError(self._ended())
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _ended(self) -> str:
        """One line for a process that ended: how (exit code or signal by name), where its log is and its last
        non-empty line; the log's last 30 lines go to this module's logger (a bounded read: :func:`read_tail`)."""
        how = exit_description(self.proc.returncode if self.proc is not None else None)
        if self.log_path is None:
            return f"the vLLM process ended ({how}); no log"
        tail = read_tail(self.log_path)
        if tail:
            log.error("the vLLM process ended (%s); the last lines of %s:\n%s", how, self.log_path, "\n".join(tail))
        last = next((line.strip() for line in reversed(tail) if line.strip()), "")
        return (f"the vLLM process ended ({how}); log {self.log_path}" + (f", last line: {last[:300]}" if last else "")
                + "; the generation resumes from its last whole shard when rerun")

    def _log_tail(self, n: int = 30) -> str:
        """``log <path>: <its last non-empty line>`` (bounded read) for the one-line errors; ``no log``."""
        if self.log_path is None:
            return "no log"
        last = next((line.strip() for line in reversed(read_tail(self.log_path, n)) if line.strip()), "")
        return f"log {self.log_path}" + (f", last line: {last[:300]}" if last else "")


def _send(proc: subprocess.Popen, data: bytes) -> None:
    """Write all of ``data`` to the process's stdin (an unbuffered pipe: one write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(proc.stdin.fileno(), view) :]


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group ``pgid``. Linux reads /proc (an exited process a
    container's init never reaps still "exists" for ``killpg(pgid, 0)``); elsewhere ``killpg(pgid, 0)``."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False
