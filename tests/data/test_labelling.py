"""Rows labelled by the frozen target: packed teacher-forced forwards, the run's own feature cache
(``data.feature_cache=auto``), the mix of self-distilled and dataset rows, a fixed held-out split and
``target.dtype=auto``.

Why: the drafter's labels and features come from this pass; a packed forward that leaks one row into the next,
a mix that loses conversations, or a held-out set that moves with the data size would each corrupt the
data-scaling curve without any error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafttrain.data.feature_cache import (
    packed_rows_features,
    rows_features,
    build_feature_cache,
    load_feature_cache,
    pack_rows,
    packed_inputs,
    packing_exact,
)
from drafttrain.data.pipeline import mix_rows, prepare_data, split_share
from drafttrain.data.sources import LoadStats


class _Acc:
    is_main_process = True

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()


def _rows(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


def test_pack_rows_keeps_every_row_once_within_the_budget():
    lengths = [30, 5, 17, 64, 9, 9, 40]
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    packs = pack_rows(lengths, order, 48)
    assert sorted(j for p in packs for j in p) == list(range(len(lengths)))
    assert all(sum(lengths[j] for j in p) <= 48 or len(p) == 1 for p in packs)
    assert [j for p in packs for j in p] == order  # packs keep the order
    assert any(len(p) > 1 for p in packs)


def test_packed_inputs_mask_is_block_diagonal_causal():
    ids, pos, mask = packed_inputs([[1, 2, 3], [4, 5]], torch.float32, "cpu")
    assert ids.tolist() == [[1, 2, 3, 4, 5]] and pos.tolist() == [[0, 1, 2, 0, 1]]
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def test_packed_labels_equal_a_separate_forward_per_row(tiny_target):
    """fp32: the packed forward's features and top-k logits equal each row's own forward (tight tolerance)."""
    rows = _rows(6, tiny_target.config.vocab_size)
    layers = (1, tiny_target.num_hidden_layers)
    packed = packed_rows_features(tiny_target, rows, "float16", 4, feature_layers=layers)
    for r, p in zip(rows, packed):
        with torch.no_grad():
            out = tiny_target.forward(torch.tensor([r]), with_logits=True, feature_layers=layers)
        want = out.features[0, : len(r) - 1].float()
        got = torch.from_numpy(p["features"].astype(np.float32))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.to(torch.float16).float(), rtol=2e-3, atol=2e-3)
        top = out.logits[0, : len(r) - 1].topk(4, dim=-1)
        assert np.array_equal(p["topk_ids"], top.indices.int().numpy())
        torch.testing.assert_close(torch.from_numpy(p["topk_logits"].astype(np.float32)), top.values.half().float(),
                                   rtol=2e-3, atol=2e-3)  # fmt: skip
    # and the padded batch of the same rows agrees with both
    padded = rows_features(tiny_target, rows, "float16", 0, feature_layers=layers)
    for a, b in zip(padded, packed):
        np.testing.assert_allclose(a["features"].astype(np.float32), b["features"].astype(np.float32), rtol=2e-3, atol=2e-3)


def test_a_leaking_mask_is_caught(tiny_target):
    """Mutation: without the block-diagonal mask (plain causal over the concatenation) the second row's labels change,
    so the equality above can fail."""
    rows = _rows(2, tiny_target.config.vocab_size, seed=3)
    flat = torch.tensor([rows[0] + rows[1]])
    with torch.no_grad():
        leaked = tiny_target.forward(flat, with_logits=False).hidden[0, len(rows[0]) :]
        alone = tiny_target.forward(torch.tensor([rows[1]]), with_logits=False).hidden[0]
    assert (leaked - alone).abs().max() > 1e-3


def test_packing_is_read_from_the_model(tiny_target):
    ok, why = packing_exact(tiny_target)
    assert ok, why
    from drafttrain.target import Target
    from drafttrain.target import tiny

    hybrid = Target(tiny.build("Qwen3_5ForCausalLM", vocab_size=256))
    ok, why = packing_exact(hybrid)
    assert not ok and "recurrent" in why


def test_packed_cache_equals_the_padded_cache(tiny_target, tmp_path):
    import datasets

    rows = _rows(12, tiny_target.config.vocab_size, seed=1)
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    a = build_feature_cache(tiny_target, ds, tmp_path / "padded", shard_size=5, progress=False)
    b = build_feature_cache(tiny_target, ds, tmp_path / "packed", shard_size=5, progress=False, pack_tokens=64)
    assert b["pack_tokens"] == 64 and "pack_tokens" not in a
    ca, cb = load_feature_cache(tmp_path / "padded"), load_feature_cache(tmp_path / "packed")
    for x, y in zip(ca.with_format("numpy")["features"], cb.with_format("numpy")["features"]):
        np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=2e-3, atol=2e-3)


def _cfg(tmp_path, **data):
    from drafttrain.validation import validate

    return validate({"target": {"random_init": True}, "trainer": {"progress": False},
                     "data": {"source": "sharegpt", "self_distill": False, "first_turn_only": False, "max_length": 128,
                              "heldout": 4, "cache_dir": str(tmp_path), **data}})  # fmt: skip


def test_feature_cache_auto_labels_once_and_reuses(tiny_target, tmp_path, monkeypatch):
    c = _cfg(tmp_path, max_conversations=20, features="cache", feature_cache="auto")
    train, held = prepare_data(c, tiny_target, _Acc())
    assert {"input_ids", "loss_mask", "features"} <= set(train.column_names)
    d = tiny_target.config.hidden_size
    row = train[0]
    assert row["features"].shape == (len(row["input_ids"]) - 1, d)
    with torch.no_grad():  # the stored features are the target's own (bf16 storage)
        want = tiny_target.forward(row["input_ids"][None].long(), with_logits=False).hidden[0, :-1]
    got = row["features"].to(torch.int16).view(torch.bfloat16).float()
    torch.testing.assert_close(got, want.bfloat16().float(), rtol=1e-2, atol=1e-2)
    import drafttrain.data.feature_cache as fc

    def no_forward(*a, **k):
        raise AssertionError("the labelled rows were labelled again")

    monkeypatch.setattr(fc, "rows_features", no_forward)
    prepare_data(c, tiny_target, _Acc())  # a second run finds every shard done (nothing relabelled)
    folders = list((tmp_path / "features").iterdir())
    assert len(folders) == 1 and (folders[0] / "feature_cache.json").is_file()


def test_heldout_head_is_the_same_rows_whatever_the_size(tiny_target, tmp_path):
    small = prepare_data(_cfg(tmp_path, max_conversations=12, heldout_split="head"), tiny_target, _Acc())[1]
    large = prepare_data(_cfg(tmp_path, max_conversations=30, heldout_split="head"), tiny_target, _Acc())[1]
    assert [r["input_ids"].tolist() for r in small] == [r["input_ids"].tolist() for r in large]
    rnd_small = prepare_data(_cfg(tmp_path, max_conversations=12), tiny_target, _Acc())[1]
    rnd_large = prepare_data(_cfg(tmp_path, max_conversations=30), tiny_target, _Acc())[1]
    assert [r["input_ids"].tolist() for r in rnd_small] != [r["input_ids"].tolist() for r in rnd_large]


def test_split_share_is_per_conversation_and_stable():
    convs = [{"id": f"c{i}", "messages": []} for i in range(400)]
    sd, raw = split_share(convs, 0.25)
    assert len(sd) + len(raw) == 400 and 60 < len(raw) < 140
    sd2, raw2 = split_share(convs[:200], 0.25)
    assert {c["id"] for c in raw2} == {c["id"] for c in raw if int(c["id"][1:]) < 200}
    assert split_share(convs, 0.0)[1] == [] and split_share(convs, 1.0)[0] == []


def test_mix_counts_add_up_and_refuse_a_loss():
    import datasets

    sd = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 5, "loss_mask": [[0, 1, 1]] * 5, "features": [[0.0]] * 5})
    raw = datasets.Dataset.from_dict({"id": ["a"] * 3, "input_ids": [[4, 5]] * 3, "loss_mask": [[0, 1]] * 3})
    stats = LoadStats(name="x")
    stats.skipped["too long"] = 2
    report = {"generated": 5, "skipped": 1, "failed": 1, "budget_cut": 0}
    ds, mix = mix_rows(sd, raw, report, stats, n_input=12)
    assert mix == {"input": 12, "self_distilled": 5, "dataset": 3, "skipped": 4} and len(ds) == 8
    assert ds.column_names == ["input_ids", "loss_mask"]
    with pytest.raises(RuntimeError, match="lost count"):
        mix_rows(sd, raw, report, stats, n_input=13)


@pytest.mark.slow
def test_prepare_data_mixes_self_distilled_and_dataset_rows(tiny_target, tmp_path):
    reports = {}
    c = _cfg(tmp_path, max_conversations=16, self_distill=True, dataset_share=0.5, first_turn_only=True, heldout=0,
             generation={"max_new_tokens": 4, "batch_size": 8}, self_distill_minutes=None)  # fmt: skip
    train, held = prepare_data(c, tiny_target, _Acc(), reports=reports)
    mix = reports["mix"]
    assert mix["self_distilled"] + mix["dataset"] + mix["skipped"] == mix["input"] == 16
    assert mix["self_distilled"] > 0 and mix["dataset"] > 0 and len(train) == mix["self_distilled"] + mix["dataset"]
    assert "features" not in train.column_names  # one features source for every row (live here)
    again = {}
    prepare_data(c, tiny_target, _Acc(), reports=again)  # resumes: the same rows, the same counts
    assert again["mix"] == mix


def test_target_dtype_auto_follows_the_host(monkeypatch):
    from drafttrain import host
    from drafttrain.target.model import resolve_dtype

    for forced, want in (("1", "bfloat16"), ("0", "float32")):
        monkeypatch.setenv("DRAFTTRAIN_NATIVE_BF16", forced)
        host.native_cpu_bf16.cache_clear()
        assert resolve_dtype("auto", "cpu") == want
    host.native_cpu_bf16.cache_clear()
    assert resolve_dtype("float16", "cpu") == "float16"
    from drafttrain.validation import validate

    assert validate({"target": {"dtype": "auto"}}).target.dtype == "auto"
    with pytest.raises(Exception, match="target.dtype must be"):
        validate({"target": {"dtype": "fp8"}})


def test_config_errors_name_the_key():
    from drafttrain.validation import validate

    for data, msg in (({"feature_cache": "auto"}, "add data.features=cache"),
                      ({"heldout_split": "tail"}, "data.heldout_split must be"),
                      ({"dataset_share": 1.5}, "data.dataset_share must be"),
                      ({"dataset_share": 0.5, "self_distill": False}, "needs data.self_distill=true"),
                      ({"pack_tokens": -1}, "data.pack_tokens must be")):  # fmt: skip
        with pytest.raises(Exception, match=msg):
            validate({"data": data})
