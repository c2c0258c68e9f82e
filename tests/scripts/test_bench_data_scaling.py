"""scripts.bench_data_scaling: the rows differ only in their data overrides, and the report reads each row's files.

Why: a curve whose rows silently differ in anything but the data (steps, seed, held-out set) is not a controlled
curve; a report that mislabels a column puts the wrong τ under a data size.
"""

from __future__ import annotations

import json

import pytest

from scripts import bench_data_scaling as bds


def test_rows_differ_only_in_data_overrides(tmp_path):
    cmds = {r: bds.train_command(r, tmp_path, []) for r in ("raw690", "raw2700", "raw4500")}
    strip = [[a for a in c if not a.startswith(("data.max_conversations=", "output_dir=", "run_name="))] for c in cmds.values()]
    assert all(s == strip[0] for s in strip)  # the raw rows: one config but max_conversations
    for c in cmds.values():
        assert "trainer.max_steps=800" in c and "data.heldout_split=head" in c and "seed=0" in c and "target.dtype=auto" in c
    with pytest.raises(SystemExit, match="unknown row"):
        bds.train_command("raw1", tmp_path, [])


def _fake_row(root, row, train_rows, heldout, chain, tree):
    out = root / row
    out.mkdir(parents=True)
    (out / "final_metrics.json").write_text(json.dumps({"train_rows": train_rows, "samples": 6400, "step": 800,
                                                        "train_seconds": 1.0, "eval/tau_sim": heldout, "eval/acc_0": 0.3}))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 800, "train/loss": 1.0, "train/tau_sim": heldout + 0.2}) + "\n"
                                       + json.dumps({"step": 800, "eval/tau_sim": heldout, "eval/acc_0": 0.3}) + "\n")
    ev = {p: {"eval/tau_chain": chain, "eval/tau": tree, "eval/greedy_equal": True} for p in ("mt_bench", "gsm8k")}
    (out / "eval_scaling.json").write_text(json.dumps(ev))


def test_report_puts_each_rows_numbers_in_its_columns(tmp_path):
    _fake_row(tmp_path, "raw690", 600, 1.30, 1.25, 1.40)
    _fake_row(tmp_path, "raw2700", 2400, 1.40, 1.33, 1.55)
    dest = tmp_path / "page" / "data_scaling"
    bds.cmd_report(tmp_path, dest)
    text = (dest.with_suffix(".md")).read_text()
    line = next(x for x in text.splitlines() if x.startswith("| raw2700 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "2400" and cells[3] == "1.400" and cells[6] == "0.200" and cells[7] == "1.330" and cells[9] == "1.550"
    data = json.loads(dest.with_suffix(".json").read_text())
    assert [r["row"] for r in data["rows"]] == ["raw690", "raw2700"]
    assert dest.with_suffix(".png").is_file()


def test_a_rows_value_replaces_commons_in_place(tmp_path):
    """Part (b) and the every-conversation rows override COMMON's keys once each (Hydra refuses a key twice)."""
    cmd = bds.train_command("every-long", tmp_path, ["trainer.max_steps=10"])
    keys = [a.split("=", 1)[0] for a in cmd if "=" in a and not a.startswith("--")]
    assert len(keys) == len(set(keys))
    assert "trainer.max_steps=10" in cmd and "trainer.max_minutes=240" in cmd
    assert f"data.source={tmp_path}/sharegpt_every.jsonl" in cmd and "+recipe=parallelspec" in cmd
    assert "+recipe=eagle3" in bds.train_command("e3-raw690", tmp_path, [])
    long, short = bds.train_command("raw4500-long", tmp_path, []), bds.train_command("raw4500", tmp_path, [])
    assert {a for a in long} - {a for a in short} == {"trainer.max_steps=2400", "trainer.max_minutes=240",
                                                      f"output_dir={tmp_path}/raw4500-long",
                                                      "run_name=scaling-raw4500-long"}  # fmt: skip


def test_report_keeps_the_rows_an_earlier_session_measured(tmp_path):
    """A row whose run folder is not on this machine keeps what the page's JSON recorded; one on disk is re-read."""
    _fake_row(tmp_path, "raw690", 600, 1.30, 1.25, 1.40)
    dest = tmp_path / "page" / "data_scaling"
    bds.cmd_report(tmp_path, dest)
    data = json.loads(dest.with_suffix(".json").read_text())
    old = dict(data["rows"][0], row="raw4500", train_rows=4006, heldout_tau_sim=1.35)
    data["rows"].append(old)
    dest.with_suffix(".json").write_text(json.dumps(data))
    _fake_row(tmp_path, "every", 17000, 1.45, 1.41, 1.66)
    bds.cmd_report(tmp_path, dest)
    rows = json.loads(dest.with_suffix(".json").read_text())["rows"]
    assert [(r["row"], r["train_rows"]) for r in rows] == [("raw690", 600), ("raw4500", 4006), ("every", 17000)]
    text = dest.with_suffix(".md").read_text()
    assert "| raw4500 | 4006 |" in text and "| every | 17000 |" in text
