"""Generation through the engine (drafttrain/generation/engine.py) against Target.generate: same tokens, same features."""

from __future__ import annotations

import pytest
import torch

from drafttrain.generation.engine import engine_generate


def _prompts(lengths=(3, 11, 30, 7, 19)):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("batch_size", [2, 5])
def test_engine_generate_equals_target_generate(varied_target, batch_size):
    """Tokens, finish reasons and every feature row match the HF-cache generator; per-prompt caps hold;
    batch 2 < 5 prompts exercises continuous batching (rows refilled as sequences finish)."""
    prompts = _prompts()
    caps = [9, 4, 12, 1, 7]
    ref = varied_target.generate(prompts, caps, stop_token_ids=-1)
    out = engine_generate(varied_target, prompts, caps, stop_token_ids=-1, batch_size=batch_size)
    for r, o, p, cap in zip(ref, out, prompts, caps):
        assert o["tokens"] == r["tokens"] and len(o["tokens"]) == len(p) + cap
        assert o["finish_reason"] == r["finish_reason"] == "length"
        assert o["features"].shape == r["features"].shape == (len(p) + cap - 1, varied_target.config.hidden_size)
        torch.testing.assert_close(o["features"], r["features"].float(), atol=1e-4, rtol=1e-4)


def test_stops_and_feature_layers(varied_target):
    """A stop token ends a row (also when it is the very first generated token); several layers concatenated."""
    prompts = _prompts()
    free = varied_target.generate(prompts, 10, stop_token_ids=-1, return_features=False)
    stop = free[2]["tokens"][len(prompts[2]) + 3]  # row 2's 4th token
    first = free[0]["tokens"][len(prompts[0])]  # row 0's first token
    stops = [stop, first]
    ref = varied_target.generate(prompts, 10, stop_token_ids=stops, feature_layers=(1, -1))
    out = engine_generate(varied_target, prompts, 10, stop_token_ids=stops, feature_layers=(1, -1), batch_size=3)
    assert out[0]["tokens"] == prompts[0] + [first] and out[0]["finish_reason"] == "stop"
    assert out[0]["features"].shape[0] == len(prompts[0])  # the prompt's features only
    for r, o in zip(ref, out):
        assert o["tokens"] == r["tokens"] and o["finish_reason"] == r["finish_reason"]
        assert o["features"].shape[1] == 2 * varied_target.config.hidden_size
        torch.testing.assert_close(o["features"], r["features"].float(), atol=1e-4, rtol=1e-4)
    plain = engine_generate(varied_target, prompts, 10, stop_token_ids=stops, return_features=False)
    assert [o["tokens"] for o in plain] == [r["tokens"] for r in ref] and "features" not in plain[0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine_generate(varied_target, prompts, [3, 0, 1, 1, 1])
