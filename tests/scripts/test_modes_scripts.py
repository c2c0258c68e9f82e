"""Tests of scripts.build_datastore and scripts.sssd_grid: configs compose and validate, typos fail,
both run end to end on tiny data in-process (one CLI run is marked slow) (< 10 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import datasets
import numpy as np
import pytest

from drafttrain.cliconfig import ConfigError, parse_cli, validate_into
from helpers import compose_dict
from drafttrain.verify.methods.sssd_datastore import Datastore, documents_from_rows, first_answer_split
from drafttrain.verify.methods.sssd import SSSDConfig, SSSDDrafter, simulate_greedy
from scripts import bench_sssd_datastore, build_datastore, sssd_grid
from scripts.common import load_sequences

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def test_configs_compose_validate_and_reject_typos():
    b = parse_cli(build_datastore.BuildDatastoreConfig, ["heldout=3"], config_name="build_datastore")
    assert b.source == "sharegpt" and b.heldout == 3 and b.sort_depth is None
    g = parse_cli(sssd_grid.SSSDGridConfig, ["sssd.node_budget=8"], config_name="sssd_grid")
    assert isinstance(g.sssd, SSSDConfig) and g.sssd.node_budget == 8 and g.grid.combine == ["max"]
    with pytest.raises(ConfigError, match="heldot"):
        parse_cli(build_datastore.BuildDatastoreConfig, ["+heldot=3"], config_name="build_datastore")
    with pytest.raises(ConfigError, match="'heldot'.*did you mean 'heldout'"):  # without the +: Hydra's own check
        parse_cli(build_datastore.BuildDatastoreConfig, ["heldot=3"], config_name="build_datastore")
    with pytest.raises(ConfigError, match="sssd.node_budgett"):
        parse_cli(sssd_grid.SSSDGridConfig, ["+sssd.node_budgett=8"], config_name="sssd_grid")
    with pytest.raises(ConfigError, match="input_depth_damp"):  # a value out of range fails before loading data
        sssd_grid.run(compose_dict("sssd_grid", ["grid.input_depth_damp=[1.5]", "datastore=/nonexistent"]))


def _rows(seed: int, n: int) -> dict:
    """Rows whose answers repeat a few phrases, so SSSD has something to find."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(100, 200, 6).tolist() for _ in range(5)]
    rows = {"id": [], "input_ids": [], "loss_mask": []}
    for i in range(n):
        prompt = rng.integers(0, 100, 4).tolist()
        answer = sum((phrases[j] for j in rng.integers(0, 5, 5)), [])
        rows["id"].append(f"r{i}")
        rows["input_ids"].append(prompt + answer)
        rows["loss_mask"].append([0] * 4 + [1] * len(answer))
    return rows


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows"
    datasets.Dataset.from_dict(_rows(0, 30)).save_to_disk(str(path))
    return path


def test_build_datastore_from_rows_and_selfdistill_folders(rows_dir, tmp_path):
    out = tmp_path / "ds"
    summary = build_datastore.run({"source": str(rows_dir), "output": str(out), "heldout": 6, "seed": 1})
    ds = Datastore.load(out)
    rows = datasets.load_from_disk(str(rows_dir)).to_list()
    held = [json.loads(line) for line in (out / build_datastore.HELDOUT_FILE).read_text().splitlines()]
    held_ids = {r["id"] for r in held}
    train = [r for r in rows if r["id"] not in held_ids]
    # the datastore is exactly the training rows' answers; held-out answers are not in it
    reference = Datastore.from_documents(documents_from_rows(train))
    assert np.array_equal(ds.tokens, reference.tokens) and np.array_equal(ds.suffix_array, reference.suffix_array)
    assert summary["heldout_rows"] + summary["heldout_dropped_duplicates"] == 6
    assert summary["num_documents"] == len(train) and ds.meta["source"] == str(rows_dir)
    # a self-distillation job folder: manifest + shards, input order restored by the "order" column
    job = tmp_path / "job"
    job.mkdir()
    (job / "manifest.json").write_text("{}")
    data = _rows(0, 30)
    for s, part in enumerate((range(15, 30), range(0, 15))):
        shard = {k: [v[i] for i in part] for k, v in data.items()}
        shard["order"] = list(part)
        shard["features"] = [[0.0]] * len(part)
        datasets.Dataset.from_dict(shard).save_to_disk(str(job / f"shard_{s:05d}"))
    build_datastore.run({"source": str(job), "output": str(tmp_path / "ds2"), "heldout": 6, "seed": 1})
    ds2 = Datastore.load(tmp_path / "ds2")
    assert np.array_equal(ds2.tokens, ds.tokens)
    with pytest.raises(FileNotFoundError, match="source"):
        build_datastore.run({"source": str(tmp_path / "missing.jsonl"), "output": str(tmp_path / "x")})


def test_build_datastore_tokenizes_a_jsonl_with_the_chat_template(tmp_path):
    from drafttrain import assets
    from helpers import need_input

    need_input(assets.converted_target_dir)  # missing package: fail with the install command, never skip
    convs = tmp_path / "c.jsonl"
    convs.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                       {"role": "assistant", "content": f"answer number {i} is here"}]})
                               for i in range(6)))
    summary = build_datastore.run({"source": str(convs), "output": str(tmp_path / "ds"), "heldout": 0,
                                   "cache_dir": str(tmp_path / "cache")})
    ds = Datastore.load(tmp_path / "ds")
    assert summary["num_documents"] == 6 and ds.meta["answers_only"]
    assert ds.count(ds.tokens[:3].tolist()) >= 1


def test_sssd_grid_picks_the_best_simulated_tau(rows_dir, tmp_path):
    build_datastore.run({"source": str(rows_dir), "output": str(tmp_path / "ds"), "heldout": 6, "seed": 1})
    cfg = compose_dict("sssd_grid", [
        f"datastore={tmp_path / 'ds'}", f"output={tmp_path / 'grid'}", "num_sequences=5", "max_continuation=20",
        "grid.input_scale=[0.1,1.0]", "grid.input_depth_damp=[1.0]", "grid.input_match_damp=[1.0]",
        "grid.datastore_depth_damp=[0.5,1.0]", "grid.datastore_match_damp=[1.0]", "budgets=[0,4]", "sssd.node_budget=6",
    ])
    report = sssd_grid.run(cfg)
    assert len(report["results"]) == 4
    assert report["best_tau"] == max(r["tau"] for r in report["results"])
    assert report["tau_by_size"][0] == 1.0 and report["tau_by_size"][4] >= 1.0
    # the grid's number is simulate_greedy's, recomputed independently
    seqs = load_sequences(tmp_path / "ds" / "heldout.jsonl", 5, 20)
    base = validate_into(sssd_grid.SSSDGridConfig, cfg).sssd
    again = simulate_greedy(SSSDDrafter(SSSDConfig(**{**asdict(base), **report["best"]}), Datastore.load(tmp_path / "ds")), seqs)
    assert again.tau == pytest.approx(report["best_tau"])
    assert json.loads((tmp_path / "grid.json").read_text())["best"] == report["best"]
    assert "τ_sim" in (tmp_path / "grid.md").read_text()
    held = [json.loads(line) for line in (tmp_path / "ds" / "heldout.jsonl").read_text().splitlines()]
    assert seqs[0][0] == first_answer_split(held[0]["input_ids"], held[0]["loss_mask"])[0]
    assert load_sequences(tmp_path / "ds" / "heldout.jsonl", 2, 20, offset=1) == seqs[1:3]


def test_bench_runs_on_tiny_data(rows_dir, tmp_path):
    build_datastore.run({"source": str(rows_dir), "output": str(tmp_path / "ds"), "heldout": 6, "seed": 1})
    c = parse_cli(bench_sssd_datastore.BenchConfig, [f"datastore={tmp_path / 'ds'}", "grid=null", "repeats=1", "batch_sizes=[1,3]",
                                         "budgets=[0,4]", "num_sequences=3", "offset=1", f"output={tmp_path / 'bench'}"])
    assert list(c.batch_sizes) == [1, 3] and c.grid is None
    report = bench_sssd_datastore.run(c)
    bench_sssd_datastore.write(report, tmp_path / "bench")
    assert [r["batch"] for r in report["latency"]] == [1, 3]
    assert [r["source"] for r in report["acceptance"]] == ["input + datastore"] * 2 + ["input only", "datastore only"]
    assert report["acceptance"][0]["tau"] == 1.0  # node budget 0 = plain decoding
    assert "Simulated acceptance" in (tmp_path / "bench.md").read_text()
    with pytest.raises(ConfigError, match="repeat"):
        parse_cli(bench_sssd_datastore.BenchConfig, ["repeat=1"])


@pytest.mark.slow
def test_build_datastore_cli(rows_dir, tmp_path):
    out = tmp_path / "cli_ds"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.build_datastore", f"source={rows_dir}", f"output={out}", "heldout=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout[("\n" + proc.stdout).index("\n{\n") :]  # the JSON summary printed last (logs: stderr)
    assert json.loads(printed)["num_documents"] == 28  # 30 rows, 2 held out
    assert Datastore.load(out).meta["heldout_rows"] <= 2
    assert not (ROOT / ".hydra").exists() and not (ROOT / "outputs" / "build_datastore.log").exists()
    bad = subprocess.run([sys.executable, "-m", "scripts.build_datastore", "+heldot=1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "heldot" in (bad.stderr + bad.stdout)
