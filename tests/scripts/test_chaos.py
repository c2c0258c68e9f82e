"""scripts.chaos: its comparison (unit-tested on hand-made run folders, no launch) and a short chaos run.

Why: a chaos run that ends "identical" proves something only if the comparison sees a difference when
there is one: a weight moved by one ulp, a loss of one step, a step logged twice, a dropped dataset row,
a stray temporary folder; and it must ignore exactly the fields it lists as measured (timings), nothing else.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scripts.chaos import EXCLUDED, PHASE_MARKERS, ChaosConfig, compare_runs, draw_kills, excluded_keys, phase_times


def _root(path: Path) -> Path:
    """A pipeline root as the chaos run leaves it, reduced to one file of each kind the comparison reads."""
    import datasets

    run = path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "export").mkdir()
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)
    torch.manual_seed(0)
    save_file({"fc.weight": torch.randn(4, 8), "mask_hidden": torch.randn(8)}, str(run / "drafter" / "drafter.safetensors"))
    shutil.copy(run / "drafter" / "drafter.safetensors", run / "export" / "model.safetensors")
    rows = [{"step": s, "train/loss": 1.0 / s, "train/lr": 1e-4 * s, "train/tokens_per_s": 1000.0 + s} for s in (1, 2)]
    rows.append({"step": 2, "eval/tau": 3.5, "eval/speedup": 1.2, "eval/planner_b1": {"steps": 4}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "final_metrics.json").write_text(json.dumps({"step": 2, "eval/tau": 3.5, "wall_seconds": 12.5}))
    (run / "config.json").write_text(json.dumps({"output_dir": str(run), "seed": 0}))
    (run / "eval_outputs.jsonl").write_text(json.dumps({"id": "81", "tau": 3.5, "text": "hi"}) + "\n")
    (run / "checkpoints" / "step_0000002" / "meta.json").write_text(json.dumps({"step": 2, "train_seconds": 1.5}))
    (run / "checkpoints" / "step_0000002" / "optimizer.bin").write_bytes(b"\x00\x01\x02")
    (run / "train.log").write_text("[2026-01-01 00:00:00] resumed from ...\n")
    job = path / "data" / "selfdistill" / "abc"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [0, 1]]}).save_to_disk(
        str(job / "shard_00000"))
    (job / "manifest.json").write_text(json.dumps({"shards": {"0": {"rows": 2, "seconds": 0.3}}}))
    return path


@pytest.fixture()
def pair(tmp_path):
    a = _root(tmp_path / "a")
    b = _root(tmp_path / "b")
    return a, b


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def test_two_equal_runs_compare_identical_whatever_their_excluded_fields_and_folders(pair):
    a, b = pair
    assert compare_runs(a, b) == []  # config.json names its own folder: written <ROOT> on both sides
    _edit_json(b / "run" / "final_metrics.json", wall_seconds=99.0)
    rows = [json.loads(x) for x in (b / "run" / "metrics.jsonl").read_text().splitlines()]
    rows[0]["train/tokens_per_s"], rows[2]["eval/speedup"], rows[2]["eval/planner_b1"] = 1.0, 0.5, {"steps": 9}
    (b / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _edit_json(b / "run" / "checkpoints" / "step_0000002" / "meta.json", train_seconds=7.0)
    (b / "run" / "train.log").write_text("other lines\n")
    _edit_json(b / "data" / "selfdistill" / "abc" / "manifest.json", shards={"0": {"rows": 2, "seconds": 9.9}})
    assert compare_runs(a, b) == []


def test_a_weight_one_ulp_off_is_reported_naming_the_file_and_tensor(pair):
    from safetensors.torch import load_file

    a, b = pair
    w = load_file(str(b / "run" / "drafter" / "drafter.safetensors"))
    w["fc.weight"][1, 2] = torch.nextafter(w["fc.weight"][1, 2], torch.tensor(10.0))
    save_file(w, str(b / "run" / "drafter" / "drafter.safetensors"))
    diffs = compare_runs(a, b)
    assert "run/drafter/drafter.safetensors: sha256 differs" in diffs
    assert any(d.startswith("run/drafter/drafter.safetensors: tensor fc.weight differs") for d in diffs), diffs
    assert not any("mask_hidden" in d or "export" in d for d in diffs), diffs


def test_a_different_loss_a_duplicated_step_and_other_bytes_are_reported(pair):
    a, b = pair
    m = b / "run" / "metrics.jsonl"
    rows = [json.loads(x) for x in m.read_text().splitlines()]
    rows[1]["train/loss"] = 0.5000001
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (b / "run" / "checkpoints" / "step_0000002" / "optimizer.bin").write_bytes(b"\x00\x01\x03")
    _edit_json(b / "run" / "final_metrics.json", **{"eval/tau": 3.25})
    diffs = compare_runs(a, b)
    assert "run/metrics.jsonl row 2 (step 2): train/loss: 0.5 (uninterrupted) vs 0.5000001 (killed)" in diffs
    assert any(d.startswith("run/checkpoints/step_0000002/optimizer.bin: sha256 differs") for d in diffs)
    assert "run/final_metrics.json: eval/tau: 3.5 (uninterrupted) vs 3.25 (killed)" in diffs
    assert len(diffs) == 3, diffs

    m.write_text(m.read_text().splitlines(keepends=True)[0] + m.read_text())  # step 1 logged twice
    assert any("3 rows (uninterrupted) vs 4 rows (killed); steps [1, 2, 2] vs [1, 1, 2, 2]" in d for d in compare_runs(a, b))


def test_a_changed_dataset_row_a_stray_temporary_folder_and_a_missing_output_are_reported(pair):
    import datasets

    a, b = pair
    shard = b / "data" / "selfdistill" / "abc" / "shard_00000"
    shutil.rmtree(shard)
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 6]], "loss_mask": [[0, 1, 1], [0, 1]]}).save_to_disk(str(shard))
    (b / "run" / "checkpoints" / ".tmp_step_0000004").mkdir()
    (b / "run" / "export" / "model.safetensors").unlink()
    diffs = compare_runs(a, b)
    assert "data/selfdistill/abc/shard_00000: row 1 differs in ['input_ids']" in diffs
    assert "run/checkpoints/.tmp_step_0000004: only in the killed run" in diffs
    assert "run/export/model.safetensors: only in the uninterrupted run" in diffs


def test_the_excluded_list_names_measurements_only():
    """Nothing the task compares hides behind an exclusion: no loss, lr, weight, tau or dataset field."""
    assert excluded_keys("run/train.log") == ("*",)
    for rel in ("run/drafter/drafter.safetensors", "run/export/model.safetensors", "run/eval_outputs.jsonl",
                "run/checkpoints/step_0000012/model.safetensors", "data/selfdistill/k/shard_00001/data-00000-of-00001.arrow"):  # fmt: skip
        assert excluded_keys(rel) == (), rel
    keys = [k for ks in EXCLUDED.values() for k in ks]
    for kept in ("train/loss", "train/lr", "train/grad_norm", "train/samples", "eval/tau", "eval/greedy_equal", "step",
                 "eval/tau_sim", "eval/acc_0", "shards.0.rows", "generated"):  # fmt: skip
        assert not any(fnmatch.fnmatchcase(kept, k) for k in keys if k != "*"), kept


def test_kill_points_are_a_function_of_the_seed_and_reach_every_phase():
    lines = [(0.5, "x"), (1.0, "[t][drafttrain.target.fastlinear][INFO] - building drafttrain's AVX2 kernel k (once)"),
             (2.0, "[t][drafttrain.data.pipeline][INFO] - sharegpt: read 24"), (3.0, "train sequences 18"),
             (5.0, "Saving current state to /r/checkpoints/.tmp_step_0000012"), (6.0, "[chaos] export stage"), (8.0, "end")]  # fmt: skip
    phases = phase_times(lines, ChaosConfig(max_steps=12))
    assert phases == {"startup": (0.0, 1.0), "kernel": (1.0, 2.0), "generation": (2.0, 3.0), "training": (3.0, 5.0),
                      "evaluation": (5.0, 6.0), "export": (6.0, 8.0)}  # fmt: skip
    assert list(phases) == [name for name, _ in PHASE_MARKERS]
    assert draw_kills(3, 5, phases) == draw_kills(3, 5, phases) != draw_kills(4, 5, phases)
    drawn = draw_kills(0, 60, phases)
    assert {n for n, _ in drawn} == set(phases)
    assert all(0 <= t <= phases[n][1] - phases[n][0] for n, t in drawn)


@pytest.mark.slow
def test_a_short_chaos_run_ends_identical(tmp_path, capsys):
    """Seed 0, 3 kills of the tiny pipeline (generation, training, evaluation, export as drawn): relaunched
    until done, the killed run equals the uninterrupted one (``compare_runs`` finds nothing)."""
    from scripts.chaos import run

    code = run(ChaosConfig(out=str(tmp_path / "chaos"), seed=0, kills=3))
    out = capsys.readouterr().out
    assert code == 0, out[-6000:]
    assert "identical to the uninterrupted run" in out
    assert len(re.findall(r"^\[chaos\] kill \d+: ", out, flags=re.M)) == 3  # one line per kill
