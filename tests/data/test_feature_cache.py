"""Tests of the offline feature cache (drafttrain.data.feature_cache) and of training reading it.

Why: a cache that drifted from the live target, or that silently belonged to another dataset, would
train every drafter on wrong features with no error anywhere.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch

from drafttrain.config import GenerationConfig, TrainConfig
from drafttrain.data.feature_cache import (
    SCHEMA_VERSION,
    FeatureCacheError,
    attach_feature_cache,
    build_feature_cache,
    estimate_bytes,
    folder_bytes,
    load_feature_cache,
)
from drafttrain.data.selfdistill import generate_dataset, load_generated
from drafttrain.data.batches import get_batch
from drafttrain.data.pipeline import prepare_data

CONVS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "a"}]}
    for i, q in enumerate(["What is 2+2?", "Hi", "tell me a story", "Write a poem about the sea", "x", "why?",
                           "Name three colours", "Explain gravity to a child in one sentence"])
]  # fmt: skip


@pytest.fixture(scope="module")
def generated(tiny_target, tmp_path_factory):
    """A generated dataset (8 rows of different lengths, no stored features) and its folder."""
    root = tmp_path_factory.mktemp("gen")
    gen = GenerationConfig(max_new_tokens=10, max_length=256, batch_size=4)
    generate_dataset(tiny_target, CONVS, root, gen, progress=False)
    return root, load_generated(root)


@pytest.fixture(scope="module")
def cache16(tiny_target, generated, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "fp16"
    from drafttrain.config import TargetConfig
    from drafttrain.fingerprint import target_fingerprint

    meta = build_feature_cache(tiny_target, generated[1], out, dtype="float16", top_k=4, batch_size=3, shard_size=3,
                               progress=False, target_fingerprint=target_fingerprint(TargetConfig(random_init=True)))
    return out, meta


def test_estimate_is_within_5_percent_of_the_bytes_written(tiny_target, generated, cache16, tmp_path):
    out, meta = cache16
    assert meta["bytes_written"] == folder_bytes(out)
    assert abs(meta["bytes_written"] - meta["bytes_estimated"]) <= 0.05 * meta["bytes_written"]
    lengths = [len(x) for x in generated[1]["input_ids"]]
    assert meta["bytes_estimated"] == estimate_bytes(lengths, 64, 4, 3)
    bf = build_feature_cache(tiny_target, generated[1], tmp_path / "bf16", dtype="bfloat16", shard_size=8, progress=False)
    assert abs(bf["bytes_written"] - bf["bytes_estimated"]) <= 0.05 * bf["bytes_written"]


def test_cached_features_and_topk_equal_a_full_forward(tiny_target, generated, cache16):
    ds = generated[1]
    cache = load_feature_cache(cache16[0], ds).with_format("torch")
    assert json.loads((cache16[0] / "feature_cache.json").read_text())["schema_version"] == SCHEMA_VERSION
    for i in range(len(ds)):
        ids = torch.tensor(ds[i]["input_ids"])
        f = tiny_target.features(ids[None])[0, :-1]  # [L-1, d]
        row = cache[i]
        torch.testing.assert_close(row["features"], f, atol=1e-2, rtol=1e-3)  # fp16 storage
        logits = tiny_target.lm_head(f)  # [L-1, v]
        vals = logits.topk(4, dim=-1).values
        torch.testing.assert_close(row["topk_logits"], vals, atol=1e-2, rtol=1e-3)  # the 4 best, best first
        # the stored ids are the tokens of those logits (robust to near-ties swapping places)
        torch.testing.assert_close(logits.gather(-1, row["topk_ids"].long()), row["topk_logits"], atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("dtype,rtol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_training_step_on_cached_features_equals_live(tiny_target, make_drafter, generated, tmp_path, dtype, rtol):
    """The loss and gradients of a training step on cached features equal those on live target features,
    within the storage dtype's rounding (fp16: 11-bit mantissa, bf16: 8-bit)."""
    ds = generated[1]
    out = tmp_path / dtype
    build_feature_cache(tiny_target, ds, out, dtype=dtype, batch_size=8, shard_size=8, progress=False)
    live = ds.select_columns(["input_ids", "loss_mask"]).with_format("torch")
    cached = attach_feature_cache(ds, out).select_columns(["input_ids", "loss_mask", "features"]).with_format("torch")
    idx = [0, 3, 5, 7]
    b_live = get_batch(live, tiny_target, idx, "cpu")
    b_cache = get_batch(cached, tiny_target, idx, "cpu")
    assert torch.equal(b_live["input_ids"], b_cache["input_ids"])
    real = b_live["lengths"][:, None] - 1 > torch.arange(b_live["features"].shape[1])[None]  # [b, L-1] non-padding
    torch.testing.assert_close(b_cache["features"][real], b_live["features"][real], atol=0.05, rtol=rtol)

    losses, grads = [], []
    for batch in (b_live, b_cache):
        drafter = make_drafter(seed=0, kd_weight=0.5)
        out_ = drafter(batch, torch.Generator().manual_seed(0))
        out_.loss.backward()
        losses.append(float(out_.loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=rtol)
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 10 * rtol


class _Acc:
    """The part of an Accelerator prepare_data uses (one process)."""

    is_main_process = True

    def main_process_first(self):
        return contextlib.nullcontext()


def test_prepare_data_reads_generated_dataset_and_cache(tiny_target, generated, cache16):
    root, ds = generated
    base = {"target": {"random_init": True}, "trainer": {"progress": False},
            "data": {"source": "generated", "path": str(root), "heldout": 2}}  # fmt: skip
    from drafttrain.validation import validate

    c = validate(base)
    train, held = prepare_data(c, tiny_target, _Acc())
    assert len(train) + len(held) == len(ds) and "features" not in train.column_names  # live features
    c = validate({**base, "data": {**base["data"], "features": "cache", "feature_cache": str(cache16[0])}})
    train, held = prepare_data(c, tiny_target, _Acc())
    assert set(train.column_names) == {"input_ids", "loss_mask", "features"}
    rows = {tuple(r["input_ids"].tolist()): r for r in list(train) + list(held)}
    cache = load_feature_cache(cache16[0]).with_format("torch")
    for i in range(len(ds)):
        assert torch.equal(rows[tuple(ds[i]["input_ids"])]["features"], cache[i]["features"])
    # data.max_length cuts rows; rows left without an answer token are dropped, never trained on
    cut = sorted(ds["num_prompt"])[4] + 2
    c = validate({**base, "data": {**base["data"], "max_length": cut, "heldout": 0}})
    train, held = prepare_data(c, tiny_target, _Acc())
    assert held is None and 5 <= len(train) < len(ds)
    assert max(len(r["input_ids"]) for r in train) <= cut
    assert all(r["loss_mask"].sum() > 0 for r in train)
    with pytest.raises(Exception, match="features=cache needs"):
        validate({**base, "data": {**base["data"], "features": "cache"}})
    assert isinstance(c, TrainConfig)


def test_cache_resumes_and_refuses_other_datasets(tiny_target, generated, cache16, tmp_path, monkeypatch):
    from drafttrain.data import feature_cache
    from drafttrain.data.shards import JobMismatchError

    ds = generated[1]
    real, calls = feature_cache.rows_features, []

    def crash_after_two(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(feature_cache, "rows_features", crash_after_two)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(tiny_target, ds, out, top_k=4, batch_size=3, shard_size=3, progress=False)
    with pytest.raises(FeatureCacheError, match="no finished feature cache"):
        load_feature_cache(out)
    monkeypatch.setattr(feature_cache, "rows_features", real)
    build_feature_cache(tiny_target, ds, out, top_k=4, batch_size=3, shard_size=3, progress=False)
    assert load_feature_cache(out).to_list() == load_feature_cache(cache16[0]).to_list()

    other = ds.select([1, 0, *range(2, len(ds))])  # same rows, another order
    with pytest.raises(FeatureCacheError, match="another dataset"):
        attach_feature_cache(other, out)
    with pytest.raises(JobMismatchError):
        build_feature_cache(tiny_target, other, out, top_k=4, batch_size=3, shard_size=3, progress=False)
    meta = json.loads((out / "feature_cache.json").read_text())
    (out / "feature_cache.json").write_text(json.dumps({**meta, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(FeatureCacheError, match="schema version"):
        load_feature_cache(out, ds)


def test_cache_of_declared_layers_holds_them_and_refuses_other_layers(tiny_target, generated, cache16, tmp_path):
    """A drafter that declares target layers (1, 2) gets exactly those hidden states, concatenated [L-1, 2d]
    (HF ``output_hidden_states[1]`` then ``[2]``); ``--estimate`` counts both; a cache of other layers, or an
    older cache without recorded layers (= the final state), is refused for it with a message naming both."""
    ds = generated[1]
    out = tmp_path / "layers12"
    meta = build_feature_cache(tiny_target, ds, out, feature_layers=[1, -1], batch_size=4, shard_size=8, progress=False)
    assert meta["feature_layers"] == [1, 2] and meta["num_hidden_layers"] == 2
    lengths = [len(x) for x in ds["input_ids"]]
    assert meta["bytes_estimated"] == estimate_bytes(lengths, 64, 0, 8, num_layers=2)
    assert meta["bytes_estimated"] > estimate_bytes(lengths, 64, 0, 8) * 1.9
    assert abs(meta["bytes_written"] - meta["bytes_estimated"]) <= 0.05 * meta["bytes_written"]
    cache = load_feature_cache(out, ds, feature_layers=(1, 2), num_hidden_layers=2).with_format("torch")
    for i in range(len(ds)):
        ids = torch.tensor(ds[i]["input_ids"])
        hs = tiny_target.model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[1], hs[2]], dim=-1)[0, :-1]  # [L-1, 2d]
        torch.testing.assert_close(cache[i]["features"], want, atol=1e-2, rtol=1e-3)
    with pytest.raises(FeatureCacheError, match=r"layers \[1, 2\].*reads layers \[2\]"):
        attach_feature_cache(ds, out, feature_layers=None, num_hidden_layers=2)
    with pytest.raises(FeatureCacheError, match=r"layers \[2\].*reads layers \[1, 2\]"):  # cache16: the final state
        attach_feature_cache(ds, cache16[0], feature_layers=[1, 2], num_hidden_layers=2)
    old = tmp_path / "old"
    shutil.copytree(cache16[0], old)
    meta16 = json.loads((old / "feature_cache.json").read_text())
    meta16.pop("feature_layers"), meta16.pop("num_hidden_layers")  # a cache written before layers were recorded
    (old / "feature_cache.json").write_text(json.dumps(meta16))
    assert len(load_feature_cache(old, ds, feature_layers=[-1], num_hidden_layers=2)) == len(ds)  # = the final state
    with pytest.raises(FeatureCacheError, match=r"layers \[2\].*reads layers \[1, 2\]"):
        load_feature_cache(old, ds, feature_layers=[1, 2], num_hidden_layers=2)
