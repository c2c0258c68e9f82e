"""Tests of the evaluation harness (drafttrain.eval.harness, scripts/evaluate.py, conf/evaluate.yaml) on the tiny target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import compose_dict

from drafttrain.config import ConfigError, EvalConfig
from drafttrain.validation import validate_eval

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def compose_eval(overrides: list[str]) -> dict:
    return compose_dict("evaluate", overrides)


def test_evaluate_config_composes_and_validates():
    c = validate_eval(compose_eval(["checkpoint=/x", "prompts=gsm8k", "batch_sizes=[1,4]", "tree.widths=[2,1]"]))
    assert isinstance(c, EvalConfig)
    assert c.batch_sizes == [1, 4] and c.prompts == "gsm8k" and c.tree.widths == [2, 1]
    assert c.target.name == "smollm2-135m-instruct" and c.output_dir == "outputs/eval/eval-gsm8k"
    c = validate_eval(compose_eval(["untrained_drafter=true", "target=tiny", "tree.choices=eagle_default"]))
    assert c.target.random_init and c.tree.choices == "eagle_default"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"batch_size": [1]}, "batch_size"),  # typo of batch_sizes
        ({"tree": {"widht": [2]}}, "tree.widht"),
        ({"modes": ["unpaded"]}, "unknown engine mode"),
        ({"temperature": -1.0}, "temperature"),
        ({"tree": {"choices": "nonsense"}}, "tree.choices"),
        ({"batch_sizes": "four"}, "batch_sizes"),
    ],
)
def test_bad_eval_config_fails_early(change, message):
    """validate_eval names the bad key or value (the CLI additionally rejects unknown keys at compose time)."""
    cfg = compose_eval(["checkpoint=/x"])
    for k, v in change.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ConfigError, match=message):
        validate_eval(cfg)


def test_checkpoint_is_required(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint=PATH"):
        validate_eval(compose_eval([]))


def test_checkpoint_for_another_target_is_rejected(checkpoint):
    from drafttrain.eval.harness import check_checkpoint

    c = validate_eval(compose_eval([f"checkpoint={checkpoint}"]))  # default target: smollm2
    with pytest.raises(ConfigError, match="target=tiny"):
        check_checkpoint(c)
    c = validate_eval(compose_eval([f"checkpoint={checkpoint / 'drafter'}", "target=tiny"]))
    assert check_checkpoint(c) == checkpoint / "drafter"
    with pytest.raises(FileNotFoundError, match="no drafter"):
        check_checkpoint(validate_eval(compose_eval([f"checkpoint={checkpoint.parent}", "target=tiny"])))


def test_harness_end_to_end(checkpoint, tmp_path):
    """Plain and speculative (unpadded, padded) runs per batch size; JSON, report, plots; greedy equality."""
    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    out = tmp_path / "eval"
    res = evaluate(compose_eval([
        f"checkpoint={checkpoint}", "target=tiny", "num_prompts=4", "max_new_tokens=12", "batch_sizes=[1,3]",
        "tree.widths=[2,1,1,1]", "tree.budget=5", f"output_dir={out}", "progress=false", "warmup=false",
    ]))  # fmt: skip
    assert res["greedy_equal"] is True
    runs = res["runs"]
    assert [(r["method"], r["mode"], r["batch_size"]) for r in runs] == [
        ("plain", "unpadded_kv", 1), ("parallelspec", "unpadded", 1), ("parallelspec", "padded", 1),
        ("plain", "unpadded_kv", 3), ("parallelspec", "unpadded", 3), ("parallelspec", "padded", 3),
    ]  # fmt: skip
    for r in runs:
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["decode_tokens_per_s"] > 0 and r["speedup_decode"] == pytest.approx(r["decode_tokens_per_s"] / next(
            p["decode_tokens_per_s"] for p in runs if p["method"] == "plain" and p["batch_size"] == r["batch_size"]))
        if r["method"] == "plain":
            assert r["tau"] == 1.0
        else:
            assert r["greedy_equal"] and r["mismatches"] == []
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / next(
                p["tokens_per_s"] for p in runs if p["method"] == "plain" and p["batch_size"] == r["batch_size"]))
            assert sum(r["accept_hist"].values()) == r["sequence_steps"]
            assert r["mode"] != "unpadded" or r["padding_ratio"] == 0.0
    saved = json.loads((out / "results.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(runs))
    report = (out / "report.md").read_text()
    assert "greedy_equal" in report and "| 3 |" in report
    for name in ("throughput_speedup", "tau", "acceptance", "padded_vs_unpadded"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
        assert f"plots/{name}.png" in report
    lines = (out / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 6 * 4


@pytest.mark.slow
def test_harness_compile_target_at_batch_one(checkpoint, tmp_path):
    """compile_target=true: the batch-1 runs go through the compiled backbone (compiled before timing, the time
    recorded), their outputs equal the eager batch-2 runs' token for token, and speculative equals plain."""
    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    out = tmp_path / "eval"
    res = evaluate(compose_eval([
        f"checkpoint={checkpoint}", "target=tiny", "num_prompts=3", "max_new_tokens=10", "batch_sizes=[1,2]",
        "modes=[unpadded]", "compile_target=true", "tree.widths=[2,1,1]", "tree.budget=4", f"output_dir={out}",
        "progress=false", "warmup=false", "plots=false",
    ]))  # fmt: skip
    assert res["greedy_equal"] is True
    assert res["compile_seconds"] > 0
    runs = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        row = json.loads(line)
        runs.setdefault(row["run"], []).append(row["tokens"])
    assert set(runs) == {"plain/b1", "parallelspec/unpadded/b1", "plain/b2", "parallelspec/unpadded/b2"}
    assert runs["plain/b1"] == runs["plain/b2"] == runs["parallelspec/unpadded/b1"]  # compiled (b1) == eager (b2)


def test_cli_typo_fails_before_loading(tmp_path):
    """The real entry point: a typo'd key exits with an error naming it, before any model loads."""
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.evaluate", "checkpoint=/nonexistent", "batch_sizs=[1]", f"output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "batch_sizs" in proc.stderr + proc.stdout


def test_diagnose_mismatch_finds_first_difference(tiny_target):
    from drafttrain.eval.harness import diagnose_mismatch

    prompt = [5, 17, 300, 42]
    plain = tiny_target.generate_greedy([prompt], 6, stop_token_id=-1, return_features=False)[0]["tokens"][4:]
    spec = plain[:3] + [(plain[3] + 1) % 49152] + plain[4:]
    d = diagnose_mismatch(tiny_target, prompt, spec, plain)
    logits = tiny_target.forward(torch.tensor([prompt + plain[:3]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert d == {"position": 3, "top2_gap": pytest.approx(float(top[0] - top[1]))}


def test_harness_replay_proposer(tmp_path):
    """proposer=replay needs no checkpoint; its drafts are the plain output, so greedy equality holds and
    a p = 1 replay accepts every draft."""
    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    res = evaluate(compose_eval([
        "target=tiny", "proposer=replay", "replay_accept_prob=1.0", "replay_depth=3", "num_prompts=3",
        "max_new_tokens=9", "batch_sizes=[2]", f"output_dir={tmp_path}", "progress=false", "warmup=false", "plots=false",
    ]))  # fmt: skip
    assert res["greedy_equal"] is True and res["drafter"]["proposer"] == "replay"
    spec = [r for r in res["runs"] if r["method"] == "replay"]
    assert len(spec) == 2 and all(r["tau"] == pytest.approx(4.0) for r in spec)  # 8 verified tokens in 2 steps of 4
    assert "replay proposer" in (tmp_path / "report.md").read_text()


@pytest.fixture(scope="module")
def sssd_inputs(tmp_path_factory, tiny_target):
    """A tiny SSSD datastore and a planner τ(n) table; returns the harness overrides that use them."""
    from drafttrain.verify.methods.sssd_datastore import Datastore

    d = tmp_path_factory.mktemp("sssd")
    docs = [tiny_target.tokenizer("the cat sat on the mat and the dog sat on the log " * 4)["input_ids"]]
    Datastore.from_documents(docs).save(d / "store")
    (d / "tau.json").write_text(json.dumps({"tau_by_size": {"0": 1.0, "2": 1.4, "4": 1.6, "8": 1.7}}))
    return [f"sssd.datastore={d / 'store'}", f"sssd.tau_table={d / 'tau.json'}", "sssd.planner_context=16"]


def test_harness_compares_methods(checkpoint, sssd_inputs, tmp_path):
    """SSSD (planner-chosen tree size), MCSD W_t = 1 and 2 and MTAD beside the trained drafter in one
    report: lossless runs equal plain greedy, lossy ones are flagged and carry a perplexity, the planner
    records its choice per batch size."""
    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    out = tmp_path / "eval"
    res = evaluate(compose_eval([
        f"checkpoint={checkpoint}", "target=tiny", "num_prompts=3", "max_new_tokens=10", "batch_sizes=[1,2]",
        "modes=[unpadded]", "methods=[parallelspec,sssd,mcsd,mtad]", *sssd_inputs, "mcsd.ks=[2,1]",
        "mcsd.target_roots=[1,2]", "mtad.num_beams=2", f"output_dir={out}", "progress=false", "plots=false",
    ]))  # fmt: skip
    spec = [(r["method"], r["batch_size"]) for r in res["runs"] if r["method"] != "plain"]
    assert spec == [(m, b) for b in (1, 2) for m in ("parallelspec", "sssd", "mcsd_w1", "mcsd_w2", "mtad")]
    assert res["lossy_methods"] == ["mcsd_w2", "mtad"] and res["greedy_equal"] is True
    for r in res["runs"]:
        assert r["lossless"] == (r["method"] not in ("mcsd_w2", "mtad"))
        assert r["perplexity"] > 1.0  # computed for every run when a lossy method is compared
        if r["lossless"] and r["method"] != "plain":
            assert r["greedy_equal"], r["method"]
    plans = res["sssd_planner"]
    assert sorted(plans) == ["1", "2"] and all(p["best_size"] in (0, 2, 4, 8) for p in plans.values())
    assert [r["node_budget"] for r in res["runs"] if r["method"] == "sssd"] == [plans["1"]["best_size"], plans["2"]["best_size"]]
    report = (out / "report.md").read_text()
    assert "## Methods by batch size" in report and "| mtad | unpadded | **no** |" in report
    assert "speculation-length planner" in report


def test_bench_modes_writes_tables(checkpoint, sssd_inputs, tmp_path):
    """scripts.bench_modes end to end on the tiny target: per-set method tables, the planner vs the sweep."""
    from scripts import bench_modes

    torch.set_num_threads(1)
    out = tmp_path / "modes"
    overrides = json.dumps(["target=tiny", "mcsd.ks=[2,1]", *sssd_inputs])  # a JSON list of strings is Hydra syntax
    bench_modes.main([f"checkpoint={checkpoint}", "num_prompts=2", "max_new_tokens=6", "batch_sizes=[1,2]",
                      "prompt_sets=[mt_bench]", "sweep=[2,4]", "threads=1", f"out={out}", f"work_dir={tmp_path / 'work'}",
                      f"overrides={overrides}"])  # fmt: skip
    md = out.with_suffix(".md").read_text()
    saved = json.loads(out.with_suffix(".json").read_text())
    assert {"mt_bench", "sssd_sweep", "command"} <= set(saved)
    assert sorted({r["node_budget"] for r in saved["sssd_sweep"]["runs"] if r["method"] != "plain"}) == [2, 4]
    assert "| 1 | mtad | **no** |" in md and "| 2 | mcsd_w2 | **no** |" in md
    assert "measured best n" in md and md.count("| 1 | ") >= 7  # plain + 5 methods + the planner row
    bench_modes.main(["replan=true", f"out={out}"])  # the planner alone, on the saved runs
    saved2 = json.loads(out.with_suffix(".json").read_text())
    assert saved2["mt_bench"]["runs"] == saved["mt_bench"]["runs"]
    assert sorted(saved2["replanned"]["plans"]) == ["1", "2"]
    assert "Planner re-run" in out.with_suffix(".md").read_text()
