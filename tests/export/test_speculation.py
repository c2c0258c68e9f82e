"""Choosing K (drafttrain.export.speculation) and serving it (the export's commands, scripts.serve): the cost
model on synthetic acceptance and costs, the batch-size schedule vLLM takes, a tiny run's export_info.json,
and (where .venv-vllm exists) vLLM's OpenAI server started by scripts.serve answering one request."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from drafttrain.drafters import build_drafter
from drafttrain.export import alternative_label, serve_alternatives, serve_commands, vllm_speculative_config
from drafttrain.export.speculation import (CostModel, SpeculationError, best_k, conditional_acceptance,
                                           expected_speedup, expected_tokens, hold_at_loads, plan, schedule)  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
# a CPU-like target: one input 20 ms, 6 inputs 24 ms (memory-bound), then compute-bound (~1.4 ms per input)
CPU = CostModel(((1.0, 0.020), (6.0, 0.024), (16.0, 0.040), (96.0, 0.150)), "synthetic CPU")


# -- the formulas --------------------------------------------------------------------------------
def test_expected_tokens_is_one_plus_the_surviving_prefixes():
    assert expected_tokens([0.5, 0.5], 2) == 1.75  # 1 + 0.5 + 0.25
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_tokens([0.9, 0.0, 1.0], 3) == pytest.approx(1.9)  # nothing survives position 1
    assert expected_tokens([0.3], 0) == 1.0
    with pytest.raises(SpeculationError, match="in \\[0, 1\\]"):
        expected_tokens([1.5], 1)
    with pytest.raises(SpeculationError, match="needs acceptance for 3 positions"):
        expected_tokens([0.5, 0.5], 3)


def test_speedup_counts_one_pass_for_parallel_drafting_and_k_for_autoregressive():
    flat = CostModel.stated(0.0)
    # E = 1 + 1 + 1 = 3 tokens; parallel: 1 + 0.1 per step, autoregressive: 1 + 2 * 0.1
    assert expected_speedup([1.0, 1.0], 2, flat, "parallel", 0.1) == pytest.approx(3 / 1.1)
    assert expected_speedup([1.0, 1.0], 2, flat, "autoregressive", 0.1) == pytest.approx(3 / 1.2)
    assert expected_speedup([1.0, 1.0], 0, flat, "autoregressive", 0.1) == 1.0


def test_conditional_acceptance_from_run_metrics():
    m = {"eval/acc_0": 0.41, "eval/cond_acc_0": 0.41, "eval/acc_1": 0.13, "eval/cond_acc_1": 0.31,
         "eval/acc_2": 0.02, "train/acc_0": 0.9}  # no cond_acc_2: no group reached position 2  # fmt: skip
    assert conditional_acceptance(m) == [0.41, 0.31, 0.0]
    assert conditional_acceptance({"eval/acc_0": 0.5}) == [0.5]
    assert conditional_acceptance({"train/acc_0": 0.9}) is None


def test_cost_model_interpolates_and_refuses_bad_points():
    assert CPU.target(1) == 0.020 and CPU.target(6) == 0.024
    assert CPU.target(11) == pytest.approx(0.032)  # halfway between 6 and 16
    assert CPU.target(176) == pytest.approx(0.150 + 80 * (0.110 / 80))  # last slope beyond the last point
    noisy = CostModel(((1.0, 2.0), (4.0, 1.0)), "noisy")  # never cheaper with more inputs: the two pooled (the planner's rule)
    assert noisy.target(1) == noisy.target(4) == 1.5
    with pytest.raises(SpeculationError, match="time > 0"):
        CostModel(((1.0, 0.0),), "bad")
    with pytest.raises(SpeculationError, match="gpu_cost_ratio must be >= 0"):
        CostModel.stated(-0.1)


class _FakeHost:
    """A target forward that takes ``batch * inputs`` ms on a fake clock, plus ``spike`` ms on chosen calls
    (another process taking the CPU): what measure_forward_cost times, without wall-clock timing."""

    def __init__(self, spikes=()):
        self.now, self.calls, self.spikes = 0.0, [], set(spikes)

    def clock(self):
        return self.now

    def forward(self, batch, inputs):
        self.calls.append((batch, inputs))
        self.now += batch * inputs * 1e-3 + (0.5 if len(self.calls) in self.spikes else 0.0)


def test_forward_cost_is_the_minimum_of_rounds_over_every_shape(monkeypatch):
    """Each shape's time is the minimum of its repeats (interference only adds time), and the repeats go
    round-robin over the four shapes after one warm-up each, so a host that drifts slows every shape alike."""
    import types

    from drafttrain.export import speculation as spx

    host = _FakeHost(spikes={5, 6, 11})  # the first timed call of two shapes, and one of the second round
    monkeypatch.setattr(spx, "time", types.SimpleNamespace(perf_counter=host.clock, strftime=time.strftime, gmtime=time.gmtime))
    cost = spx.measure_forward_cost(host.forward, 3, big_batch=4, repeats=3)
    shapes = [(1, 1), (1, 4), (4, 1), (4, 4)]
    assert host.calls == shapes + shapes * 3  # warm-ups, then 3 rounds over the shapes in turn
    assert [n for n, _ in cost.points] == [1.0, 4.0, 16.0]  # (1, 4) and (4, 1) are both 4 inputs: their mean
    assert [t for _, t in cost.points] == pytest.approx([1e-3, 4e-3, 16e-3])  # no spike survives the minimum


def test_forward_cost_is_measured_once_per_key_and_cached(monkeypatch, tmp_path):
    """The same host kind and target price K from one table: the second call measures nothing; another key
    measures again; an unreadable cache file is measured again and written over."""
    import types

    from drafttrain.export import speculation as spx

    host = _FakeHost()
    monkeypatch.setattr(spx, "time", types.SimpleNamespace(perf_counter=host.clock, strftime=time.strftime, gmtime=time.gmtime))
    key = {"host": {"cpu_model": "x", "isa": "avx2", "usable_cpus": 2}, "target": "abc"}
    first = spx.cached_forward_cost(host.forward, 2, key, big_batch=4, repeats=2, root=tmp_path)
    n_calls = len(host.calls)
    assert n_calls == 12 and "cached in" in first.source
    (path,) = (tmp_path / spx.COST_DIR).glob("*.json")
    host.now += 1.0
    again = spx.cached_forward_cost(host.forward, 2, key, big_batch=4, repeats=2, root=tmp_path)
    assert len(host.calls) == n_calls and again.points == first.points  # read back, nothing measured
    spx.cached_forward_cost(host.forward, 2, {**key, "target": "other"}, big_batch=4, repeats=2, root=tmp_path)
    assert len(host.calls) == 2 * n_calls and len(list((tmp_path / spx.COST_DIR).glob("*.json"))) == 2
    spx.cached_forward_cost(host.forward, 3, key, big_batch=4, repeats=2, root=tmp_path)  # another K_max: another table
    assert len(host.calls) == 3 * n_calls
    path.write_text("{not json")
    fixed = spx.cached_forward_cost(host.forward, 2, key, big_batch=4, repeats=2, root=tmp_path)
    assert len(host.calls) == 4 * n_calls and json.loads(path.read_text())["points"]
    assert [t for _, t in fixed.points] == pytest.approx([t for _, t in first.points])  # the same host, measured again


# -- choosing K -----------------------------------------------------------------------------------
def test_acceptance_falling_fast_gives_a_small_k():
    """The main job's shape: position 0 often accepted, later ones almost never: K stays at 1-2 of 5."""
    cond = [0.41, 0.31, 0.30, 0.0, 0.0]
    k, s = best_k(cond, CPU, "parallel", 0.07)
    assert k == 2 and s > 1.0
    assert best_k(cond, CPU, "autoregressive", 0.07)[0] == 1  # each extra draft costs a drafter pass
    assert best_k([0.8, 0.05, 0.05, 0.05], CPU, "parallel", 0.07)[0] == 1


def test_all_accepting_cheap_drafter_takes_the_largest_k():
    cond = [1.0] * 6
    assert best_k(cond, CostModel.stated(0.0), "autoregressive", 0.01) == (6, pytest.approx(7 / 1.06))
    assert best_k(cond, CPU, "parallel", 0.01)[0] == 6


def test_nothing_pays_serves_without_speculation(tmp_path):
    p = plan([0.1, 0.05], CPU, "autoregressive", 0.3, 2)
    assert p["pays"] is False and p["expected_speedup"] < 1.0 and p["num_speculative_tokens"] == 1
    assert p["schedule"] == [[1, 256, 0]]  # K = 0 at every batch size
    (tmp_path / "config.json").write_text("{}")
    cmds = serve_commands("vllm_medusa", tmp_path, "/models/t", 1, {}, p, target_dir=str(tmp_path))
    last = cmds[-1]
    assert f"expected {p['expected_speedup']:.2f}x" in last and "serve without speculation on this host" in last
    assert "--speculative-config" not in last and "api_server" in last
    assert "--speculative-config" in cmds[0]  # the GPU form keeps the drafter


def test_a_line_that_cannot_carry_the_schedule_says_up_to_how_many_requests_it_pays(tmp_path):
    """Where the export's schedule drops K to 0 from 6 sequences on, the serve lines say up to how many requests
    speculation pays: parallel drafting takes no batch-size schedule in vLLM 0.32, and an EAGLE-3 chain's
    scheduled K = 0 still runs its drafter; a schedule that never reaches 0 needs no note."""
    spec_block = {"pays": True, "expected_speedup": 1.24, "num_speculative_tokens": 1, "schedule": [[1, 5, 1], [6, 256, 0]]}
    (tmp_path / "config.json").write_text("{}")
    par = serve_commands("speculators", tmp_path, "/models/t", 1, {"speculators_model_type": "peagle"}, spec_block,
                         target_dir=str(tmp_path))  # fmt: skip
    assert "num_speculative_tokens_per_batch_size" not in par[-1] and '"parallel_drafting": true' in par[-1]
    assert "pay up to 5 requests at a time and to lose from 6 on" in par[-1] and "pay up to 5" in par[-2]
    chain = serve_commands("speculators", tmp_path, "/models/t", 1, {}, spec_block, target_dir=str(tmp_path))
    assert "num_speculative_tokens_per_batch_size" in chain[-1]  # the chain carries the schedule, K = 0 included,
    assert "still runs the drafter at a scheduled K = 0" in chain[-1]  # which vLLM 0.32 does not make free
    flat = {**spec_block, "schedule": [[1, 256, 1]]}
    assert "#" not in serve_commands("speculators", tmp_path, "/models/t", 1, {"speculators_model_type": "peagle"}, flat,
                                     target_dir=str(tmp_path))[-1]  # fmt: skip


def test_a_k_that_loses_at_a_serve_load_leaves_the_line_to_the_target_alone(tmp_path):
    """The line runs one K at every batch size, so the cost model's K must pay at every load it serves (the rule a
    measured vLLM profile follows): a schedule that drops K to 0 from 6 on serves the target alone for loads
    [1, 8], with K as the alternative for up to 5 requests; for loads [1, 4] the line keeps K."""
    block = {"pays": True, "expected_speedup": 1.24, "num_speculative_tokens": 1, "chosen_by": "model",
             "schedule": [[1, 5, 1], [6, 256, 0]]}  # fmt: skip
    held = hold_at_loads(block, (1, 8))
    assert held["pays"] is False and held["schedule"] is None and held["num_speculative_tokens"] == 1
    assert held["model"]["schedule"] == block["schedule"] and held["model"]["expected_speedup"] == 1.24
    assert held["predicted_alternative"] == {"loads": [1, 2, 3, 4, 5], "num_speculative_tokens": 1, "expected_speedup": 1.24}
    assert "lose from 6 on" in held["line_note"] and "8 requests in flight" in held["line_note"]
    two = hold_at_loads({**block, "num_speculative_tokens": 2, "speedup_by_k": [1.2, 1.27],
                         "schedule": [[1, 1, 2], [2, 5, 1], [6, 256, 0]]}, (1, 8))  # fmt: skip
    assert two["predicted_alternative"] == {"loads": [1, 2, 3, 4, 5], "num_speculative_tokens": 1, "expected_speedup": 1.2}
    assert two["num_speculative_tokens"] == 2 and "K=1 expected 1.20x with 1" in two["line_note"]  # K=2 pays at 1 only
    assert hold_at_loads(block, (1, 4)) is block and hold_at_loads(block, [5]) is block
    assert hold_at_loads({**block, "schedule": [[1, 256, 1]]}, (1, 8))["pays"] is True  # never 0: K everywhere
    assert hold_at_loads({**block, "pays": False, "schedule": [[1, 256, 0]]}, (1, 8))["pays"] is False
    with pytest.raises(SpeculationError, match="requests in flight"):
        hold_at_loads(block, [0, 8])
    (tmp_path / "config.json").write_text("{}")
    cfg = {"speculators_model_type": "peagle"}
    cmds = serve_commands("speculators", tmp_path, "/models/t", 1, cfg, held, target_dir=str(tmp_path))
    assert "--speculative-config" not in cmds[-1] and held["line_note"] in cmds[-1]
    assert "speculative=false" in cmds[-2] and "--speculative-config" in cmds[1]  # the GPU form keeps the drafter
    (alt,) = serve_alternatives("speculators", tmp_path, cfg, held, str(tmp_path))
    assert alt["loads"] == [1, 2, 3, 4, 5] and '"num_speculative_tokens": 1' in alt["command"]
    assert "--speculative-config" in alt["command"] and alternative_label(alt) == "up to 5 requests"
    assert alternative_label({"loads": [1]}) == "1 request"


# -- the schedule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("drafting", ["parallel", "autoregressive"])
@pytest.mark.parametrize("cond", [[0.41, 0.31, 0.30, 0.0, 0.0], [0.9, 0.8, 0.7, 0.6, 0.5], [1.0] * 5])
def test_schedule_is_contiguous_and_non_increasing(cond, drafting):
    sched = schedule(cond, CPU, drafting, 0.05, 5, max_batch=128)
    assert sched[0][0] == 1 and sched[-1][1] == 128  # vLLM: the first range starts at 1
    assert all(a[1] + 1 == b[0] for a, b in zip(sched, sched[1:]))
    ks = [k for _, _, k in sched]
    assert ks == sorted(ks, reverse=True) and len(set(ks)) == len(ks)
    assert ks[0] == best_k(cond, CPU, drafting, 0.05)[0]
    if min(cond) < 1.0:  # compute-bound at 128 sequences: fewer drafts, down to none
        assert ks[-1] < ks[0]
    else:  # every draft accepted: K + 1 tokens for K + 1 inputs always beats one token for one input
        assert ks == [5]


def test_schedule_goes_into_vllm_config_only_for_methods_that_take_it(tmp_path):
    sp = {"schedule": [[1, 4, 3], [5, 256, 1]]}
    eagle3 = vllm_speculative_config("speculators", tmp_path, 3, {}, sp)
    assert eagle3["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 256, 1]]
    assert eagle3["model"] == str(tmp_path.resolve())
    assert "num_speculative_tokens_per_batch_size" not in vllm_speculative_config("vllm_medusa", tmp_path, 3, {}, sp)
    peagle = vllm_speculative_config("speculators", tmp_path, 3, {"speculators_model_type": "peagle"}, sp)
    assert peagle["parallel_drafting"] is True and "num_speculative_tokens_per_batch_size" not in peagle
    assert "num_speculative_tokens_per_batch_size" not in vllm_speculative_config(
        "speculators", tmp_path, 3, {}, {"schedule": [[1, 256, 3]]})  # one K everywhere: nothing to schedule


# -- a tiny run's export ----------------------------------------------------------------------------
def _run(tmp_path, target, metrics):
    torch.manual_seed(0)
    drafter = build_drafter("medusa", {"num_heads": 4, "draft_vocab_size": 0}, target)
    run = tmp_path / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "tiny", "random_init": True}}))
    if metrics is not None:
        (run / "final_metrics.json").write_text(json.dumps(metrics))
    return run


def test_tiny_run_export_has_the_speculation_block(tmp_path, tiny_target, tiny_target_dir):
    from drafttrain.export import export_run

    acc = {"eval/acc_0": 0.6, "eval/cond_acc_0": 0.6, "eval/acc_1": 0.3, "eval/cond_acc_1": 0.5,
           "eval/acc_2": 0.05, "eval/cond_acc_2": 0.1, "eval/acc_3": 0.01, "eval/cond_acc_3": 0.0}  # fmt: skip
    out = export_run(_run(tmp_path, tiny_target, acc), output_dir=tmp_path / "out", target_path=str(tiny_target_dir),
                     draft_cost_ratio=0.01)  # fmt: skip
    info = json.loads((out / "export_info.json").read_text())
    sp = info["speculation"]
    assert sp["cost"]["draft_cost_ratio"] == 0.01 and sp["cost"]["draft_cost_source"] == "stated: draft_cost_ratio"
    assert sp["acceptance"]["cond_acc"] == [0.6, 0.5, 0.1, 0.0]
    assert sp["cost"]["target_source"].startswith("measured on this host")
    assert len(sp["cost"]["target_forward"]) == 4 and all(t > 0 for _, t in sp["cost"]["target_forward"])
    assert sp["num_speculative_tokens"] == info["num_speculative_tokens"] in (1, 2, 3)  # never 4: cond_acc_3 = 0
    assert sp["speedup_by_k"][sp["num_speculative_tokens"] - 1] == max(sp["speedup_by_k"])
    ks = [k for _, _, k in sp["schedule"]]
    assert ks == sorted(ks, reverse=True)
    last = info["commands"][-1]
    assert last.startswith("VLLM_CPU_OMP_THREADS_BIND=") and "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in last
    assert "-m vllm.entrypoints.openai.api_server" in last and "--enforce-eager" in last
    assert f"--model {tiny_target_dir.resolve()}" in last
    if sp["pays"]:
        assert f'"num_speculative_tokens": {sp["num_speculative_tokens"]}' in last and str(out.resolve()) in last
    else:
        assert "serve without speculation on this host" in last
    assert any(c.startswith("vllm serve ") and "--speculative-config" in c for c in info["commands"])
    assert any("-m scripts.serve checkpoint=" in c for c in info["commands"])


def test_export_without_held_out_acceptance_keeps_the_depth(tmp_path, tiny_target, tiny_target_dir):
    from drafttrain.export import export_run

    out = export_run(_run(tmp_path, tiny_target, None), output_dir=tmp_path / "out", target_path=str(tiny_target_dir))
    info = json.loads((out / "export_info.json").read_text())
    assert info["num_speculative_tokens"] == 4 and info["speculation"]["pays"] is None
    assert "no held-out acceptance" in info["speculation"]["chosen_by"]


def test_hopeless_drafter_export_says_serve_without_speculation(tmp_path, tiny_target, tiny_target_dir):
    from drafttrain.export import export_run

    acc = {"eval/acc_0": 0.01, "eval/cond_acc_0": 0.01}
    out = export_run(_run(tmp_path, tiny_target, acc), output_dir=tmp_path / "out", target_path=str(tiny_target_dir),
                     draft_cost_ratio=0.5)  # fmt: skip
    info = json.loads((out / "export_info.json").read_text())
    assert info["speculation"]["pays"] is False
    assert "serve without speculation on this host" in info["commands"][-1]
    assert "--speculative-config" not in info["commands"][-1]


def test_tiny_run_export_holds_the_models_k_to_the_serve_loads(tmp_path, tiny_target, tiny_target_dir):
    """A stated cost that grows with the inputs (each input 0.2 of a one-input forward): K pays at batch 1 and
    loses before 8 sequences, so the line for [1, 8] requests in flight serves the target alone and the export
    records K as the alternative for fewer; for [1, 2] the line speculates; a K the user gives is served as given."""
    from drafttrain.export import export_run

    acc = {"eval/acc_0": 0.6, "eval/cond_acc_0": 0.6, "eval/acc_1": 0.3, "eval/cond_acc_1": 0.5}
    run = _run(tmp_path, tiny_target, acc)
    kw = {"target_path": str(tiny_target_dir), "gpu_cost_ratio": 0.2, "draft_cost_ratio": 0.01}
    info = json.loads((export_run(run, output_dir=tmp_path / "a", **kw) / "export_info.json").read_text())
    sp = info["speculation"]
    zero = next(lo for lo, _hi, k in sp["model"]["schedule"] if k == 0)
    assert 1 < zero <= 8 and sp["pays"] is False and sp["model"]["pays"] is True
    assert "--speculative-config" not in info["commands"][-1] and f"lose from {zero} on" in info["commands"][-1]
    (alt,) = info["alternatives"]
    k_alt = [k for lo, _hi, k in sp["model"]["schedule"] if lo < zero][-1]
    assert alt["loads"] == list(range(1, zero)) and alt["num_speculative_tokens"] == k_alt
    assert f'"num_speculative_tokens": {alt["num_speculative_tokens"]}' in alt["command"]
    few = json.loads((export_run(run, output_dir=tmp_path / "b", serve_loads=[1, 2], **kw) / "export_info.json").read_text())
    assert few["speculation"]["pays"] is True and "--speculative-config" in few["commands"][-1] and not few.get("alternatives")
    given = json.loads((export_run(run, output_dir=tmp_path / "c", num_speculative_tokens=1, **kw) / "export_info.json").read_text())
    assert "model" not in given["speculation"] and "--speculative-config" in given["commands"][-1]


# -- scripts.serve --------------------------------------------------------------------------------
def test_serve_command_from_an_export(tmp_path, tiny_target, tiny_target_dir, capsys):
    from drafttrain.config import ConfigError
    from drafttrain.export import export_run
    from scripts.serve import main

    run = _run(tmp_path, tiny_target, None)
    export_run(run, output_dir=run / "export", target_path=str(tiny_target_dir))
    with pytest.raises(ConfigError, match="install_vllm"):
        main([f"checkpoint={run}", "vllm_python=/nonexistent/python", "dry_run=true"])
    with pytest.raises(ConfigError, match="export it first"):
        main([f"checkpoint={tmp_path}", "dry_run=true"])
    main([f"checkpoint={run}", f"vllm_python={sys.executable}", "port=8123", "dry_run=true"])
    line = capsys.readouterr().out
    assert "--port 8123" in line and "--host 127.0.0.1" in line and '"method": "medusa"' in line
    assert f"--model {tiny_target_dir.resolve()}" in line and "VLLM_CPU_KVCACHE_SPACE=4" in line
    main([f"checkpoint={run}", f"vllm_python={sys.executable}", "speculative=false", "dry_run=true"])
    assert "--speculative-config" not in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)  # one engine start-up: about a minute on 2 idle cores, far more on a loaded machine
def test_scripts_serve_answers_a_completion(tmp_path):
    """scripts.serve starts vLLM's OpenAI server on an exported EAGLE-3 drafter of a tiny target (8 layers,
    head_dim 32, which vLLM's CPU attention takes) on 127.0.0.1, it answers one completions request, and it
    stops with its whole process group. Skipped without .venv-vllm (CI's fresh clone)."""
    from drafttrain.config import TargetConfig
    from drafttrain.export import export_run
    from drafttrain.generation.vllm_client import vllm_python
    from drafttrain.target import load_target

    if vllm_python() is None:
        pytest.skip("vLLM is not installed: bash scripts/install_vllm.sh (a second venv, .venv-vllm)")
    target = load_target(TargetConfig(random_init=True, num_hidden_layers=8, num_attention_heads=2,
                                      num_key_value_heads=1))  # fmt: skip
    tdir = tmp_path / "target"
    target.model.save_pretrained(tdir)
    target.tokenizer.save_pretrained(tdir)
    torch.manual_seed(0)
    run = tmp_path / "run"
    drafter = build_drafter("eagle3", {"draft_vocab_size": 300}, target)
    drafter.set_draft_vocab(torch.randperm(drafter.vocab_size, generator=torch.Generator().manual_seed(0))[:300])
    drafter.save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "deep", "path": str(tdir)}}))
    # held-out acceptance and a stated cost that give a schedule of K = 3 falling to 0 (what vLLM must accept)
    (run / "final_metrics.json").write_text(json.dumps({"eval/acc_0": 0.9, "eval/cond_acc_0": 0.9, "eval/acc_1": 0.72,
                                                        "eval/cond_acc_1": 0.8, "eval/acc_2": 0.5, "eval/cond_acc_2": 0.7}))
    out = export_run(run, output_dir=run / "export", gpu_cost_ratio=0.05, draft_cost_ratio=0.05)
    sp = json.loads((out / "export_info.json").read_text())["speculation"]
    assert sp["num_speculative_tokens"] == 3 and sp["schedule"] == [[1, 6, 3], [7, 24, 2], [25, 107, 1], [108, 256, 0]]
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "scripts.serve", f"checkpoint={run}", f"port={port}",
                             "kv_cache_gb=1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        while True:  # until the server answers or exits; the timeout mark bounds a hang
            assert proc.poll() is None, "server exited:\n" + (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                    model = json.loads(r.read())["data"][0]["id"]
                break
            except OSError:
                time.sleep(3)
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            res = json.loads(r.read())
        assert res["choices"][0]["finish_reason"] in ("length", "stop") and res["usage"]["completion_tokens"] >= 1
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:  # Prometheus counters: it drafted
            drafted = [float(line.split()[-1]) for line in r.read().decode().splitlines()
                       if line.startswith("vllm:spec_decode_num_draft_tokens_total")]  # fmt: skip
        assert drafted and sum(drafted) > 0
        printed = (tmp_path / "serve.log").read_text()  # the command it ran, then vLLM's log
        assert '"method": "eagle3"' in printed and '"num_speculative_tokens_per_batch_size": [[1, 6, 3]' in printed
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_bad_cost_is_refused_before_anything_is_written(tmp_path, tiny_target, tiny_target_dir):
    from drafttrain.config import ConfigError
    from drafttrain.export import export_run

    run = _run(tmp_path, tiny_target, {"eval/acc_0": 0.5, "eval/cond_acc_0": 0.5})
    with pytest.raises(ConfigError, match="speculation: gpu_cost_ratio must be >= 0"):
        export_run(run, output_dir=tmp_path / "out", target_path=str(tiny_target_dir), gpu_cost_ratio=-1.0)
    assert not (tmp_path / "out").exists()
    (run / "final_metrics.json").write_text(json.dumps({"eval/acc_0": 1.5}))
    with pytest.raises(ConfigError, match="acceptance rates must lie in \\[0, 1\\]"):
        export_run(run, output_dir=tmp_path / "out", target_path=str(tiny_target_dir))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_vllm_follows_the_schedule_losslessly(tmp_path):
    """vLLM 0.32 (CPU) takes the export's batch-size schedule for an EAGLE-3 chain: at batch 1 it drafts the
    scheduled K = 1 (one draft token per draft, not the maximum 3) and its output equals plain decoding."""
    from drafttrain.config import TargetConfig
    from drafttrain.export import export_drafter
    from drafttrain.generation.vllm_client import vllm_python
    from drafttrain.target import load_target
    from scripts.serve_check import run_vllm

    py = vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed: bash scripts/install_vllm.sh (a second venv, .venv-vllm)")
    target = load_target(TargetConfig(random_init=True, num_hidden_layers=8, num_attention_heads=2,
                                      num_key_value_heads=1))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # varied weights: greedy continuations change at every step
        for p in target.model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    tdir = tmp_path / "target"
    target.model.save_pretrained(tdir)
    target.tokenizer.save_pretrained(tdir)
    torch.manual_seed(0)
    drafter = build_drafter("eagle3", {"draft_vocab_size": 300}, target)
    drafter.set_draft_vocab(torch.randperm(drafter.vocab_size, generator=torch.Generator().manual_seed(0))[:300])
    _, cfg = export_drafter(drafter, "speculators", tmp_path / "d", verifier=str(tdir), num_speculative_tokens=3,
                            target_config=target.config)  # fmt: skip
    spec = vllm_speculative_config("speculators", tmp_path / "d", 3, cfg, {"schedule": [[1, 1, 1], [2, 256, 0]]})
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 1], [2, 256, 0]]
    prompt = torch.randint(3, 49152, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    job = {"model": str(tdir), "prompts": [prompt], "max_new_tokens": 16, "stop_token_ids": [], "max_model_len": 256,
           "max_num_seqs": 1, "eager": True, "runs": [{"speculative_config": None}, {"speculative_config": spec}]}  # fmt: skip
    plain, sched = run_vllm(py, job, threads=None, memory_gb=1, timeout_s=1500, log_path=tmp_path / "vllm.log")
    assert "error" not in plain and "error" not in sched, sched.get("error") or plain.get("error")
    assert sched["outputs"] == plain["outputs"] and len(plain["outputs"][0]) == 16
    acc = sched["acceptance"]
    assert acc["num_drafts"] > 0 and acc["num_draft_tokens"] == acc["num_drafts"]  # K = 1 per step, not 3
