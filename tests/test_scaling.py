"""The training CLI across world sizes: 2 CPU processes (gloo) with DDP, DeepSpeed ZeRO-2 and ZeRO-3
through `accelerate launch`, against 1 process with the same global batch.

Why the reference is 1 process x 2 accumulated micro-batches of 2 (global batch 4) rather than one
micro-batch of 4: the loss of a micro-batch is a mean over its own slots, and DDP/DeepSpeed average
the per-rank gradients, so 2 ranks x 2 sequences optimise exactly the mean of two micro-batch means,
which is what accumulation over 2 micro-batches of 2 optimises. The loop feeds micro-batch
m x world + rank the same samples and anchors in both layouts, so the runs must agree to float
round-off of the gradient all-reduce (tolerance 1e-5 relative; measured: equal to ~1e-8).

Slow (subprocesses: 7 launches, ~3-5 min in all on 2 shared cores): `pytest -m slow tests/test_scaling.py`. The runs
share one self-distilled data cache and are reused through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_cli import FAST, output, read_metrics, train_rows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = [o for o in FAST if not o.startswith("trainer.micro_batch_size")] + ["trainer.micro_batch_size=2"]
STEPS = ("trainer.max_steps=4", "trainer.save_every=2", "trainer.spec_eval.every=2")
REL = 1e-5  # stated tolerance: 2 processes vs 1 process with the same global batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(preset: str, *overrides: str, launcher_args: tuple[str, ...] = (), timeout: int = 400):
    """Start `accelerate launch --config_file conf/accelerate/PRESET.yaml train.py ...` (not waited for)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"conf/accelerate/{preset}.yaml",
           *launcher_args, "train.py", "+recipe=parallelspec", "target=tiny", *TINY, *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(preset: str, run_dir: Path, cache: Path, *overrides: str, launcher_args: tuple[str, ...] = ()) -> str:
    """Launch, wait, assert success; returns the combined log."""
    if preset != "cpu":
        launcher_args = ("--main_process_port", str(free_port()), *launcher_args)
    proc = launch(preset, f"data.cache_dir={cache}", f"output_dir={run_dir}", *overrides, launcher_args=launcher_args)
    log, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, log[-6000:]
    return log


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("scaling_cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """Run folders: 'ref' (1 process, 2 accumulated micro-batches of 2), 'rank0' (1 process, one
    micro-batch of 2, 1 step: rank 0's share of step 1 alone), 'ddp', 'zero2', 'zero3' (2 processes,
    one micro-batch of 2 each)."""
    root = tmp_path_factory.mktemp("scaling")
    out = {"ref": root / "ref"}
    run("cpu", out["ref"], cache, *STEPS, "trainer.grad_accum_steps=2")  # builds the data cache first
    out["rank0"] = root / "rank0"
    # same training rows (held-out split unchanged) and the same length-sorted order: the sort groups
    # length_group_steps x (global batch) samples, so 16 steps of 2 = 8 steps of 4
    run("cpu", out["rank0"], cache, "trainer.max_steps=1", "trainer.spec_eval.num_prompts=0",
        "trainer.length_group_steps=16")
    for preset, name in (("cpu_ddp", "ddp"), ("zero2", "zero2"), ("zero3", "zero3")):
        out[name] = root / name
        run(preset, out[name], cache, *STEPS)
    return out


def per_step(run_dir: Path) -> dict[int, dict]:
    """step -> every metric logged at that step (training, held-out and speculative eval rows merged)."""
    merged: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        merged.setdefault(row["step"], {}).update(row)
    return merged


# ---------------------------------------------------------------- same numbers as one process


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_two_processes_match_one_process(runs, name):
    """Losses, learning rate, gradient norm and every acceptance metric of steps 1-4, the held-out
    metrics and the trained weights equal the 1-process run with the same global batch."""
    ref, got = train_rows(runs["ref"]), train_rows(runs[name])
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        assert got[step]["train/samples"] == ref[step]["train/samples"] == 4 * step
        assert got[step]["train/lr"] == pytest.approx(ref[step]["train/lr"], rel=1e-12), step  # schedule steps once
        keys = [k for k in ref[step]
                if k.startswith(("train/loss", "train/kl_", "train/acc_", "train/cond_acc_", "train/tau_sim"))]  # fmt: skip
        assert len(keys) > 10
        for k in keys + ["train/grad_norm"]:
            assert got[step][k] == pytest.approx(ref[step][k], rel=REL, abs=1e-7), (step, k)
    final_ref, final = (json.loads((runs[n] / "final_metrics.json").read_text()) for n in ("ref", name))
    for k in [k for k in final_ref if k.startswith("eval/") and isinstance(final_ref[k], float)]:
        # wall clock; and the planned runs' tau (eval/tau_planned, eval/tau_b1), which follows the planner's
        # choices from measured forward times
        if "speedup" not in k and "tokens_per_s" not in k and k not in ("eval/tau_planned", "eval/tau_b1"):
            assert final[k] == pytest.approx(final_ref[k], rel=REL, abs=1e-7), k
    assert final["eval/greedy_equal"] is True
    from safetensors.torch import load_file

    w_ref = load_file(str(runs["ref"] / "drafter" / "drafter.safetensors"))
    w = load_file(str(runs[name] / "drafter" / "drafter.safetensors"))  # ZeRO-3: gathered from 2 shards
    assert w.keys() == w_ref.keys()
    for k in w_ref:
        assert w[k].shape == w_ref[k].shape, k
        assert (w[k].double() - w_ref[k].double()).abs().max() < 1e-6, k


def test_metrics_are_reduced_across_ranks(runs):
    """Step 1's acceptance metrics of 2 processes are those of all 4 samples (the 1-process run), not
    those of rank 0's 2 samples (a 1-process run that saw only them), which differ."""
    keys = ("train/tau_sim", "train/acc_0", "train/kl_0", "train/kl_1")  # the main job's drafter logs its KL per position
    rank0 = train_rows(runs["rank0"])[1]
    for name in ("ddp", "zero3"):
        got, ref = train_rows(runs[name])[1], train_rows(runs["ref"])[1]
        assert [got[k] for k in keys] == pytest.approx([ref[k] for k in keys], rel=REL)
        assert [got[k] for k in keys] != pytest.approx([rank0[k] for k in keys], rel=1e-3)


# ---------------------------------------------------------------- only rank 0 writes


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_only_rank0_writes(runs, name):
    run_dir = runs[name]
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert steps == [1, 2, 3, 4]  # one line per step, not one per rank
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert len((run_dir / "eval_outputs.jsonl").read_text().splitlines()) == 2  # trainer.spec_eval.num_prompts
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["checkpoints", "config.json", "drafter", "eval_datastore", "eval_outputs.jsonl", "final_metrics.json", "launch.json",
         "metrics.jsonl", "target.json", "train.log", "wandb", "wandb_run_id"])  # fmt: skip
    log = (run_dir / "train.log").read_text()
    assert log.count("train sequences") == 1, log  # Hydra's file log: rank 0's lines only
    launch_info = json.loads((run_dir / "launch.json").read_text())
    assert launch_info["world_size"] == 2
    host = launch_info["host"]  # what decides the speed figures: report_run puts it in docs/benchmarks pages
    assert host["cpu_capability"] and host["cpu_threads"] >= 1
    assert host["target_linears"].split(" ")[0] in ("kernel", "onednn", "F.linear")
    assert host["decode_attention"] in ("kernel", "sdpa")
    final = json.loads((run_dir / "final_metrics.json").read_text())
    assert len(final["peak_mem_mb_per_rank"]) == 2 and min(final["peak_mem_mb_per_rank"]) > 100


def test_deepspeed_checkpoints_are_sharded(runs):
    """ZeRO-2 and ZeRO-3 write one optimizer-state shard per rank; ZeRO-3 also shards the weights,
    and the exported drafter is still whole (gathered with accelerator.get_state_dict)."""
    for name, stage in (("zero2", 2), ("zero3", 3)):
        ck = runs[name] / "checkpoints" / "step_0000004"
        assert (ck / "COMPLETE").is_file() and (ck / "drafter" / "drafter.safetensors").is_file()
        shards = sorted(p.name for p in (ck / "pytorch_model").glob("*optim_states.pt"))
        assert len(shards) == 2, shards
        assert json.loads((runs[name] / "launch.json").read_text())["zero_stage"] == stage
    model_shards = list((runs["zero3"] / "checkpoints" / "step_0000004" / "pytorch_model").glob("zero_pp_rank_*_model_states.pt"))
    assert len(model_shards) == 2


# ---------------------------------------------------------------- resume from a DeepSpeed checkpoint, multi-node launch


def test_resume_zero3_checkpoint_on_two_nodes(runs, cache, tmp_path):
    """The ZeRO-3 run 'killed' after its step-2 checkpoint resumes, launched as two 1-process machines
    with the multi-node preset over loopback, and logs the same steps 3-4 as the uninterrupted run."""
    b = tmp_path / "zero3_resumed"
    shutil.copytree(runs["zero3"], b)
    shutil.rmtree(b / "checkpoints" / "step_0000004")
    shutil.rmtree(b / "drafter")
    (b / "final_metrics.json").unlink()
    # metrics.jsonl is left as the finished run wrote it: the resume cuts it back to its checkpoint's rows
    port = str(free_port())
    procs = [
        launch("multinode_zero3", f"data.cache_dir={cache}", f"output_dir={b}", *STEPS, "resume=true",
               launcher_args=("--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                              "--main_process_ip", "127.0.0.1", "--main_process_port", port))  # fmt: skip
        for rank in (0, 1)
    ]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-4000:] + logs[1][-4000:]
    assert "resumed from" in logs[0] and "step_0000002 at step 2" in logs[0], logs[0][-3000:]
    a_rows, b_rows = train_rows(runs["zero3"]), train_rows(b)
    assert sorted(b_rows) == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(b)] == [r["step"] for r in read_metrics(runs["zero3"])]  # each row once
    for step in (3, 4):
        for k in ("train/loss", "train/lr", "train/samples", "train/tau_sim", "train/grad_norm"):
            assert b_rows[step][k] == pytest.approx(a_rows[step][k], rel=1e-6), (step, k)
    assert json.loads((b / "launch.json").read_text())["num_machines"] == 2
    assert json.loads((b / "final_metrics.json").read_text())["step"] == 4


# ---------------------------------------------------------------- W&B offline run = metrics.jsonl


@pytest.mark.parametrize("name", ["ref", "zero3"])
def test_wandb_offline_run_matches_metrics_jsonl(runs, name):
    """Every scalar in metrics.jsonl is in the offline W&B history at the same step with the same value;
    the run config carries the trainer config, the git SHA and the launch; the eval tables are there."""
    from drafttrain.eval.wandb_offline import read_run

    run_dir = runs[name]
    wb = read_run(run_dir, strict=True)
    assert wb.exit_code == 0 and wb.project == "drafttrain"
    history = {row["_step"]: row for row in wb.history}
    expected = per_step(run_dir)
    assert sorted(history) == sorted(expected) == [1, 2, 3, 4]
    n = 0
    for step, row in expected.items():
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                assert history[step][k] == v, (step, k)  # exact: both are the same float
                n += 1
    assert n > 80
    for k in ("train/tau_sim", "train/acc_0", "train/cond_acc_1", "eval/tau", "eval/tau_sim", "eval/speedup"):
        assert any(k in row for row in history.values()), k
    config = json.loads((run_dir / "config.json").read_text())
    assert wb.config["trainer"] == config["trainer"] and wb.config["drafter"] == config["drafter"]
    meta = json.loads((run_dir / "checkpoints" / "step_0000004" / "meta.json").read_text())
    assert wb.config["git_sha"] == meta["git_sha"]
    assert wb.config["launch"]["world_size"] == (1 if name == "ref" else 2)
    # eval tables at the periodic (step 2) and final (step 4) speculative evaluations
    for step in (2, 4):
        cols, rows = wb.table("eval/table", step=step)
        assert cols[:4] == ["step", "prompt_set", "tau", "speedup"]
        assert rows[0][0] == step and rows[0][2] == history[step]["eval/tau"]
        cols, rows = wb.table("eval/accept_hist_table", step=step)
        hist = {str(r[cols.index("accepted_drafts")]): r[cols.index("steps")] for r in rows}
        assert hist == expected[step]["eval/accept_hist"]
    assert wb.summary["train/loss"] == expected[4]["train/loss"]


def test_wandb_reader_reassembles_records_across_blocks(tmp_path):
    """A config value of 100 kB spans several 32 KiB blocks (FIRST/MIDDLE/LAST chunks) and comes back
    whole; history, summary and the exit code too (a wandb offline run written in a subprocess)."""
    from drafttrain.eval.wandb_offline import read_run

    script = (
        "import wandb\n"
        f"run = wandb.init(mode='offline', dir={str(tmp_path)!r}, project='p', config={{'big': 'x' * 100000, 'n': 3}})\n"
        "for i in range(3):\n"
        "    run.log({'train/loss': i * 0.5, 'eval/tau': 1 + i}, step=i)\n"
        "run.summary['final'] = 7\n"
        "run.finish()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "WANDB_MODE": "offline"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    wb = read_run(tmp_path, strict=True)
    assert wb.config["big"] == "x" * 100000 and wb.config["n"] == 3
    assert [(r["_step"], r["train/loss"], r["eval/tau"]) for r in wb.history] == [(0, 0.0, 1), (1, 0.5, 2), (2, 1.0, 3)]
    assert wb.summary["final"] == 7 and wb.exit_code == 0


# ---------------------------------------------------------------- the notebook runs on a tiny run


def test_notebook_executes_on_a_tiny_run(runs, tmp_path, monkeypatch):
    """notebooks/acceptance_length.ipynb runs top to bottom (nbclient) on the 1-process run read from its
    offline W&B file, with a harness-style report beside it, draws every plot and saves the PNGs."""
    import nbformat
    from nbclient import NotebookClient

    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "evaluate.json").write_text(json.dumps(
        {"recipe": "parallelspec", "prompts": "mt_bench",
         "results": [{"batch_size": b, "tau": 1.3, "speedup": 1.1 - b / 100} for b in (1, 4, 8)]}))  # fmt: skip
    figs = tmp_path / "figs"
    monkeypatch.setenv("DRAFTTRAIN_RUN", str(runs["ref"]))
    monkeypatch.setenv("DRAFTTRAIN_REPORTS", str(reports))
    monkeypatch.setenv("DRAFTTRAIN_LOG_SOURCE", "wandb")
    monkeypatch.setenv("DRAFTTRAIN_FIG_DIR", str(figs))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    nb = nbformat.read(REPO / "notebooks" / "acceptance_length.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    images = [c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert len(images) == 4, [c.source[:40] for c in code]
    summary = [o["data"]["text/plain"] for o in code[0].outputs if o.output_type == "execute_result"][0]
    assert "'source': 'wandb'" in summary and "parallelspec" in summary
    table = [o["data"]["text/plain"] for o in code[-2].outputs if o.output_type == "execute_result"][0]
    assert "('parallelspec', 'mt_bench', 8, 1.3, 1.02)" in table  # harness rows, batch 8
    assert "('parallelspec_eagle3', 'mt_bench ids " in table  # the run's own evaluation (its drafter, prompt ids named)
    assert sorted(p.name for p in figs.glob("*.png")) == [
        "accept_hist.png", "position_acceptance.png", "tau_over_steps.png", "tau_speedup_by_batch.png"]
