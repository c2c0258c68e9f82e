"""Can vLLM's build on this host fill a feature cache? ``extract_hidden_states`` with the ExampleHiddenStatesConnector.

    python -m scripts.vllm_extract_hidden_states                       # the packaged target, the main job's layers
    python -m scripts.vllm_extract_hidden_states model=<target folder> layers=[2,15,27,29]

Starts vLLM (eager, fp32, 2 GiB of KV cache) in vLLM's own venv (``bash scripts/install_vllm.sh``) with
``speculative_config={"method": "extract_hidden_states"}`` reading the drafter layers ``layers`` and the
connector writing one safetensors file per request into ``out``, runs two prompts of one generated token,
and lists what was written. Prints ``OK`` and the files, or the first error line (exit status 1). The probe
itself runs as a child in the vLLM venv (it has no drafttrain); this script builds its inputs and reads its
answer. Measured result: docs/benchmarks/labelling.md.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from drafttrain.cliconfig import ConfigError, parse_cli, run_cli

# The child's program: vLLM only, its inputs as one JSON object on stdin. Kept as text because it runs in another venv.
PROBE = r"""
import json, os, sys, time
a = json.loads(sys.stdin.read())
os.makedirs(a["out"], exist_ok=True)
from vllm import LLM, SamplingParams
t0 = time.time()
llm = LLM(model=a["model"], dtype="float32", max_model_len=1024, enforce_eager=True, gpu_memory_utilization=0.3,
          speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                              "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": a["layers"]}}},
          kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                              "kv_connector_extra_config": {"shared_storage_path": a["out"]}})
print(f"vLLM started in {time.time() - t0:.0f} s", flush=True)
prompts = [{"prompt_token_ids": [1, 504, 3458, 314, 253, 1345, 28, 2, 17, 18, 19]}, {"prompt_token_ids": [1, 30, 31, 32, 33]}]
try:
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
except Exception as e:  # the point is to report it
    print(f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    sys.exit(1)
print("OK", sorted(os.listdir(a["out"])), flush=True)
"""


@dataclass
class ExtractHiddenStatesConfig:
    """Schema of ``python -m scripts.vllm_extract_hidden_states`` (key=value overrides, validated before any work)."""

    model: str | None = None  # the target folder; null = the packaged default target's converted folder
    out: str = "outputs/vllm_hidden_states"  # where the connector writes its safetensors files
    layers: list[int] = field(default_factory=lambda: [2, 15, 27, 29])  # the target layers vLLM hands out
    vllm_python: str | None = None  # null = .venv-vllm/bin/python (scripts/install_vllm.sh), else $DRAFTTRAIN_VLLM_PYTHON
    timeout_s: int = 900  # the child's wall-clock limit


def main(argv: list[str] | None = None) -> None:
    c = parse_cli(ExtractHiddenStatesConfig, argv)
    if c.timeout_s < 1 or any(i < 0 for i in c.layers):
        raise ConfigError("timeout_s must be >= 1 and layers must be >= 0")
    from drafttrain.generation.vllm_client import INSTALL, vllm_env, vllm_python

    py = vllm_python(c.vllm_python)
    if py is None:
        raise ConfigError(f"no vLLM venv: run `{INSTALL}` (creates .venv-vllm) or set vllm_python=")
    model = c.model
    if model is None:
        from drafttrain.config import TargetConfig
        from drafttrain.target import resolve_target_dir

        model = str(resolve_target_dir(TargetConfig()))
    if not Path(model).is_dir():
        raise ConfigError(f"model={model} is not a folder")
    args = json.dumps({"model": str(Path(model).resolve()), "out": str(Path(c.out).resolve()), "layers": list(c.layers)})
    proc = subprocess.run([str(py), "-c", PROBE], input=args, env=vllm_env(kv_cache_gb=2), timeout=c.timeout_s, text=True,
                          capture_output=True)  # fmt: skip
    lines = [ln for ln in (proc.stdout or "").splitlines() if ln.startswith(("vLLM started", "OK", "FAILED"))]
    print("\n".join(lines) or f"no answer from the child (exit {proc.returncode}): {(proc.stderr or '').strip()[-300:]}")
    if proc.returncode != 0:
        raise SystemExit(1)


if __name__ == "__main__":
    run_cli(main)
