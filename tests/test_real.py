"""Tests on the real SmolLM2-135M target and packaged data (marked ``real``; ~30 s once converted).

Why: the tiny random targets exercise the logic, but only the real model shows that the GGUF
conversion, the frozen-target contract and greedy equality hold where the main job runs.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain import assets
from helpers import need_input
from drafttrain.config import TargetConfig
from drafttrain.data.sources import load_eval_prompts
from drafttrain.data.template import prompt_ids
from drafttrain.drafters import build_drafter
from reference_decoding import evaluate_prompts
from drafttrain.target import load_target

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real_target():
    need_input(assets.smollm2_gguf)  # not installed: fail with the install command (never skip)
    return load_target(TargetConfig())


def test_conversion_is_cached_and_reused(real_target):
    """The GGUF is converted once: a second call returns the same folder and rewrites nothing."""
    folder = assets.converted_target_dir()
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert assets.converted_target_dir() == folder
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert (folder / "config.json").is_file() and (folder / "drafttrain_conversion.json").is_file()
    assert any(folder.glob("*.safetensors"))


def test_real_target_is_frozen_and_returns_features(real_target):
    """Frozen target contract: eval mode, no grads; hidden [b, s, 576] post-norm, logits [b, s, 49152]."""
    model = real_target.model
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    tok = real_target.tokenizer
    ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])])
    out = real_target.forward(ids)
    assert out.hidden.shape == (1, ids.shape[1], 576) and out.logits.shape == (1, ids.shape[1], 49152)
    assert out.hidden.dtype == torch.float32
    answer = real_target.generate_greedy([ids[0].tolist()], 12, return_features=False)[0]
    assert "Paris" in tok.decode(answer["tokens"][ids.shape[1] :])


def test_real_speculative_equals_plain_greedy(real_target):
    """An untrained drafter on the real target: output still identical to plain greedy on MT-bench."""
    torch.manual_seed(0)
    drafter = build_drafter("parallelspec", {"num_mask_tokens": 4, "draft_vocab_size": 0}, real_target)
    rows = load_eval_prompts("mt_bench", limit=2)
    prompts = [prompt_ids(real_target.tokenizer, r["messages"]) for r in rows]
    r = evaluate_prompts(real_target, drafter, prompts, max_new_tokens=24, progress=False)
    assert r["greedy_equal"], r["mismatches"]
    assert r["tau"] >= 1.0
