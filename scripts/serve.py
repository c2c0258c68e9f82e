"""Serve an exported drafter with its target in vLLM's OpenAI-compatible server, on this CPU host.

    bash scripts/install_vllm.sh                                               # once: vLLM's CPU build in .venv-vllm
    python -m scripts.serve checkpoint=outputs/parallelspec_eagle3-smollm2-135m-instruct    # a training run (its export/)
    python -m scripts.serve checkpoint=outputs/export/eagle3 port=8001                     # an exported folder
    python -m scripts.serve checkpoint=outputs/export/eagle3 speculative=false             # the target alone
    python -m scripts.serve checkpoint=outputs/export/eagle3 dry_run=true                  # print the command only

Reads the export's ``export_info.json`` (``scripts.export``, or ``output_dir/export`` of a training run): the
target folder, the format and the speculation block (K and its batch-size schedule,
:mod:`drafttrain.export.speculation`), and starts ``python -m vllm.entrypoints.openai.api_server`` under
``.venv-vllm`` with absolute paths and the CPU settings (``VLLM_CPU_OMP_THREADS_BIND`` = this process's
cores, no reserved core, ``VLLM_CPU_KVCACHE_SPACE``, ``--gpu-memory-utilization 0.3 --max-model-len 1024
--enforce-eager``): :func:`drafttrain.export.vllm_cpu_command`. The server replaces this process (Ctrl-C
stops it). Where the export found that no K pays on this host, it serves without speculation and says so.

Keys: :class:`ServeConfig` below (``--help``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServeConfig:
    """Start vLLM's OpenAI server on an exported drafter and its target (this CPU host's settings).

    ``checkpoint``: a training run folder (its ``export/`` is served) or an exported folder (holding
    ``export_info.json``).
    """

    checkpoint: str | None = None
    speculative: bool = True  # false = the target alone; true = the export's K where it pays on this host
    force_speculation: bool = False  # serve speculatively even where the export expects a slowdown on this host
    host: str = "127.0.0.1"
    port: int = 8000
    vllm_python: str | None = None  # null = .venv-vllm/bin/python (scripts/install_vllm.sh), else $DRAFTTRAIN_VLLM_PYTHON
    threads: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; null = this process's cores
    kv_cache_gb: int = 4  # VLLM_CPU_KVCACHE_SPACE (GiB)
    memory_utilization: float = 0.3  # vLLM's gpu_memory_utilization: a fraction of this host's memory on CPU
    max_model_len: int = 1024
    eager: bool = True  # no torch.compile: a minute less start-up on 2 cores
    dry_run: bool = False  # print the command and exit


def export_folder(checkpoint: str | Path) -> Path:
    """The exported folder of ``checkpoint``: itself when it holds ``export_info.json``, else its ``export/``.

    Raises:
        ConfigError: neither holds ``export_info.json`` (names the export command to run).
    """
    from drafttrain.config import ConfigError

    ckpt = Path(checkpoint).expanduser()
    for d in (ckpt, ckpt / "export"):
        if (d / "export_info.json").is_file():
            return d.resolve()
    raise ConfigError(f"no export_info.json in {ckpt} or {ckpt / 'export'}: export it first "
                      f"(python -m scripts.export checkpoint={ckpt})")  # fmt: skip


def command(c: ServeConfig) -> tuple[dict[str, str], list[str], str | None]:
    """(VLLM_CPU_* env, argv, a note when speculation is off by the export's verdict) for config ``c``.

    Raises:
        ConfigError: no checkpoint / export, a format vLLM does not load (SGLang's), no vLLM venv.
    """
    from drafttrain.config import ConfigError
    from drafttrain.export import VLLM_METHOD, vllm_cpu_command, vllm_speculative_config
    from drafttrain.generation.vllm_client import INSTALL, vllm_python

    if not c.checkpoint:
        raise ConfigError("checkpoint is required (checkpoint=outputs/<run> or an exported folder)")
    if not 1 <= c.port <= 65535 or c.kv_cache_gb < 1 or not 0 < c.memory_utilization <= 1 or c.max_model_len < 16:
        raise ConfigError("port must be in 1..65535, kv_cache_gb >= 1, memory_utilization in (0, 1], max_model_len >= 16")
    out = export_folder(c.checkpoint)
    info = json.loads((out / "export_info.json").read_text())
    fmt = info["format"]
    if fmt not in VLLM_METHOD:
        raise ConfigError(f"the '{fmt}' folder is not a vLLM format; serve it with its own engine: "
                          f"{info.get('commands', ['?'])[0]}")  # fmt: skip
    py = vllm_python(c.vllm_python)
    if py is None:
        raise ConfigError(f"no vLLM venv: run `{INSTALL}` (creates .venv-vllm) or set vllm_python=")
    target = info["target_path"]
    if not Path(target).is_dir():
        raise ConfigError(f"the export's target folder {target} does not exist on this host "
                          "(re-export with target_path=DIR)")  # fmt: skip
    sp = info.get("speculation") or {}
    note = None
    spec = None
    if c.speculative:
        if sp.get("pays") is False and not c.force_speculation:
            why = (sp["line_note"].strip().lstrip("# ") if sp.get("line_note") else
                   f"expected {sp['expected_speedup']:.2f}x at best (K={sp['num_speculative_tokens']})")  # fmt: skip
            note = f"{why}: serving without speculation on this host (force_speculation=true serves it anyway)"
        else:
            engine_cfg = json.loads((out / "config.json").read_text())
            spec = vllm_speculative_config(fmt, out, int(info["num_speculative_tokens"]), engine_cfg, sp)
    env, argv = vllm_cpu_command(target, spec, python=str(py), threads=c.threads, kv_cache_gb=c.kv_cache_gb,
                                 memory_utilization=c.memory_utilization, max_model_len=c.max_model_len,
                                 eager=c.eager, host=c.host, port=c.port)  # fmt: skip
    return env, argv, note


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli
    from drafttrain.export import shell_line

    c = parse_cli(ServeConfig, argv)
    env, cmd, note = command(c)
    if note:
        print(f"[drafttrain] {note}", flush=True)
    print(f"[drafttrain] {shell_line(env, cmd)}", flush=True)
    if c.dry_run:
        return
    full = {**os.environ, **env}
    full.pop("PYTHONPATH", None)  # the vLLM venv must not see drafttrain's packages
    sys.stdout.flush()
    os.execve(cmd[0], cmd, full)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
