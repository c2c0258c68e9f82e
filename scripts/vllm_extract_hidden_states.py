"""Can vLLM's CPU build fill a feature cache? ``extract_hidden_states`` with the ExampleHiddenStatesConnector.

    .venv-vllm/bin/python scripts/vllm_extract_hidden_states.py --model <target folder>
    # the packaged target's folder: .venv/bin/python -c "from drafttrain.config import TargetConfig; \
    #   from drafttrain.target import resolve_target_dir; print(resolve_target_dir(TargetConfig()))"

Starts vLLM (eager, fp32, 2 GiB of KV cache) with ``speculative_config={"method": "extract_hidden_states"}``
reading the main job's drafter layers (2, 15, 27 and the last) and the connector writing one safetensors file
per request into ``--out``, runs two prompts of one generated token, and lists what was written. Prints
``OK`` and the files, or the first error line. Runs in the vLLM venv (``bash scripts/install_vllm.sh``), not
in the project's. Measured result: docs/benchmarks/labelling.md.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="outputs/vllm_hidden_states")
    ap.add_argument("--layers", default="2,15,27,29")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.makedirs(a.out, exist_ok=True)
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=a.model, dtype="float32", max_model_len=1024, enforce_eager=True, gpu_memory_utilization=0.3,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": [int(i) for i in a.layers.split(",")]}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": os.path.abspath(a.out)}})  # fmt: skip
    print(f"vLLM started in {time.time() - t0:.0f} s", flush=True)
    prompts = [{"prompt_token_ids": [1, 504, 3458, 314, 253, 1345, 28, 2, 17, 18, 19]}, {"prompt_token_ids": [1, 30, 31, 32, 33]}]
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    except Exception as e:  # noqa: BLE001 - the point is to report it
        print(f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return
    print("OK", sorted(os.listdir(a.out)))


if __name__ == "__main__":
    main()
