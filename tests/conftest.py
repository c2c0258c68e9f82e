"""Shared fixtures: one tiny random target per test session (loading it costs a few seconds).

The tiny target (2 layers, d = 64) shares the real SmolLM2 tokenizer (vocab 49152) from the
converted model folder in the default cache; ``DRAFTTRAIN_CACHE`` is left as it is.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
# The models here are tiny: one intra-op thread is fastest, and on a shared 2-core machine the default
# (one thread per core) spins against other processes and is ~40x slower.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests skip where torch sees no CUDA device (scripts/device_check.sh runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bash scripts/device_check.sh runs it on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target():
    """The frozen tiny random target (deterministic from TargetConfig.seed)."""
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target
    from helpers import need_input

    # the tokenizer comes from the packaged model: missing -> fail with the install command, never skip
    return need_input(lambda: load_target(TargetConfig(random_init=True)))


@pytest.fixture(scope="session")
def make_drafter(tiny_target):
    """Factory: ``make_drafter(seed=0, **config)`` -> a fresh ParallelSpec drafter on the tiny target.

    Default config: K = 3, every candidate an anchor, fresh layer init (not a copy of the target's).
    """
    from drafttrain.drafters import build_drafter

    def make(seed: int = 0, **config):
        cfg = {"num_mask_tokens": 3, "anchor_ratio": 1.0, "init_from_target_layer": False, **config}
        torch.manual_seed(seed)
        return build_drafter("parallelspec", cfg, tiny_target)

    return make


@pytest.fixture(scope="session")
def varied_target(tiny_target):
    """The tiny target with its 2-D weights redrawn (std 0.3): its greedy continuations change at every
    step (the tiny target as loaded repeats one token, which cannot catch an off-by-one)."""
    import copy

    from drafttrain.target import Target

    model = copy.deepcopy(tiny_target.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # embeddings (tied LM head) and linear weights; norms stay 1
                p.normal_(0.0, 0.3, generator=g)
    return Target(model, tiny_target.tokenizer)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tiny_target, make_drafter):
    """A training-run-like folder for the tiny target: drafter/ (save_pretrained) + config.json naming it.
    The drafter's layer is the target's last layer, so it accepts a fair share of drafts."""
    import json

    run = tmp_path_factory.mktemp("run")
    drafter = make_drafter(seed=0)
    drafter.layer.load_state_dict(tiny_target.last_layer.state_dict())
    drafter.save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "tiny"}}))
    return run
