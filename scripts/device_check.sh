#!/usr/bin/env bash
# One check of drafttrain on a GPU machine (one H100, no network), in under 10 minutes.
#
#   bash scripts/device_check.sh [--out DIR] [--dry-run]      (default DIR: device_check_out/)
#
# 1. installs what the machine's Python lacks from wheelhouse/ (built beforehand on a machine with network
#    access by scripts/build_wheelhouse.sh, carried with the working tree, git-ignored), offline;
# 2. runs the CUDA-marked tests (pytest -m cuda: flex vs dense losses and gradients in fp32 and bf16);
# 3. runs scripts/device_check.py: training tokens/s, step time, peak GiB and MFU of eagle3,
#    parallelspec_eagle3 and parallelspec with a random Llama-3.1-8B-shaped bf16 target at sequence length
#    2048 and 4096, micro-batch 1-4, dense vs flex; plain greedy decoding at batch 1 and 16, our engine
#    beside HF generate, greedy-equal rows; it writes gpu.json and gpu.md into DIR.
#
# --dry-run: the same steps on the CPU with tiny shapes and no timings (CI runs it: tests/scripts/test_device_check.py);
# the CUDA tests then only collect and skip. Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=device_check_out
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    *) echo "usage: bash scripts/device_check.sh [--out DIR] [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUT"
export WANDB_MODE=offline PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)

# 1. missing packages from the wheelhouse (nothing to do where they are installed)
missing=()
for mod in omegaconf:omegaconf hydra:hydra-core antlr4:antlr4-python3-runtime pytest:pytest pytest_timeout:pytest-timeout; do
  "$PY" -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ ! -d wheelhouse ]; then
    echo "device_check: missing ${missing[*]} and no wheelhouse/ (bash scripts/build_wheelhouse.sh where the registry is reachable)" >&2
    exit 3
  fi
  "$PY" -m pip install --no-index --find-links wheelhouse --no-deps "${missing[@]}" pluggy iniconfig pygments
fi

# 2. the CUDA-marked tests (on the CPU: collected, skipped)
TESTS="not run"
set +e
"$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_flex_attention.py tests/test_device_paths.py > "$OUT/cuda_tests.log" 2>&1
rc=$?
set -e
TESTS="$(tail -n 1 "$OUT/cuda_tests.log") (exit $rc)"
echo "device_check: cuda tests: $TESTS"
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
  echo "device_check: CUDA tests failed (see $OUT/cuda_tests.log); measuring anyway" >&2
fi

# 3. the measurements (timed points stop being started after budget_s, so the whole stays under 10 min)
LEFT=$(( 540 - ($(date +%s) - T0) - 150 ))
ARGS=("out=$OUT" "tests='${TESTS//\'/}'" "budget_s=$(( LEFT > 60 ? LEFT : 60 ))")
[ $DRY -eq 1 ] && ARGS+=(dry_run=true)
"$PY" -m scripts.device_check "${ARGS[@]}"
echo "device_check: done in $(( $(date +%s) - T0 )) s; $OUT/gpu.md"
[ $rc -eq 0 ] || [ $rc -eq 5 ]
