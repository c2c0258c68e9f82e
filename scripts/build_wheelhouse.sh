#!/usr/bin/env bash
# Build the wheelhouse scripts/device_check.sh installs from on a GPU machine without network access.
#
#   bash scripts/build_wheelhouse.sh [DIR]        (default DIR: wheelhouse/, git-ignored)
#
# Run it on a machine that reaches the package registry; the folder then travels with the working tree.
# It holds what the GPU machine's Python lacks and the check needs (it has torch, transformers, accelerate
# and triton): hydra-core, omegaconf and antlr4 (drafttrain's config modules import omegaconf), pytest,
# pluggy, iniconfig, pygments and pytest-timeout (the CUDA-marked tests). datasets, wandb and deepspeed are not
# needed by the check and are left out (datasets alone would bring pyarrow, ~40 MiB). Pure-Python wheels
# only (--no-deps, the exact list), so the folder suits any CPython 3 and stays far under 60 MiB; the script
# fails if it grows past 60 MiB. Prints each wheel's size.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-wheelhouse}"
PY="${PYTHON:-.venv/bin/python}"
# the versions of the project environment (.venv) the tests pass with
PACKAGES=(hydra-core==1.3.8 omegaconf==2.3.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0)
mkdir -p "$DIR"
if ! "$PY" -m pip download --no-deps --only-binary=:all: --dest "$DIR" "${PACKAGES[@]}"; then
  echo "build_wheelhouse: the package registry is not reachable from here; build it where it is" >&2
  exit 3
fi
# antlr4 4.9.3 (omegaconf's pin) ships only a source archive: build its wheel locally
ls "$DIR"/antlr4* >/dev/null 2>&1 || "$PY" -m pip wheel --no-deps --wheel-dir "$DIR" antlr4-python3-runtime==4.9.3
du -b "$DIR"/* | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2; t += $1} END {printf "%8.2f MiB  total\n", t / 1048576}'
total=$(du -sb "$DIR" | cut -f1)
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
  echo "build_wheelhouse: $DIR is $total bytes, over the 60 MiB the working tree may carry" >&2
  exit 4
fi
