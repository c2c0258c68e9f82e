"""vLLM 0.32's CPU build on a target with recurrent layers (Qwen3-Next) and an MLA target (DeepSeek-V3), each with
the EAGLE-3 export of a drafter: vLLM loads both (bf16; prefix caching off for the hybrid, whose "align" mode is
Triton's; attention head size 64; a 512 + 64 MLA latent), and its speculative greedy output differs from its own
plain greedy at one request at a time. That is why the export's CPU line serves such targets without speculation
(:func:`drafttrain.export.vllm_cpu_refusal`); the day vLLM's outputs agree, this test says so and the refusal can go.
Skipped without a finished ``.venv-vllm`` (CI)."""

from __future__ import annotations

import json

import pytest
import torch

from drafttrain.target import Target, tiny
from drafttrain.sweep import vary_weights

SIZES = {
    "Qwen3NextForCausalLM": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                                 linear_num_value_heads=4, intermediate_size=512),
    "DeepseekV3ForCausalLM": dict(kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                  v_head_dim=64, head_dim=64, num_attention_heads=4, num_key_value_heads=4, hidden_size=256,
                                  intermediate_size=512, moe_intermediate_size=64, first_k_dense_replace=8),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name", list(SIZES))
def test_vllm_cpu_speculation_is_not_lossless_on_hybrid_and_mla_targets(tiny_target, name, tmp_path):
    from drafttrain.drafters import build_drafter
    from drafttrain.export import export_drafter, vllm_cpu_refusal
    from drafttrain.generation.vllm_client import vllm_install_state, vllm_python
    from scripts.serve_check import run_vllm

    state, why = vllm_install_state()
    if state != "ready":
        pytest.skip(why)
    tok = tiny_target.tokenizer
    model = tiny.build(name, tok, num_layers=8, **SIZES[name])
    vary_weights(model, std=0.3)
    target = Target(model, tok)
    assert vllm_cpu_refusal(target)  # the export's line refuses speculation on it
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    drafter = build_drafter("eagle3", {"draft_depth": 3, "draft_vocab_size": 0}, target).eval()
    export_drafter(drafter, "speculators", tmp_path / "eagle3", verifier=str(tmp_path / "target"),
                   num_speculative_tokens=3, target_config=target.config)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok) - 1, (9,), generator=g).tolist() for _ in range(4)]
    runs = [{"speculative_config": None}, {"speculative_config": {"model": str(tmp_path / "eagle3"), "method": "eagle3",
                                                                  "num_speculative_tokens": 3}}]  # fmt: skip
    job = {"model": str(tmp_path / "target"), "prompts": prompts, "max_new_tokens": 16, "stop_token_ids": [],
           "max_model_len": 256, "eager": True, "runs": runs, "prefix_caching": False, "dtype": "bfloat16"}  # fmt: skip
    plain, spec = run_vllm(vllm_python(), job, threads="0-1", memory_gb=1, timeout_s=1800, log_path=tmp_path / "vllm.log")
    assert "error" not in plain and "error" not in spec, (plain.get("error"), spec.get("error"))
    (tmp_path / "result.json").write_text(json.dumps([plain, spec]))
    equal = [a == b for a, b in zip(plain["outputs"], spec["outputs"])]
    assert spec["acceptance"]["num_drafts"] > 0
    assert not all(equal), f"vLLM's speculative output now equals its plain output on {name}: lift vllm_cpu_refusal"
