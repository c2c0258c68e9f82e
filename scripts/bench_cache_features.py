"""Feature cache on the real target: `estimate=true` vs the bytes actually written; writes docs/benchmarks/cache_features.{json,md}.

    python -m scripts.bench_cache_features dataset=data/bench_generate/full-bs32

Runs ``python -m scripts.cache_features dataset=DATASET estimate=true`` and then the same command without
``estimate=true`` (both as subprocesses: the real CLI), and records the estimate, the bytes written
(every file of the cache folder), their difference, the rows/positions and the seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

@dataclass
class BenchCacheFeaturesConfig:
    """Schema of ``python -m scripts.bench_cache_features`` (key=value overrides, validated before any work)."""

    dataset: str = MISSING  # a scripts.generate_data output folder (required)
    top_k: int = 8
    dtype: str = "float16"
    overrides: list[str] = field(default_factory=list)  # extra cache_features overrides (e.g. [target=tiny] for a dry run)
    out: str = "docs/benchmarks/cache_features"


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli
    from scripts.common import machine, machine_line, reproduce, write_report

    args = parse_cli(BenchCacheFeaturesConfig, argv)
    out = Path(args.dataset) / "features-bench"
    shutil.rmtree(out, ignore_errors=True)
    base = [sys.executable, "-m", "scripts.cache_features", f"dataset={args.dataset}", f"output_dir={out}",
            f"top_k={args.top_k}", f"dtype={args.dtype}", "progress=false", *args.overrides]
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    est = subprocess.run([*base, "estimate=true"], capture_output=True, text=True, env=env, check=True).stdout
    estimated = int(re.search(r"estimated (\d+) bytes", est).group(1))
    t0 = time.time()
    run = subprocess.run(base, capture_output=True, text=True, env=env, check=True).stdout
    seconds = time.time() - t0
    meta = json.loads((out / "feature_cache.json").read_text())
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    lines = [x for x in est.splitlines() if x.startswith("[cache_features]")]
    result = {
        "command": reproduce("bench_cache_features", argv),
        "cli": " ".join(["python", *base[1:]]),
        "estimate_line": lines[0] if lines else est.strip()[-300:],
        "bytes_estimated": estimated,
        "bytes_written": written,
        "difference_percent": round(100 * (written - estimated) / estimated, 3),
        "rows": meta["rows"],
        "hidden_size": meta["hidden_size"],
        "top_k": meta["top_k"],
        "dtype": meta["dtype"],
        "schema_version": meta["schema_version"],
        "seconds": round(seconds, 1),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "loadavg_1min_end": round(os.getloadavg()[0], 2),
        "machine": machine(),
        "log_tail": run.strip().splitlines()[-1:],
    }
    md = ["# Feature cache on the real target: estimate vs bytes written", "", "```bash", result["command"],
          f"# runs: {result['cli']} estimate=true   then the same without estimate=true", "```", "",
          "| quantity | value |", "|---|---|",
          f"| dataset | `{args.dataset}` ({result['rows']} rows) |",
          f"| stored | features {result['dtype']} [L-1, {result['hidden_size']}] + top-{result['top_k']} ids/logits, schema v{result['schema_version']} |",
          f"| `estimate=true` | {estimated:,} bytes |",
          f"| bytes written (every file in the cache folder) | {written:,} bytes |",
          f"| **difference** | **{result['difference_percent']:+.2f}%** |",
          f"| seconds (target forward over every row + writing) | {result['seconds']} |",
          f"| date, load average at the end | {result['date']}, {result['loadavg_1min_end']} |",
          f"| host | {machine_line(result['machine'])} |", ""]
    write_report(args.out, result, "\n".join(md))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
