"""Runs of the real training CLI (`accelerate launch train.py +recipe=NAME target=tiny ...`).

Slow (subprocesses, ~3 min in all): run with `pytest -m slow`. Seven short training runs (ParallelSpec:
3 steps, resume pair; every other recipe: 3 steps) share one self-distilled data cache; each assertion
reuses them through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FAST = [
    "data.max_conversations=24",
    "data.generation.max_new_tokens=16",
    "data.heldout=4",
    "trainer.spec_eval.num_prompts=2",
    "trainer.spec_eval.max_new_tokens=16",
    "trainer.log_every=1",
    "trainer.progress=false",
    "trainer.num_threads=1",  # tiny model: one thread is fastest on a shared machine
    "trainer.mixed_precision=no",  # fp32: stored losses must not depend on the CPU's bf16 support
    "trainer.micro_batch_size=4",
]
# train/loss of steps 1..3 of the runs below, computed once (2026-11-22, refreshed when the defaults became
# drafter.draft_vocab_size=8192, optim.lr=2e-3 and drafter.kd_weight=0.5; 2026-11-23: draft_vocab_size=4096) with data.generation.max_prompt_length=256,
# length-sorted self-distillation shards and trainer.length_group_steps=8. Identical on CI's machine.
# The loss, data, batch order or init must not change by accident; refresh these on a deliberate change.
# 2026-11-28: the main job's recipe became parallel drafting on the EAGLE-3 network (drafter parallelspec_eagle3,
# draft vocabulary 4096, anchor_ratio 0.25); the Medusa integration's losses above moved to parallelspec_medusa.
GOLDEN_LOSSES = [0.09410995244979858, 0.0898701399564743, 0.07994186878204346]
MAIN_DRAFTER = "parallelspec_eagle3"  # the drafter +recipe=parallelspec trains
# The same for the other recipes (2026-11-22, their conf/drafter defaults, same data and FAST overrides).
GOLDEN_RECIPE_LOSSES = {
    "parallelspec_medusa": [27.459856033325195, 27.40342903137207, 27.30829429626465],  # the main job's until 2026-11-28
    "medusa": [20.190168380737305, 20.144073486328125, 20.084369659423828],
    "eagle": [0.898781955242157, 0.8964788913726807, 0.8942158818244934],
    "parallelspec_eagle": [7.122628688812256, 7.091139793395996, 7.018370628356934],
    "eagle3": [0.039045050740242004, 0.03446616232395172, 0.027663584798574448],  # 2026-11-23
    "parallelspec_eagle3": [0.08770451694726944, 0.08720448613166809, 0.07591267675161362],  # 2026-11-23
}
# tensors named like the target's head / final norm that are the drafter's own (EAGLE-3: own norm + N-row head)
OWN_HEAD = {"eagle3": {"lm_head.weight", "norm.weight"}, "parallelspec_eagle3": {"lm_head.weight", "norm.weight"}}
# parameters every recipe's drafter must train (besides the decoder layer / head internals)
KEY_PARAMS = {
    "parallelspec": {"fc.weight", "mask_embed"},
    "parallelspec_eagle": {"fc.weight", "mask_embed"},
    "eagle": {"fc.weight", "layer.self_attn.q_proj.weight"},
    "eagle3": {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight", "lm_head.weight"},
    "parallelspec_eagle3": {"fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "mask_hidden"},
    "medusa": {"heads.0.res.weight", "heads.0.out.weight", "heads.3.out.weight"},
}


def launch(*overrides: str, recipe: str = "parallelspec", timeout: int = 300) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI from the repo root; returns (completed process, seconds)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml",
           "train.py", f"+recipe={recipe}", "target=tiny", *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.time() - t0


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_rows(run_dir: Path) -> dict[int, dict]:
    """step -> the logged training metrics of that step (the final eval line has no train/loss)."""
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def train(run_dir: Path, data_cache: Path, *overrides: str, recipe: str = "parallelspec") -> subprocess.CompletedProcess:
    proc, _ = launch(*FAST, f"data.cache_dir={data_cache}", f"output_dir={run_dir}", *overrides, recipe=recipe)
    assert proc.returncode == 0, output(proc)[-6000:]
    return proc


@pytest.fixture(scope="module")
def run3(tmp_path_factory, data_cache):
    run_dir = tmp_path_factory.mktemp("run3") / "run"
    proc = train(run_dir, data_cache, "trainer.max_steps=3")
    return run_dir, proc


@pytest.fixture(scope="module", params=sorted(GOLDEN_RECIPE_LOSSES))
def recipe_run3(request, tmp_path_factory, data_cache):
    """A 3-step run of every other recipe on the same data (one at a time: module-scoped parameter)."""
    run_dir = tmp_path_factory.mktemp(f"run3_{request.param}") / "run"
    proc = train(run_dir, data_cache, "trainer.max_steps=3", recipe=request.param)
    return request.param, run_dir, proc


def launch_killed(run_dir: Path, data_cache: Path, fault: str, *overrides: str) -> subprocess.CompletedProcess:
    """A training launch that SIGKILLs itself at ``fault`` (``DRAFTTRAIN_FAULT``, :func:`drafttrain.train.fault_point`)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml", "train.py",
           "+recipe=parallelspec", "target=tiny", *FAST, f"data.cache_dir={data_cache}", f"output_dir={run_dir}",
           *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "DRAFTTRAIN_FAULT": fault}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"SIGKILL at {fault}" in output(proc), output(proc)[-4000:]
    return proc


SIX = ("trainer.max_steps=6", "trainer.save_every=2")


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, data_cache):
    """Run A: 6 steps, never interrupted. Run B: the same job, SIGKILLed three times and resumed each time:

    1. while the step-4 checkpoint is being written (state saved, no marker): resumes from step 2;
    2. in the middle of step 5 (after backward, before the optimizer step): resumes from step 4;
    3. right after the final (step-6) checkpoint became COMPLETE, before ``drafter/`` and
       ``final_metrics.json``: resumes from step 6 and only finishes.

    Returns (A, B, {what: the state of B right after that kill / the relaunch's output}).
    """
    root = tmp_path_factory.mktemp("resume")
    a, b = root / "A", root / "B"
    train(a, data_cache, *SIX)
    seen = {}
    launch_killed(b, data_cache, "checkpoint@4", *SIX)
    seen["after_kill_1"] = sorted(p.name for p in (b / "checkpoints").iterdir())
    seen["log_2"] = output(launch_killed(b, data_cache, "step@5", *SIX, "resume=true"))
    seen["log_3"] = output(launch_killed(b, data_cache, "complete@6", *SIX, "resume=true"))
    seen["after_kill_3"] = (sorted(p.name for p in (b / "checkpoints").iterdir()),
                            (b / "drafter").exists(), (b / "final_metrics.json").exists())  # fmt: skip
    seen["log_4"] = output(train(b, data_cache, *SIX, "resume=true"))
    return a, b, seen


# ---------------------------------------------------------------- a short run


def test_short_run_logs_metrics(run3):
    run_dir, proc = run3
    rows = train_rows(run_dir)
    assert sorted(rows) == [1, 2, 3]
    for step, r in rows.items():
        for key in ("train/loss", "train/tau_sim", "train/acc_0", "train/lr", "train/samples"):
            assert key in r, (step, key)
        assert r["train/samples"] == 4 * step  # micro batch 4, one process
    assert [rows[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(GOLDEN_LOSSES, rel=1e-4)
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert final["step"] == 3
    assert final["eval/tau"] >= 1
    assert final["eval/greedy_equal"] is True
    assert "eval/tau_sim" in final
    # speedup at the eval batch size (16, planned) and at batch 1 (first prompts, one at a time)
    assert final["eval/batch_size"] == 16 and final["eval/latency_prompts"] == 2  # both prompts, one at a time
    assert final["eval/prompts_b1"] == final["eval/prompts"].split(" ids ")[1]  # the ids of those two prompts
    assert final["eval/speedup_b16"] == final["eval/speedup"] > 0 and final["eval/speedup_b1"] > 0
    assert final["eval/spec_tokens_per_s_b1"] > 0 and final["eval/plain_tokens_per_s_b1"] > 0
    line = next(x for x in output(proc).splitlines() if x.startswith("[drafttrain] eval: tau"))
    assert "batch 1: " in line and "batch 16: " in line and "every output equal to plain greedy" in line
    assert final["eval/speedup_decode_b16"] > 0 and final["eval/speedup_decode_b1"] > 0  # prompt forwards left out
    assert "decoding steps alone" in line
    for b in (1, 16):  # the planner's counters of both planned runs, for reading a speedup afterwards
        assert final[f"eval/planner_b{b}"]["steps"] > 0 and "calibration" in final[f"eval/planner_b{b}"]


def test_short_run_checkpoint_and_wandb(run3):
    run_dir, _ = run3
    ck = run_dir / "checkpoints" / "step_0000003"
    assert (ck / "COMPLETE").is_file()
    assert (ck / "drafter" / "drafter.safetensors").is_file()
    assert (ck / "config.json").is_file()
    saved_cfg = json.loads((ck / "config.json").read_text())
    assert saved_cfg["drafter"]["name"] == MAIN_DRAFTER and saved_cfg["trainer"]["max_steps"] == 3
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["git_sha"] and meta["step"] == 3 and meta["samples"] == 12
    if (REPO / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", meta["git_sha"]), meta["git_sha"]
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline W&B run"


def test_short_run_trained_the_drafter_only(run3):
    """The main job's run: see :func:`check_trained_drafter_only`; its draft layer's MLP and output projection
    (the weights that carry over to the Llama-style layer) started as the target's last layer's and moved by
    training only."""
    run_dir, _ = run3
    trained, init, target = check_trained_drafter_only(run_dir, MAIN_DRAFTER)
    layer = {f"layers.0.{k}": v for k, v in target.last_layer.state_dict().items()
             if k.startswith(("mlp.", "self_attn.o_proj."))}  # fmt: skip
    assert layer and max((trained[k] - v).abs().max().item() for k, v in layer.items()) < 1e-3
    assert all(torch.equal(init[k], v) for k, v in layer.items())


def check_trained_drafter_only(run_dir: Path, recipe: str):
    """The drafter's weights moved away from their initial values (rebuilt here: the tiny target, the
    draft vocabulary and the drafter init are deterministic from seed 0), by no more than a few warm-up
    Adam steps; the checkpoints hold no target tensor (the shared embedding / norm / LM head are never
    saved). Returns (trained state, initial state, target)."""
    from safetensors.torch import load_file

    from drafttrain.validation import validate
    from drafttrain.data.pipeline import LocalProcess, prepare_data
    from drafttrain.data.vocab import frequent_tokens
    from drafttrain.drafters import build_drafter, drafter_config
    from drafttrain.target import load_target

    ck = run_dir / "checkpoints" / "step_0000003"
    trained = load_file(str(ck / "drafter" / "drafter.safetensors"))
    for f in (ck / "drafter" / "drafter.safetensors", ck / "model.safetensors"):
        keys = list(load_file(str(f)))
        own = OWN_HEAD.get(recipe, set())  # EAGLE-3's own norm + draft-vocabulary head, not the target's
        assert not [k for k in keys if "embed_tokens" in k or k.startswith("model.")
                    or (("lm_head" in k or k.startswith("norm")) and k not in own)]  # fmt: skip

    c = validate(json.loads((ck / "config.json").read_text()))
    assert c.drafter.name == recipe
    target = load_target(c.target)  # seeds itself: same weights (and RNG state for the drafter init) as in the run
    drafter = build_drafter(recipe, drafter_config(recipe, json.loads((ck / "config.json").read_text())["drafter"]), target)
    if c.drafter.draft_vocab_size:
        train_ds, _ = prepare_data(c, target, LocalProcess())
        drafter.set_draft_vocab(frequent_tokens(train_ds, c.drafter.draft_vocab_size, target.lm_head.weight.shape[0])[0])
    init = drafter.state_dict()
    assert trained.keys() == init.keys()
    assert torch.equal(trained["d2t"], init["d2t"]) if "d2t" in init else True
    assert torch.equal(trained["t2d"], init["t2d"]) if "t2d" in init else True
    params = [name for name, p in drafter.named_parameters() if p.requires_grad]
    assert KEY_PARAMS[recipe] <= set(params)
    for k in params:
        diff = (trained[k] - init[k]).abs().max().item()
        # 3 warm-up steps at lr <= 1e-4: Adam moves each weight by < 3e-4; a wrong init would differ by ~1e-2
        assert 0 < diff < 1e-3, (k, diff)
    return trained, init, target


# ---------------------------------------------------------------- every other recipe


def test_recipe_short_run(recipe_run3):
    """Every recipe trains through the same loop: same metrics, stored first losses, checkpoint format,
    weights changed (drafter) / not saved (target), greedy speculative output equal to plain greedy."""
    recipe, run_dir, _ = recipe_run3
    rows = train_rows(run_dir)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        for key in ("train/loss", "train/tau_sim", "train/acc_0", "train/cond_acc_1", "train/seq_tokens_per_s"):
            assert key in r, (recipe, key)
    assert [rows[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(GOLDEN_RECIPE_LOSSES[recipe], rel=1e-4)
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert final["step"] == 3 and final["eval/greedy_equal"] is True and final["eval/tau"] >= 1
    assert "eval/tau_sim" in final and final["peak_memory_mb"] > 0
    trained, _, target = check_trained_drafter_only(run_dir, {"parallelspec_medusa": "parallelspec"}.get(recipe, recipe))
    if recipe == "medusa":  # every head's W started as the target head's draft rows and moved a little
        rows_w = target.lm_head.weight[trained["d2t"] + torch.arange(trained["d2t"].numel())]  # offsets -> ids
        assert max((trained[f"heads.{k}.out.weight"] - rows_w).abs().max().item() for k in range(4)) < 1e-3


# ---------------------------------------------------------------- resume


def test_kill_9_and_resume_equals_the_uninterrupted_run(resume_runs):
    """SIGKILLed mid-step, mid-checkpoint and right after COMPLETE, then resumed: the same per-step loss,
    lr and data position as the run that was never interrupted, each step logged once (no truncation
    of metrics.jsonl by the test: the resumed run itself cuts it back to its checkpoint), and the same
    final drafter weights."""
    from safetensors.torch import load_file

    a, b, seen = resume_runs
    assert seen["after_kill_1"] == [".tmp_step_0000004", "step_0000002"]  # the interrupted save left no step_4
    assert re.search(r"resumed from \S*step_0000002 at step 2", seen["log_2"]), seen["log_2"][-3000:]
    assert "removed an incomplete checkpoint folder" in seen["log_2"]
    assert re.search(r"resumed from \S*step_0000004 at step 4", seen["log_3"]), seen["log_3"][-3000:]
    # killed before the old step_2 was pruned and before drafter/ and final_metrics.json were written
    assert seen["after_kill_3"] == (["step_0000002", "step_0000004", "step_0000006"], False, False)
    assert re.search(r"resumed from \S*step_0000006 at step 6", seen["log_4"]), seen["log_4"][-3000:]

    rows_a, rows_b = read_metrics(a), read_metrics(b)
    steps_b = [r["step"] for r in rows_b if "train/loss" in r]
    assert steps_b == [1, 2, 3, 4, 5, 6]  # each step once
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a]  # and every other row (final eval) once
    ra, rb = train_rows(a), train_rows(b)
    for step in range(1, 7):
        for key in ("train/loss", "train/lr", "train/samples"):
            assert rb[step][key] == pytest.approx(ra[step][key], rel=1e-6, abs=0), (step, key)
    assert [ra[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(GOLDEN_LOSSES, rel=1e-4)
    wa, wb = load_file(str(a / "drafter" / "drafter.safetensors")), load_file(str(b / "drafter" / "drafter.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=0, msg=k)
    assert json.loads((b / "final_metrics.json").read_text())["step"] == 6
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_0000004", "step_0000006"]
    assert not list(b.glob(".tmp_*")) and not list(b.glob(".old_*"))


def test_resumed_run_is_one_wandb_run(resume_runs):
    """Every launch of the killed-and-resumed run B logs to the same W&B run id (offline: one folder per
    launch, all named with that id); run A has its own."""
    a, b, _ = resume_runs
    ids_b = {p.name.rsplit("-", 1)[-1] for p in (b / "wandb").glob("offline-run-*")}
    ids_a = {p.name.rsplit("-", 1)[-1] for p in (a / "wandb").glob("offline-run-*")}
    assert len(list((b / "wandb").glob("offline-run-*"))) == 4
    assert ids_b == {(b / "wandb_run_id").read_text().strip()}
    assert len(ids_a) == 1 and ids_a != ids_b


# ---------------------------------------------------------------- config errors fail fast


@pytest.mark.parametrize("override", ["drafter.num_mask_tokes=3", "+drafter.num_mask_tokes=3"])
def test_typo_fails_before_loading_anything(override, tmp_path):
    """A typo'd key (plain override: Hydra refuses it; '+' append: our schema refuses it) exits non-zero
    naming the key before any model or data is loaded (no model load in the log, no cache written)."""
    proc, seconds = launch(f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", override)
    text = output(proc)
    assert proc.returncode != 0
    assert "num_mask_tokes" in text
    assert "Loading weights" not in text
    assert "self-distill" not in text.lower()
    assert not (tmp_path / "cache").exists()
