"""Training throughput and peak memory of the ParallelSpec recipe across launch presets.

    python -m scripts.bench_scaling steps=20 'presets=[cpu,cpu@1,cpu_ddp,zero2,zero3]'

Each preset runs ``accelerate launch --config_file conf/accelerate/PRESET.yaml train.py
+recipe=parallelspec`` on the real target for ``steps`` optimizer steps with the same global batch
(``global_batch`` sequences per step, split evenly over the processes) and the same number of CPU
threads in total (``threads``, split evenly; ``PRESET@N`` runs a preset with N threads in total), with evaluation and intermediate checkpoints off. The
self-distilled data must already be in the cache (default ``data.*`` settings, so that the cache key
matches): this script never generates data. It reads back each run's ``metrics.jsonl`` and
``final_metrics.json`` and writes ``docs/benchmarks/scaling.json`` and ``scaling.md``:

- drafter tokens/s: drafter input slots (context items + [MASK] slots) processed per second, summed
  over ranks (the loop's ``train/tokens_per_s``), averaged over the logging windows after the first
  (the first holds start-up work);
- seconds per optimizer step and sequences/s over the same windows;
- peak memory per rank: peak resident set size on a CPU (the whole process: Python, torch, the
  frozen target, the data), ``torch.cuda.max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
WORLD = {"cpu": 1, "cpu_ddp": 2, "ddp": 2, "zero2": 2, "zero2_offload": 2, "zero3": 2, "zero3_offload": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_preset(spec: str, steps: int, global_batch: int, threads: int, log_every: int, out_root: Path,
               extra: list[str]) -> dict:  # fmt: skip
    """Run one preset; ``spec`` is ``NAME`` or ``NAME@THREADS`` (total threads for this run)."""
    preset, _, t = spec.partition("@")
    threads = int(t) if t else threads
    world = WORLD[preset]
    if global_batch % world or threads % world:
        raise SystemExit(f"global_batch={global_batch} and threads={threads} must divide by {world} processes")
    run_dir = out_root / spec.replace("@", "_t")
    launcher = ["--main_process_port", str(free_port())] if world > 1 else []
    overrides = [
        "+recipe=parallelspec", f"output_dir={run_dir}", f"trainer.max_steps={steps}", "trainer.max_minutes=null",
        f"trainer.micro_batch_size={global_batch // world}", f"trainer.num_threads={threads // world}",
        f"trainer.log_every={log_every}", "trainer.eval_every=0", "trainer.save_every=0", "trainer.spec_eval.every=0",
        "trainer.spec_eval.num_prompts=0", "trainer.progress=false", "logging.wandb=false", *extra,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"conf/accelerate/{preset}.yaml",
           *launcher, "train.py", *overrides]  # fmt: skip
    load_before = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{preset} failed:\n{(proc.stdout + proc.stderr)[-5000:]}")
    log = proc.stdout + proc.stderr
    if "self-distillation:" in log and "'generated_tokens_this_run': 0," not in log:
        print(f"warning: {spec} generated data (the cache did not match); its timing includes none of it", file=sys.stderr)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    windows = [r for r in rows if "train/tokens_per_s" in r][1:]  # drop the first window (start-up)
    final = json.loads((run_dir / "final_metrics.json").read_text())
    sps = sum(r["train/seconds_per_step"] for r in windows) / len(windows)
    config = json.loads((run_dir / "config.json").read_text())
    return {
        "preset": preset,
        "spec": spec,
        "target": config["target"]["name"],
        "processes": world,
        "micro_batch_size": global_batch // world,
        "threads_per_process": threads // world,
        "drafter_tokens_per_s": sum(r["train/tokens_per_s"] for r in windows) / len(windows),
        "seconds_per_step": sps,
        "sequences_per_s": global_batch / sps,
        "peak_mem_mb_per_rank": final["peak_mem_mb_per_rank"],
        "final_train_loss": [r["train/loss"] for r in rows if "train/loss" in r][-1],
        "launch": {k: v for k, v in final["launch"].items() if k != "deepspeed_config"},
        "command_seconds": round(wall, 1),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # other processes on the machine
        "command": " ".join(["accelerate launch", "--config_file", f"conf/accelerate/{preset}.yaml", "train.py", *overrides[:1],
                             *[o for o in overrides[1:] if not o.startswith("output_dir=")]]),  # fmt: skip
    }


def markdown(result: dict) -> str:
    from scripts.common import machine_line

    m = result["machine"]  # a string in runs recorded before drafttrain.host.describe
    host_line = machine_line(m) if isinstance(m, dict) else f"host not recorded ({m})"
    lines = [
        "# Scaling: ParallelSpec training throughput by launch preset",
        "",
        "Reproduce (on a machine where the self-distilled data is already cached):",
        "",
        "```bash",
        result["command"],
        "```",
        "",
        f"Machine: {host_line}. Target `{next((r['target'] for r in result['runs'] if 'target' in r), '?')}`, recipe `parallelspec`, "
        f"{result['steps']} optimizer steps per preset, global batch {result['global_batch']} sequences, "
        f"{result['threads']} CPU threads in total unless the preset says `@N`, mixed precision `{result['mixed_precision']}`. "
        "Throughput is averaged over the logging windows after the first. The last column is the machine's "
        "1-minute load average before/after each run (other jobs shared the cores when it exceeds the threads used).",
        "",
        "| preset | processes x micro-batch | threads/process | drafter tokens/s | s/step | sequences/s | peak memory per rank (MiB) | loss at last step | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| `{r['spec']}` | failed: see `error` in the JSON | | | | | | | |")
            continue
        r = {**r, "preset": r["spec"]}
        mem = ", ".join(f"{m:.0f}" for m in r["peak_mem_mb_per_rank"])
        lines.append(f"| `{r['preset']}` | {r['processes']} x {r['micro_batch_size']} | {r['threads_per_process']} | "
                     f"{r['drafter_tokens_per_s']:.0f} | {r['seconds_per_step']:.2f} | {r['sequences_per_s']:.2f} | "
                     f"{mem} | {r['final_train_loss']:.4f} | {r['load_average_1min'][0]:.1f} / {r['load_average_1min'][1]:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


@dataclass
class BenchScalingConfig:
    """Schema of ``python -m scripts.bench_scaling`` (key=value overrides, validated before any work)."""

    presets: list[str] = field(default_factory=lambda: ["cpu", "cpu@1", "cpu_ddp", "zero2", "zero3"])  # NAME or NAME@THREADS
    steps: int = 20
    global_batch: int = 8
    threads: int = 2
    log_every: int = 5
    out: str = "docs/benchmarks/scaling"
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every run


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import ConfigError, parse_cli
    from drafttrain.validation import resolve_mixed_precision
    from scripts.common import machine, reproduce, write_report

    args = parse_cli(BenchScalingConfig, argv)
    unknown = [p for p in args.presets if p.partition("@")[0] not in WORLD]
    if unknown:
        raise ConfigError(f"presets: {unknown} not among {sorted(WORLD)} (NAME or NAME@THREADS)")
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        runs = []
        for preset in args.presets:
            print(f"[bench_scaling] {preset} ...", flush=True)
            try:
                runs.append(run_preset(preset, args.steps, args.global_batch, args.threads, args.log_every, Path(tmp),
                                       args.overrides))  # fmt: skip
            except SystemExit as e:  # keep the other presets' numbers; the table says which one failed
                print(e, file=sys.stderr)
                runs.append({"spec": preset, "error": str(e)[-2000:]})
                continue
            print(json.dumps({k: runs[-1][k] for k in ("drafter_tokens_per_s", "seconds_per_step", "peak_mem_mb_per_rank")}))
    result = {
        "command": reproduce("bench_scaling", argv),
        "machine": machine(),  # drafttrain.host.describe (GPU name included) + the load average
        "steps": args.steps,
        "global_batch": args.global_batch,
        "threads": args.threads,
        "mixed_precision": resolve_mixed_precision("auto"),
        "runs": runs,
    }
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
