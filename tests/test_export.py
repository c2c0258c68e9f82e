"""Export to serving-engine folders (drafttrain.export, scripts.export): the exported folder read back by
our own loader gives the same draft logits, every tensor written is one the engine's loader consumes
(engines skip unknown names silently), configs validate against the speculators package where it is
installed, and vLLM itself (a second venv, scripts/install_vllm.sh) runs an exported drafter losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafttrain.drafters import build_drafter
from drafttrain.export import ExportError, export_drafter, formats_for, load_exported, resolve_format
from drafttrain.export.common import draft_token_ids, load_tensors


def _randomise(drafter, seed: int = 0):
    """Redraw every float parameter (trained-looking weights: biases non-zero, heads not the target's rows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 and p.numel() > 1 else 0.0))
    return drafter


def _vocab(drafter, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(drafter.vocab_size, generator=g)[:n]
    drafter.set_draft_vocab(ids)
    return ids


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, tiny_target):
    """The tiny random target saved as an HF folder (model + tokenizer): what an engine loads."""
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_target.model.save_pretrained(d)
    tiny_target.tokenizer.save_pretrained(d)
    return d


# -- format selection -------------------------------------------------------------------------
def test_formats_per_recipe():
    assert formats_for("medusa") == ["vllm_medusa"]
    assert formats_for("eagle") == ["vllm_eagle"]
    assert formats_for("eagle3")[0] == "speculators" and "sglang" in formats_for("eagle3")
    assert resolve_format("medusa", None) == "vllm_medusa"


@pytest.mark.parametrize("recipe", ["parallelspec", "parallelspec_eagle"])
def test_recipe_without_engine_format_fails_listing_formats(recipe):
    with pytest.raises(ExportError) as e:
        resolve_format(recipe, None)
    for fmt in ("speculators", "sglang", "vllm_medusa", "vllm_eagle"):
        assert fmt in str(e.value)


def test_wrong_format_for_recipe_fails():
    with pytest.raises(ExportError, match="does not write 'medusa'"):
        resolve_format("medusa", "speculators")
    with pytest.raises(ExportError, match="unknown export format"):
        resolve_format("medusa", "trtllm")


# -- Medusa -> vLLM ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_vocab", [0, 300])
def test_medusa_roundtrip_identical_logits(tiny_target, tmp_path, n_vocab):
    from drafttrain.export.medusa import vllm_consumed_names

    torch.manual_seed(0)
    drafter = build_drafter("medusa", {"num_heads": 3, "draft_vocab_size": n_vocab}, tiny_target)
    if n_vocab:
        ids = _vocab(drafter, n_vocab)
    _randomise(drafter)
    fmt, cfg = export_drafter(drafter, None, tmp_path)
    assert fmt == "vllm_medusa" and cfg["medusa_fc_bias"] is True  # vLLM drops c_k without it
    written = set(load_tensors(tmp_path / "model.safetensors"))
    assert written == vllm_consumed_names(3, 1, True, truncated=bool(n_vocab))
    if n_vocab:  # vLLM's token_map = absolute target ids of the head rows
        assert cfg["truncated_vocab_size"] == n_vocab < cfg["vocab_size"]
        assert torch.equal(load_tensors(tmp_path / "model.safetensors")["token_map"], ids)
    back = load_exported(tmp_path, fmt, tiny_target)
    f = torch.randn(5, tiny_target.config.hidden_size)
    assert torch.equal(back.head_logits(f), drafter.head_logits(f))
    assert torch.equal(back.full_vocab_logits(back.head_logits(f)), drafter.full_vocab_logits(drafter.head_logits(f)))
    assert torch.equal(draft_token_ids(back), draft_token_ids(drafter))


# -- EAGLE(-1) -> vLLM ------------------------------------------------------------------------
def test_eagle_export_refuses_naming_each_difference(tiny_target, tmp_path):
    torch.manual_seed(0)
    drafter = _randomise(build_drafter("eagle", {}, tiny_target))
    with pytest.raises(ExportError) as e:
        export_drafter(drafter, "vllm_eagle", tmp_path)
    msg = str(e.value)
    assert "bias" in msg and "input RMSNorm" in msg and "final norm" in msg
    assert not (tmp_path / "model.safetensors").exists()
