"""The self-distillation time budget (``data.self_distill_minutes``) on the tiny target.

Why: the main job promises its wall time on every host kind; on a slow host self-distillation keeps the shards
its measured speed fits. The kept rows must be a prefix of a fixed order, the decision recorded with the job,
so that a rerun or a resumed run neither duplicates nor drops a row, and a fast host must lose nothing.
"""

from __future__ import annotations

import pytest

from drafttrain.config import GenerationConfig, TrainConfig
from drafttrain.data import selfdistill
from drafttrain.data.selfdistill import budget_shards, generate_dataset, plan_conversations, spread_order

CONVS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": "word " * (1 + (7 * i) % 11) + str(i)},
                                 {"role": "assistant", "content": "ok"}]}
    for i in range(15)
]  # fmt: skip
GEN = GenerationConfig(max_new_tokens=5, max_length=256, batch_size=2, shard_size=2, max_turns=1)


def test_spread_order_literal_and_a_permutation():
    assert spread_order(11) == [0, 8, 4, 2, 10, 6, 1, 9, 5, 3, 7]
    assert spread_order(0) == [] and spread_order(1) == [0] and spread_order(2) == [0, 1]
    for n in range(1, 70):
        order = spread_order(n)
        assert sorted(order) == list(range(n))
        assert max(order[:2]) >= (n - 1) // 2  # the two probe shards: the shortest prompts and a middle or later one
    with pytest.raises(ValueError):
        spread_order(-1)


def test_budget_shards_literal():
    assert budget_shards([4, 4, 4, 4], 2.5, 35) == 3  # 30 s fits, 40 s does not
    assert budget_shards([4, 4, 4, 4], 2.5, 40) == 4
    assert budget_shards([4, 4, 4, 4], 2.5, 1e9) == 4  # never more than there are
    assert budget_shards([4, 4, 4, 4], 100.0, 35) == 2  # the probe shards are generated already: kept
    assert budget_shards([4, 4, 4, 4], 100.0, 35, probe=1) == 1
    assert budget_shards([], 1.0, 10) == 0


def _shards_in_spread_order(target, gen) -> list[list[int]]:
    """The input indices of each shard, in generation order (the layout generate_dataset documents)."""
    plans, _ = plan_conversations(target.tokenizer, CONVS, gen)
    by_length = sorted(plans, key=lambda p: (len(p.turns[0].glue), p.index))
    shards = [[p.index for p in by_length[i : i + gen.shard_size]] for i in range(0, len(by_length), gen.shard_size)]
    return [shards[i] for i in spread_order(len(shards))]


def _rows(ds) -> dict[int, dict]:
    return {r["index"]: r for r in ds.with_format(None).to_list()}


def test_a_slow_hosts_probe_keeps_a_recorded_prefix(tiny_target, tmp_path, monkeypatch):
    full, full_report = generate_dataset(tiny_target, CONVS, tmp_path / "full", GEN, progress=False)
    assert full_report["generated"] == 15 and "budget" not in full_report
    # a slow host: 10 generated tokens/s, 50 tokens per conversation -> 5 s per conversation, 2 per shard
    monkeypatch.setattr(selfdistill, "measure_speed", lambda store, shards: (10.0, 50.0))
    ds, report = generate_dataset(tiny_target, CONVS, tmp_path / "slow", GEN, progress=False, budget_seconds=30)
    b = report["budget"]
    assert (b["shards"], b["shards_total"], b["conversations"], b["conversations_total"]) == (3, 8, 6, 15)  # 3 x 10 s
    assert b["estimated_seconds"] == 75.0 and b["probe_shards"] == 2
    assert report["budget_cut"] == 9 and report["generated"] + report["skipped"] + report["failed"] + 9 == 15
    kept = sorted(i for shard in _shards_in_spread_order(tiny_target, GEN)[:3] for i in shard)
    assert list(ds["index"]) == kept  # the first 3 shards of the spread order, rows in input order
    assert all(_rows(ds)[i] == _rows(full)[i] for i in kept)  # the same rows a full run makes
    lengths = [len(CONVS[i]["messages"][0]["content"]) for i in kept]
    assert max(lengths) > min(lengths) + 20  # not only the shortest prompts

    # a rerun on a fast host keeps the recorded decision: nothing generated, the same rows
    monkeypatch.setattr(selfdistill, "measure_speed", lambda store, shards: (1e6, 50.0))
    again, report2 = generate_dataset(tiny_target, CONVS, tmp_path / "slow", GEN, progress=False, budget_seconds=30)
    assert again.with_format(None).to_list() == ds.with_format(None).to_list()
    assert report2["this_run"]["generated_tokens"] == 0 and report2["budget"]["shards"] == 3
    # another budget: the recorded speed decides it again (40 s -> 4 shards), the 3 done are not made again
    more, report3 = generate_dataset(tiny_target, CONVS, tmp_path / "slow", GEN, progress=False, budget_seconds=40)
    assert report3["budget"]["shards"] == 4 and len(more) == 8
    assert set(ds["index"]) < set(more["index"]) and 0 < report3["this_run"]["generated_tokens"]
    # no budget: every shard, equal to the full run
    rest, _ = generate_dataset(tiny_target, CONVS, tmp_path / "slow", GEN, progress=False)
    assert rest.with_format(None).to_list() == full.with_format(None).to_list()


def test_a_fast_host_keeps_every_row(tiny_target, tmp_path, monkeypatch):
    full, _ = generate_dataset(tiny_target, CONVS, tmp_path / "full", GEN, progress=False)
    monkeypatch.setattr(selfdistill, "measure_speed", lambda store, shards: (1000.0, 5.0))
    ds, report = generate_dataset(tiny_target, CONVS, tmp_path / "fast", GEN, progress=False, budget_seconds=30)
    assert report["budget_cut"] == 0 and report["budget"]["shards"] == report["budget"]["shards_total"] == 8
    assert ds.with_format(None).to_list() == full.with_format(None).to_list()


def test_a_resumed_budgeted_run_equals_an_uninterrupted_one(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(selfdistill, "measure_speed", lambda store, shards: (10.0, 50.0))
    whole, _ = generate_dataset(tiny_target, CONVS, tmp_path / "whole", GEN, progress=False, budget_seconds=30)
    real, calls = selfdistill.generate_shard, []

    def crash_after_probe(*args, **kwargs):
        if len(calls) == 2:  # the probe shards are written and the budget decided, then a crash
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(selfdistill, "generate_shard", crash_after_probe)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(tiny_target, CONVS, tmp_path / "resumed", GEN, progress=False, budget_seconds=30)
    monkeypatch.setattr(selfdistill, "generate_shard", real)
    monkeypatch.setattr(selfdistill, "measure_speed", lambda store, shards: (1e6, 50.0))  # another speed: not asked again
    resumed, report = generate_dataset(tiny_target, CONVS, tmp_path / "resumed", GEN, progress=False, budget_seconds=30)
    assert resumed.with_format(None).to_list() == whole.with_format(None).to_list()
    assert report["budget"]["shards"] == 3 and report["this_run"]["generated_tokens"] > 0  # one shard made now


def test_budget_line_names_what_was_cut():
    from drafttrain.train import budget_line

    c = TrainConfig()
    assert budget_line({"step": 800, "stopped_by_time_budget": False}, c) is None
    line = budget_line({"step": 353, "stopped_by_time_budget": True, "data_cut_by_time_budget": {
        "conversations": 448, "of": 690, "generated_tokens_per_s": 95.0, "budget_minutes": 11.0}}, c)
    assert "kept 448 of 690 conversations" in line and "95.0 generated tokens/s" in line
    assert "self_distill_minutes=11" in line and "step 353 of 800 (trainer.max_minutes=15)" in line
