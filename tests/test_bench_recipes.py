"""scripts.bench_recipes end to end on the tiny target: an equal-budget run, its full evaluation, the report."""

from __future__ import annotations

import json

import pytest


def test_budget_overrides_reach_the_run_and_later_overrides_win(tmp_path):
    from scripts.bench_recipes import COMMON, STEPS, train_command

    steps = train_command("eagle", tmp_path, [])
    assert all(o in steps for o in COMMON + STEPS)
    budget = train_command("eagle3", tmp_path, ["resume=true"], budget_minutes=40)
    assert "trainer.max_minutes=40" in budget and "trainer.save_every=100" in budget and "optim.decay_over=minutes" in budget
    assert "trainer.max_steps=180" not in budget and "trainer.spec_eval.num_prompts=0" in budget
    assert budget[-1] == "resume=true" and f"output_dir={tmp_path / 'eagle3'}" in budget


def test_bench_recipes_budget_run_full_eval_and_report(tmp_path, monkeypatch):
    """phase=train with budget_minutes, phase=eval eval_suite=full (MT-bench and GSM8K: tree, chain and
    batch-1, every output equal to plain greedy), a second eval that resumes without decoding, the report."""
    import drafttrain.train
    from scripts.bench_recipes import main

    root = tmp_path / "runs"
    tiny = json.dumps(["target=tiny", "data.max_conversations=24", "trainer.max_steps=3", "trainer.num_threads=1"])
    main(["phase=train", "recipe=eagle3", f"out_root={root}", "budget_minutes=5", f"overrides={tiny}"])
    final = json.loads((root / "eagle3" / "final_metrics.json").read_text())
    assert final["step"] == 3 and final["samples"] == 3 * 8 and final["train_rows"] > 0
    assert "eval/tau" not in final  # no in-run speculative evaluation under a budget
    launch = json.loads((root / "eagle3" / "bench_command.json").read_text())
    assert "trainer.max_minutes=5" in launch["argv"] and len(launch["launches"]) == 1

    ev = ["phase=eval", "recipe=eagle3", f"out_root={root}", "eval_suite=full", "eval_prompts=2",
          "eval_max_new_tokens=8", "latency_prompts=1"]  # fmt: skip
    main(ev)
    full = json.loads((root / "eagle3" / "eval_full.json").read_text())
    assert set(full) == {"mt_bench", "gsm8k"}
    for m in full.values():
        assert m["eval/greedy_equal"] is True
        assert m["eval/tau"] >= 1.0 and m["eval/tau_chain"] >= 1.0 and m["eval/speedup_b1"] > 0
        assert m["eval/latency_prompts"] == 1 and "sssd" not in m["eval/prompts"]
        assert m["eval/tree"] == "widths [4, 2, 1, 1, 1] budget 8"
    assert full["gsm8k"]["eval/prompts"].startswith("gsm8k ids ")

    def no_decode(*a, **k):
        raise AssertionError("an evaluated prompt set was decoded again")

    monkeypatch.setattr(drafttrain.train, "spec_eval", no_decode)
    main(ev)  # resumed: both sets read back

    dest = tmp_path / "eagle3"
    main(["phase=report", f"out_root={root}", f"dest={dest}", "recipes=[eagle,eagle3]"])  # eagle: no run, skipped
    md = dest.with_suffix(".md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| eagle3 | 5 (5 passes)"))
    assert f"| 3 ({24 / final['train_rows']:.1f}) |" in row
    assert "MT-bench τ (= greedy)" not in md  # no in-run evaluation columns for budget runs
    assert f"the same in every run ({final['train_data_sha']})" in md
    full_row = [line for line in md.splitlines() if line.startswith("| eagle3 | ") and line.endswith("| yes |")]
    assert len(full_row) == 1 and f"{full['mt_bench']['eval/tau']:.3f}" in full_row[0]
    data = json.loads(dest.with_suffix(".json").read_text())
    assert [r["recipe"] for r in data["runs"]] == ["eagle3"]


@pytest.mark.parametrize("bad", ["eval_suite=tree", "budget_minutes=0", "recipes=[eagle4]"])
def test_bench_recipes_bad_keys_fail_before_work(bad):
    from drafttrain.cliconfig import ConfigError
    from scripts.bench_recipes import main

    with pytest.raises(ConfigError):
        main(["phase=report", bad])


def test_data_fingerprint_reads_tokens_not_features():
    from datasets import Dataset

    from drafttrain.train import data_fingerprint

    rows = {"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]}
    a = Dataset.from_dict(rows)
    b = Dataset.from_dict({**rows, "features": [[[0.5]] * 3, [[0.1]] * 2]})
    assert data_fingerprint(a) == data_fingerprint(b)  # feature columns do not count
    assert data_fingerprint(a) != data_fingerprint(Dataset.from_dict({**rows, "loss_mask": [[1, 1, 1], [1, 1]]}))
    assert data_fingerprint(a) != data_fingerprint(a.select([1, 0]))  # order counts
