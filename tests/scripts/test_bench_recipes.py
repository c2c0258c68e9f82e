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
    import drafttrain.eval.in_training
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

    monkeypatch.setattr(drafttrain.eval.in_training, "spec_eval", no_decode)
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
    decode_rows = [line for line in md.splitlines() if line.startswith("| eagle3 | mt_bench | ")]
    assert len(decode_rows) == 1 and f"{full['mt_bench']['eval/speedup_b16']:.2f}x" in decode_rows[0]


def test_report_dflash_drafts_and_chain_acceptance():
    """DFlash drafts block_size - 1 tokens per pass; a chain's per-position acceptance is the share of
    steps that accepted at least k drafts; the decoding table reads the planner's drafting ms."""
    from scripts.bench_recipes import decoding_table, drafts_per_step, position_acceptance

    assert drafts_per_step("dflash", {"block_size": 8, "num_layers": 2}) == 7
    assert drafts_per_step("eagle3", {"draft_depth": 5}) == 5
    assert drafts_per_step("parallelspec_eagle3", {"num_mask_tokens": 4}) == 5
    assert drafts_per_step("medusa", {"num_heads": 4}) == 4
    assert position_acceptance({"0": 2, "1": 1, "3": 1}) == [0.5, 0.25, 0.25]
    assert position_acceptance({}) == []
    m = {"eval/speedup_b16": 1.234, "eval/accept_hist_chain": {"0": 1, "2": 3},
         "eval/planner_b1": {"draft_ms": {"1": 12.34}}, "eval/planner_b16": {"draft_ms": {"16": 56.78, "2": 20.0}}}
    rows = decoding_table([{"recipe": "dflash", "full": {"gsm8k": m}}], ["mt_bench", "gsm8k"])
    assert rows[-1] == "| dflash | gsm8k | 1.23x | 12.3 | 56.8 | 0.75, 0.75 |"
    m["eval/planner_b16"]["draft_ms"] = {"2": 20.0, "5": 31.0}  # the planner never drafted all 16 at once
    assert decoding_table([{"recipe": "dflash", "full": {"gsm8k": m}}], ["gsm8k"])[-1].startswith("| dflash | gsm8k | 1.23x | 12.3 | 31.0 (5 seq) |")


@pytest.mark.parametrize("bad", ["eval_suite=tree", "budget_minutes=0", "recipes=[eagle4]"])
def test_bench_recipes_bad_keys_fail_before_work(bad):
    from drafttrain.cliconfig import ConfigError
    from scripts.bench_recipes import main

    with pytest.raises(ConfigError):
        main(["phase=report", bad])


def test_data_fingerprint_reads_tokens_not_features():
    from datasets import Dataset

    from drafttrain.fingerprint import dataset_fingerprint

    def data_fingerprint(ds):  # as training records it (train_data_sha)
        return dataset_fingerprint(ds, ("input_ids", "loss_mask"))

    rows = {"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]}
    a = Dataset.from_dict(rows)
    b = Dataset.from_dict({**rows, "features": [[[0.5]] * 3, [[0.1]] * 2]})
    assert data_fingerprint(a) == data_fingerprint(b)  # feature columns do not count
    assert data_fingerprint(a) != data_fingerprint(Dataset.from_dict({**rows, "loss_mask": [[1, 1, 1], [1, 1]]}))
    assert data_fingerprint(a) != data_fingerprint(a.select([1, 0]))  # order counts


def test_report_curve_by_training_minutes(tmp_path):
    """The held-out τ_sim curve of budget runs, read at fractions of the budget (steps -> minutes by the
    run's mean step time): a fast recipe's step 400 and a slow one's step 40 land in the same column."""
    from scripts.bench_recipes import cmd_report

    def run(name, steps, every, taus):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        rows = [{"step": s, "train/loss": 1.0, "train/seq_tokens_per_s": 100.0} for s in range(every, steps + 1, every)]
        rows += [{"step": every * (i + 1), "eval/tau_sim": t} for i, t in enumerate(taus)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (d / "final_metrics.json").write_text(json.dumps({"step": steps, "samples": 8 * steps, "train_rows": 100,
                                                          "train_seconds": 2400.0, "trainable_params": 1e6,
                                                          "stopped_by_time_budget": True, "train_data_sha": "abc",
                                                          "eval/tau_sim": taus[-1]}))  # fmt: skip
        drafter = {"num_heads": 4} if name == "medusa" else {"draft_depth": 5}
        (d / "config.json").write_text(json.dumps({"drafter": drafter, "trainer": {}}))

    run("eagle", 800, 100, [1.1, 1.2, 1.3, 1.35, 1.4, 1.42, 1.41, 1.40])  # 100 steps = 5 min
    run("eagle3", 80, 10, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.55, 1.6])  # 10 steps = 5 min
    cmd_report(tmp_path / "runs", tmp_path / "page", ["eagle", "eagle3"])
    md = (tmp_path / "page.md").read_text()
    assert "| 5 min | 10 min | 20 min | 30 min | 40 min | best |" in md
    assert "| eagle | 1.100 (100) | 1.200 (200) | 1.350 (400) | 1.420 (600) | 1.400 (800) | 1.420 (600) |" in md
    assert "| eagle3 | 1.000 (10) | 1.100 (20) | 1.300 (40) | 1.500 (60) | 1.600 (80) | 1.600 (80) |" in md
    assert "the same in every run (abc)" in md
    assert "![held-out τ_sim by training minute](page_tau_sim.png)" in md  # the curves drawn beside the page
    assert (tmp_path / "page_tau_sim.png").read_bytes()[:4] == b"\x89PNG"
    assert "at equal steps" not in md  # eagle3 stopped at step 80: no evaluated step in common

    run("medusa", 300, 100, [1.2, 1.3, 1.5])  # 100 steps = 13.3 min
    cmd_report(tmp_path / "runs", tmp_path / "page2", ["eagle", "medusa"])
    md = (tmp_path / "page2.md").read_text()
    assert "| recipe | step 100 | step 200 | step 300 |" in md
    assert "| eagle | 1.100 (5.0) | 1.200 (10.0) | 1.300 (15.0) |" in md
    assert "| medusa | 1.200 (13.3) | 1.300 (26.7) | 1.500 (40.0) |" in md


def test_parallelspec_is_parallelspec_eagle3_under_the_shared_overrides():
    """The recipes benchmark trains ``parallelspec_eagle3`` once for both names: under COMMON's shared draft
    vocabulary the main job's recipe composes to the same job (only its run name, and the output folder named
    after it, differ; the benchmark sets its own output folder)."""
    import helpers
    from scripts.bench_recipes import COMMON

    a, b = (helpers.compose_dict("train", [f"+recipe={r}", *COMMON]) for r in ("parallelspec", "parallelspec_eagle3"))
    assert a["drafter"]["name"] == "parallelspec_eagle3"
    names = ("run_name", "output_dir")
    assert {k: v for k, v in a.items() if k not in names} == {k: v for k, v in b.items() if k not in names}
    assert a != helpers.compose_dict("train", ["+recipe=parallelspec"])  # without COMMON the vocabularies differ
