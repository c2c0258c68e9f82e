"""The MCSD decision model end to end on the tiny target: decision rows logged by the harness, the
``scripts.train_decision_model`` training run, bad rows and config typos, and early stopping in MCSD."""

from __future__ import annotations

import json

import pytest
import torch

from drafttrain.config import ConfigError
from drafttrain.train.decision_model import read_decisions
from drafttrain.verify.methods.mcsd_decision import DecisionModel, load_decision_model, save_decision_model
from helpers import compose_dict

KS = [2, 2, 1, 1]  # K = 3: four levels, 2 + 4 + 4 + 4 nodes when fully grown


def _harness(checkpoint, tmp_path, *extra):
    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    return evaluate(compose_dict("evaluate", [
        f"checkpoint={checkpoint}", "target=tiny", "num_prompts=3", "max_new_tokens=10", "batch_sizes=[2]",
        "modes=[unpadded]", "methods=[mcsd]", "mcsd.target_roots=[1]", f"mcsd.ks=[{','.join(map(str, KS))}]",
        f"output_dir={tmp_path / 'eval'}", "progress=false", "plots=false", "warmup=false", *extra,
    ]))  # fmt: skip


def test_harness_logs_decisions_and_the_entry_point_trains_on_them(checkpoint, tmp_path):
    from scripts.train_decision_model import main

    log = tmp_path / "decisions.jsonl"
    res = _harness(checkpoint, tmp_path, f"mcsd.decisions_out={log}", "mcsd.decision_topk=4")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    run_rec = next(r for r in res["runs"] if r["method"] == "mcsd_w1")
    assert len(rows) == run_rec["decisions_logged"] > 0
    assert all(len(r["features"]) == 4 + 2 and r["label"] in (0, 1) for r in rows)
    # per step: levels 1..m+1 are reached (m = accepted drafts), the last one rejected unless all were accepted
    steps = run_rec["sequence_steps"]
    assert sum(r["label"] == 0 for r in rows) <= steps and sum(r["features"][-1] == 1.0 for r in rows) == steps
    out = tmp_path / "dm"
    main([f"data=[{log}]", f"output_dir={out}", "logging.wandb=false", "epochs=3", "progress=false"])  # the real CLI
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["kept"] == len(rows) and final["topk"] == 4
    assert 0.0 <= final["decision/heldout_accuracy"] <= 1.0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    model = load_decision_model(out / "decision_model")
    assert model.topk == 4 and model(torch.tensor([rows[0]["features"]])).shape == (1,)


def test_decision_rows_bad_input_is_counted(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"features": [0.5, 0.1, 1.2, 1], "label": 1}\nnot json\n{"features": [0.1, 0.1, 2.0, 2], "label": 3}\n'
                 '{"label": 0}\n{"features": [0.2, 0.1, 2.0, 2], "label": 0}\n')  # fmt: skip
    x, y, counts = read_decisions([str(p)])
    assert counts == {"read": 5, "kept": 2, "skipped": 3} and x.shape == (2, 4) and y.tolist() == [1.0, 0.0]
    with pytest.raises(FileNotFoundError, match="mcsd.decisions_out"):
        read_decisions([str(tmp_path / "missing.jsonl")])


def test_decision_model_config_errors_before_loading():
    """Its own schema (no task switch inside TrainConfig): data is required, typos and bad values fail
    before any log is read; the old drafter-recipe route is gone."""
    from drafttrain.train import compose_config
    from scripts.train_decision_model import main

    with pytest.raises(ConfigError, match="data="):
        main([])
    with pytest.raises(ConfigError, match="'epoch'.*did you mean 'epochs'"):
        main(["data=[x]", "epoch=3"])
    with pytest.raises(ConfigError, match="heldout_fraction"):
        main(["data=[x]", "heldout_fraction=1.5"])
    with pytest.raises(Exception, match="decision_model"):
        compose_config(["+recipe=decision_model"])


@pytest.mark.parametrize("bias, nodes", [(-50.0, KS[0]), (50.0, 2 + 4 + 4 + 4)])
def test_decision_model_stops_tree_growth(checkpoint, tmp_path, bias, nodes):
    """A model that predicts rejection everywhere stops after level 1; one that predicts acceptance grows
    the full tree; both stay lossless (W_t = 1)."""
    model = DecisionModel(8 + 2, hidden=4, num_layers=2)
    with torch.no_grad():
        for m in model.net:
            if isinstance(m, torch.nn.Linear):
                m.weight.zero_()
                m.bias.zero_()
        model.net[-1].bias.fill_(bias)
    save_decision_model(model, tmp_path / "dm", topk=8)
    res = _harness(checkpoint, tmp_path, f"mcsd.decision_model={tmp_path / 'dm'}")
    by = {r["method"]: r for r in res["runs"]}
    assert by["mcsd_w1_dm"]["greedy_equal"] and by["mcsd_w1"]["greedy_equal"]
    assert by["mcsd_w1_dm"]["mean_tree_nodes"] == pytest.approx(nodes)
    assert by["mcsd_w1"]["mean_tree_nodes"] == pytest.approx(2 + 4 + 4 + 4)


def test_beta_sweep_runs_one_variant_per_threshold(checkpoint, tmp_path):
    """mcsd.betas=[...] adds one early-stop run per threshold. With a model that predicts acceptance 0.5 at
    every level, level l + 1 is grown while 0.5^(l + 1) (its predicted chance to be reached and accepted)
    >= beta: beta 0.3 stops after level 1, 0.2 grows level 2, 0.1 level 3, 0.05 all four; lossless."""
    model = DecisionModel(8 + 2, hidden=4, num_layers=2)
    with torch.no_grad():
        for m in model.net:
            if isinstance(m, torch.nn.Linear):
                m.weight.zero_()
                m.bias.zero_()  # sigmoid(0) = 0.5
    save_decision_model(model, tmp_path / "dm", topk=8)
    res = _harness(checkpoint, tmp_path, f"mcsd.decision_model={tmp_path / 'dm'}", "mcsd.betas=[0.3,0.2,0.1,0.05]")
    by = {r["method"]: r for r in res["runs"]}
    assert "mcsd_w1_dm" not in by
    nodes = [by[f"mcsd_w1_dm_b{b}"]["mean_tree_nodes"] for b in ("0.3", "0.2", "0.1", "0.05")]
    assert nodes == pytest.approx([2, 2 + 4, 2 + 4 + 4, 2 + 4 + 4 + 4])
    assert all(by[f"mcsd_w1_dm_b{b}"]["greedy_equal"] for b in ("0.3", "0.2", "0.1", "0.05"))


def test_bench_decision_script_sweeps_beta_and_reuses_labels(checkpoint, tmp_path, monkeypatch):
    """scripts.bench_decision on the tiny checkpoint: labels, training, one evaluation run per beta (+ MCSD
    without the model), JSON + markdown; a second invocation reuses the labels (no label decoding)."""
    import json

    from scripts import bench_decision

    torch.set_num_threads(1)
    args = [f"checkpoint={checkpoint}", "label_prompts=2", "num_prompts=2", "max_new_tokens=6", "batch_sizes=[2]",
            "betas=[0.3,0.1]", "threads=1", f"out={tmp_path / 'dm'}", f"work_dir={tmp_path / 'work'}",
            'overrides=["target=tiny","warmup=false"]']  # fmt: skip
    bench_decision.main(args)
    data = json.loads((tmp_path / "dm.json").read_text())
    methods = [r["method"] for r in data["mt_bench"]["runs"]]
    assert {"plain", "mcsd_w1", "mcsd_w1_dm_b0.3", "mcsd_w1_dm_b0.1"} <= set(methods)
    assert "| 2 | mcsd_w1_dm_b0.1 |" in (tmp_path / "dm.md").read_text()
    calls = []
    real = bench_decision.run_eval
    monkeypatch.setattr(bench_decision, "run_eval", lambda ov: calls.append(ov) or real(ov))
    bench_decision.main(args)
    assert len(calls) == 2 and not any("mcsd.decisions_out" in o for ov in calls for o in ov)  # the two evaluations only
