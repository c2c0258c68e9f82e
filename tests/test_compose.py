"""build_run: the one way train, eval, export and the scripts build a run's target, drafter and engines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import need_input

from drafttrain.compose import Run, build_run, drafter_dir, target_config
from drafttrain.config import TargetConfig

TINY = TargetConfig(random_init=True)


def test_target_config_reads_a_run_config_and_applies_overrides():
    run_cfg = SimpleNamespace(target=TINY)  # any config with a TargetConfig `target` (TrainConfig, EvalConfig, ...)
    assert target_config(run_cfg) is TINY
    got = target_config(run_cfg, dtype="bfloat16", fast_linear="off")
    assert (got.dtype, got.fast_linear, got.random_init) == ("bfloat16", "off", True)
    assert (TINY.dtype, TINY.fast_linear) == ("float32", "auto")  # the caller's config is left as it was
    with pytest.raises(TypeError, match="TargetConfig"):
        target_config({"target": {"path": "x"}})


def test_build_run_builds_the_target_as_configured_and_an_engine_on_it(tiny_target):
    from drafttrain.target import fastlinear
    from drafttrain.verify.proposers import PlainProposer

    off = need_input(lambda: build_run(SimpleNamespace(target=TINY), fast_linear="off"))
    assert isinstance(off, Run) and off.drafter is None
    assert fastlinear.backend_of(off.target.model) is None  # fast_linear=off: nothing packed
    assert off.target.model.dtype == torch.float32 and off.target.device.type == "cpu"
    # the same weights as the target load_target builds from the same config (the suite's tiny target)
    for (name, p), (_, q) in zip(off.target.model.state_dict().items(), tiny_target.model.state_dict().items()):
        assert torch.equal(p, q), name
    eng = off.engine(batch_size=1, max_new_tokens=4, stop_token_ids=-1)
    assert isinstance(eng.proposer, PlainProposer)  # no drafter: plain decoding
    out = eng.run([[5, 6, 7]]).results[0].tokens
    want = off.target.generate([[5, 6, 7]], 4, stop_token_ids=-1, return_features=False)[0]["tokens"][3:]
    assert list(out) == want and len(want) == 4  # the engine decodes plainly what the target generates


def test_build_run_loads_a_saved_drafter_or_seeds_a_fresh_one(tiny_target, tmp_path):
    fresh = build_run(None, target=tiny_target, untrained_drafter={"num_mask_tokens": 2}, seed=3, pack=False)
    again = build_run(None, target=tiny_target, untrained_drafter={"num_mask_tokens": 2}, seed=3, pack=False)
    assert fresh.target is tiny_target and not fresh.drafter.training
    assert all(torch.equal(a, b) for a, b in zip(fresh.drafter.state_dict().values(), again.drafter.state_dict().values()))
    fresh.drafter.save_pretrained(tmp_path / "drafter")  # a training run folder holds drafter/
    assert drafter_dir(tmp_path) == tmp_path / "drafter" and drafter_dir(tmp_path / "drafter") == tmp_path / "drafter"
    loaded = build_run(None, target=tiny_target, drafter=tmp_path, pack=False)
    assert all(torch.equal(a, b) for a, b in zip(loaded.drafter.state_dict().values(), fresh.drafter.state_dict().values()))
    assert type(loaded.engine(batch_size=1).proposer).__name__ != "PlainProposer"  # the drafter's own proposer
    with pytest.raises(FileNotFoundError, match="no drafter checkpoint in"):
        build_run(None, target=tiny_target, drafter=tmp_path / "empty")
