"""K chosen from vLLM's own measured speedups (drafttrain.export.vllm_profile): the rule on synthetic profiles,
the cache key, a tiny run's export taking K from a cached profile, and scripts.serve_check's profile mode with
vLLM's runner replaced by synthetic timings (the real runner: docs/benchmarks/serving.md)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from drafttrain.drafters import build_drafter
from drafttrain.export import vllm_profile as vpx


def _profile(*rows):
    return {"rows": [{"k": k, "speedup": {str(n): x for n, x in sp.items()}, "equal": eq} for k, sp, eq in rows],
            "vllm_version": "0.32.0"}  # fmt: skip


# -- the rule ------------------------------------------------------------------------------------------
def test_a_k_that_loses_at_one_load_is_not_served_and_the_line_serves_the_target_alone():
    c = vpx.choose(_profile((1, {1: 1.19, 8: 0.94}, True), (2, {1: 1.10, 8: 0.80}, True)), loads=[1, 8])
    assert c["k"] == 0 and c["worst_speedup"] == 1.0 and c["speedup"] == {1: 1.0, 8: 1.0}
    assert c["best_alone"] == {1: [1, 1.19], 8: [0, 1.0]}  # one request at a time: K = 1 on its own


def test_the_k_with_the_best_worst_load_wins_over_the_best_single_load():
    c = vpx.choose(_profile((1, {1: 1.10, 8: 1.06}, True), (2, {1: 1.30, 8: 1.03}, True)), loads=[1, 8])
    assert c["k"] == 1 and c["worst_speedup"] == 1.06 and c["best_alone"][1] == [2, 1.3]
    assert vpx.choose(_profile((1, {1: 1.10, 8: 1.06}, True), (2, {1: 1.30, 8: 1.03}, True)), loads=[1])["k"] == 2


def test_a_gain_inside_the_noise_margin_serves_the_target_alone():
    p = _profile((1, {1: 1.015, 8: 1.012}, True))
    assert vpx.choose(p, [1, 8], min_gain=0.02)["k"] == 0
    assert vpx.choose(p, [1, 8], min_gain=0.01)["k"] == 1


def test_a_gain_inside_plains_measured_drift_is_not_served():
    p = _profile((1, {1: 1.16, 8: 1.17}, True))
    assert vpx.choose(p, [1, 8])["k"] == 1
    c = vpx.choose({**p, "plain_drift": {"1": 0.05, "8": 0.19}}, [1, 8])  # plain at 8 moved 19% between runs
    assert c["k"] == 0 and c["margin"] == {1: 0.05, 8: 0.19} and c["best_alone"] == {1: [1, 1.16], 8: [0, 1.0]}


def test_a_k_whose_outputs_differed_from_plain_is_never_chosen():
    assert vpx.choose(_profile((1, {1: 1.5, 8: 1.4}, False), (2, {1: 1.1, 8: 1.05}, True)), [1, 8])["k"] == 2
    assert vpx.choose(_profile((1, {1: 1.5, 8: 1.4}, False)), [1, 8])["k"] == 0


def test_a_load_the_profile_did_not_measure_is_refused():
    with pytest.raises(vpx.ProfileError, match=r"not at \[8\]"):
        vpx.choose(_profile((1, {1: 1.2}, True)), loads=[1, 8])
    with pytest.raises(vpx.ProfileError, match="at least one"):
        vpx.choose(_profile((1, {1: 1.2}, True)), loads=[])


def test_the_key_changes_with_the_weights_the_target_and_the_host():
    info = {"format": "speculators", "files": {"model.safetensors": {"sha256": "a" * 64}},
            "target": {"fingerprint": "f" * 16}}  # fmt: skip
    host = {"cpu_model": "X", "isa": "avx512", "usable_cpus": 2}
    k = vpx.profile_key(info, host)
    assert k == vpx.profile_key(json.loads(json.dumps(info)), dict(host, torch_threads=7))  # other facts: same key
    assert k != vpx.profile_key({**info, "files": {"model.safetensors": {"sha256": "b" * 64}}}, host)
    assert k != vpx.profile_key({**info, "target": {"fingerprint": "e" * 16}}, host)
    assert k != vpx.profile_key(info, dict(host, isa="avx2"))
    with pytest.raises(vpx.ProfileError, match="no weight digests"):
        vpx.profile_key({"format": "speculators"}, host)


# -- a tiny run's export --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tiny_target_dir):
    return tiny_target_dir  # tests/export/conftest.py


ACC = {"eval/acc_0": 0.9, "eval/cond_acc_0": 0.9, "eval/acc_1": 0.81, "eval/cond_acc_1": 0.9,
       "eval/acc_2": 0.729, "eval/cond_acc_2": 0.9}  # fmt: skip


def _run(tmp_path, target, seed=0):
    torch.manual_seed(seed)
    drafter = build_drafter("medusa", {"num_heads": 3, "draft_vocab_size": 0}, target)
    run = tmp_path / f"run{seed}"
    drafter.save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "tiny", "random_init": True}}))
    (run / "final_metrics.json").write_text(json.dumps(ACC))
    return run


def _export(run, out, tiny_dir, **kw):
    from drafttrain.export import export_run

    return json.loads((export_run(run, output_dir=out, target_path=str(tiny_dir), overwrite=True,
                                  draft_cost_ratio=0.001, **kw) / "export_info.json").read_text())  # fmt: skip


def test_an_export_takes_k_from_the_cached_profile_for_its_own_weights(tmp_path, tiny_target, tiny_dir, monkeypatch):
    from drafttrain.export.verify import verify_export

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    run, out = _run(tmp_path, tiny_target), tmp_path / "out"
    model = _export(run, out, tiny_dir)
    assert "vllm_profile" not in model["speculation"]  # nothing measured yet: the cost model's K
    k_model = model["num_speculative_tokens"]
    k_meas = 1 if k_model != 1 else 2
    vpx.save(_profile((k_meas, {1: 1.12, 8: 1.05}, True), (3, {1: 1.3, 8: 0.9}, True)), model)
    info = _export(run, out, tiny_dir)
    sp = info["speculation"]
    assert info["num_speculative_tokens"] == sp["num_speculative_tokens"] == k_meas and sp["pays"] is True
    assert sp["expected_speedup"] == 1.05 and sp["model"]["num_speculative_tokens"] == k_model
    assert sp["schedule"] is None and sp["chosen_by"].startswith("measured in vLLM")
    last = info["commands"][-1]
    assert f'"num_speculative_tokens": {k_meas}' in last and "measured in vLLM on this host" in last
    assert json.loads((out / "config.json").read_text())["num_heads"] >= k_meas
    verify_export(out, str(tiny_dir))  # the folder written again is whole: its digests match
    # the same weights, the line asked to hold at one request only: the best K there
    assert _export(run, out, tiny_dir, serve_loads=[1])["num_speculative_tokens"] == 3
    # turned off: the cost model again
    assert "vllm_profile" not in _export(run, out, tiny_dir, vllm_profile=False)["speculation"]
    # other weights (another seed) on the same target: the profile is not theirs
    assert "vllm_profile" not in _export(_run(tmp_path, tiny_target, seed=1), tmp_path / "out1", tiny_dir)["speculation"]


def test_a_profile_where_no_k_holds_prints_a_line_that_serves_the_target_alone(tmp_path, tiny_target, tiny_dir,
                                                                                monkeypatch):  # fmt: skip
    from drafttrain.config import ConfigError

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    run, out = _run(tmp_path, tiny_target), tmp_path / "out"
    vpx.save(_profile((1, {1: 1.19, 8: 0.94}, True), (2, {1: 1.1, 8: 0.8}, True)), _export(run, out, tiny_dir))
    info = _export(run, out, tiny_dir)
    sp, last = info["speculation"], info["commands"][-1]
    assert sp["pays"] is False and sp["expected_speedup"] == 1.0
    assert "--speculative-config" not in last and "no K holds at 1 request, 8 requests" in last
    assert "K=1 1.19x at 1, 0.94x at 8" in last and "at 1 alone K=1 measured 1.19x" in last
    (alt,) = info["alternatives"]  # one request at a time: K = 1, as a line to paste
    assert alt["loads"] == [1] and alt["num_speculative_tokens"] == 1 and alt["measured_speedup"] == 1.19
    assert '"num_speculative_tokens": 1' in alt["command"] and "--speculative-config" in alt["command"]
    with pytest.raises(ConfigError, match=r"not at \[16\]"):  # a load the profile did not measure: named
        _export(run, out, tiny_dir, serve_loads=[1, 8, 16])


# -- scripts.serve_check profile_k, vLLM's runner replaced --------------------------------------------------
def test_serve_check_profile_measures_each_k_caches_and_reexports(tmp_path, tiny_target, tiny_dir, monkeypatch):
    import scripts.serve_check as sc

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    run, out = _run(tmp_path, tiny_target), tmp_path / "export"
    _export(run, out, tiny_dir, vllm_profile=False)
    jobs = []

    def fake_vllm(py, job, **kw):  # plain: 10 tok/s at 1, 50 at 8; K = 1 pays at both, K = 2 loses at 8
        jobs.append(job)
        rate = {None: {1: 10.0, 8: 50.0}, 1: {1: 12.0, 8: 52.0}, 2: {1: 14.0, 8: 45.0}}
        outs = [[1, 2, 3]] * len(job["prompts"])
        res = []
        for r in job["runs"]:
            k = (r["speculative_config"] or {}).get("num_speculative_tokens")
            res.append({"vllm_version": "0.32.0", "by_concurrency": [
                {"concurrency": n, "generated": 60, "seconds": 60 / rate[k][n], "outputs": outs,
                 "acceptance": None if k is None else {"mean_acceptance_length": 1.3, "per_position": [0.3] * k}}
                for n in job["concurrency"]]})  # fmt: skip
        return res

    monkeypatch.setattr(sc, "run_vllm", fake_vllm)
    r = sc.run(sc.ServeCheckConfig(export_dir=str(out), profile_k=[2, 1], concurrency=[1, 8], num_prompts=2,
                                   vllm_python=sys.executable, output_dir=str(tmp_path / "sc")))  # fmt: skip
    assert [(x["speculative_config"] or {}).get("num_speculative_tokens") for x in jobs[0]["runs"]] == [None, 1, 2, None]
    assert r["plain_drift"] == {"1": 0.0, "8": 0.0}
    assert all("num_speculative_tokens_per_batch_size" not in (x["speculative_config"] or {}) for x in jobs[0]["runs"])
    assert [row["speedup"] for row in r["rows"]] == [{"1": 1.2, "8": 1.04}, {"1": 1.4, "8": 0.9}]
    assert r["choice"]["k"] == 1 and r["choice"]["best_alone"][1] == [2, 1.4]
    assert json.loads((tmp_path / "sc" / "vllm_profile.json").read_text())["choice"]["k"] == 1
    info = json.loads((out / "export_info.json").read_text())  # written again with the measured K
    assert info["num_speculative_tokens"] == 1 and info["speculation"]["vllm_profile"]["choice"]["k"] == 1
    assert r["printed_line"] == info["commands"][-1] and '"num_speculative_tokens": 1' in r["printed_line"]
    assert "K = 1" in (tmp_path / "sc" / "report.md").read_text()
