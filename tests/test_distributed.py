"""Fast checks of the scale-out pieces that need no second process: the accelerate/DeepSpeed presets,
how the DeepSpeed config is filled from the trainer config, the ZeRO-3 output adapter, and the
report loader / plots behind the notebook. The multi-process runs are in tests/test_scaling.py."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from drafttrain.config import ConfigError, TrainConfig
from drafttrain.train.distributed import Zero3LossOutput, configure_deepspeed, frozen_target_context, zero_stage

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "conf" / "accelerate").glob("*.yaml"))


def fake_accelerator(ds_config: dict | None, world: int = 2):
    plugin = None if ds_config is None else types.SimpleNamespace(deepspeed_config=ds_config)
    return types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin), num_processes=world)


def ds_json(name: str) -> dict:
    return json.loads((REPO / "conf" / "deepspeed" / f"{name}.json").read_text())


# ---------------------------------------------------------------- presets


def test_every_issue_preset_exists():
    names = {p.stem for p in PRESETS}
    assert {"cpu", "cpu_ddp", "ddp", "zero2", "zero2_offload", "zero3", "zero3_offload", "multinode_zero3"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_and_its_deepspeed_config_validates(preset):
    """accelerate parses the preset; a DeepSpeed preset points at a JSON that DeepSpeed accepts once the
    trainer config has filled its "auto" entries (DeepSpeedConfig rejects typos inside zero_optimization)."""
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(preset))
    dt = str(cfg.distributed_type).split(".")[-1]
    assert dt in ("NO", "MULTI_GPU", "DEEPSPEED"), dt
    if dt == "NO":
        assert cfg.num_processes == 1
        return
    # use_cpu=true would start one process / turn DeepSpeed off (docs/design.md, "Platform notes")
    assert cfg.use_cpu is False
    if dt != "DEEPSPEED":
        return
    from deepspeed.runtime.config import DeepSpeedConfig

    ds_file = cfg.deepspeed_config["deepspeed_config_file"]
    assert cfg.deepspeed_config["zero3_init_flag"] is False  # the frozen target is never partitioned
    ds = json.loads((REPO / ds_file).read_text())
    c = TrainConfig()
    configure_deepspeed(fake_accelerator(ds, world=1), c, hidden_size=576)
    for kind in ("bf16", "fp16"):  # accelerate fills these from trainer.mixed_precision
        ds[kind]["enabled"] = False
    parsed = DeepSpeedConfig(ds)
    assert parsed.zero_optimization_stage == int(Path(ds_file).stem[4])
    assert parsed.train_micro_batch_size_per_gpu == c.trainer.micro_batch_size
    assert parsed.gradient_clipping == c.optim.max_grad_norm
    assert (parsed.zero_config.offload_optimizer is not None) == ("offload" in ds_file)
    if cfg.num_machines > 1:
        assert cfg.deepspeed_config["deepspeed_multinode_launcher"] == "standard"


# ---------------------------------------------------------------- DeepSpeed config from the trainer config


def test_configure_deepspeed_fills_auto_entries_from_the_trainer_config():
    c = TrainConfig()
    c.trainer.micro_batch_size, c.trainer.grad_accum_steps, c.optim.max_grad_norm = 3, 5, 0.7
    ds = ds_json("zero3")
    out = configure_deepspeed(fake_accelerator(ds, world=4), c, hidden_size=10)
    assert out is ds
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 5, 60)
    assert ds["gradient_clipping"] == 0.7
    z = ds["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (100, 90, 100)
    assert z["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda ds: ds.update(gradient_clipping=0.5), "gradient_clipping=0.5"),
        (lambda ds: ds.update(train_micro_batch_size_per_gpu=16), "train_micro_batch_size_per_gpu=16"),
        (lambda ds: ds.update(gradient_accumulation_steps=8), "gradient_accumulation_steps=8"),
        (lambda ds: ds.update(bf16={"enabled": True}), "bf16.enabled=True"),
        (lambda ds: ds["zero_optimization"].update(stage3_gather_16bit_weights_on_model_save=False), "gather_16bit"),
    ],
)
def test_configure_deepspeed_refuses_values_that_disagree_with_the_trainer_config(edit, message):
    ds = ds_json("zero3")
    edit(ds)
    with pytest.raises(ConfigError, match=message):
        configure_deepspeed(fake_accelerator(ds), TrainConfig(), hidden_size=64)


def test_configure_deepspeed_accepts_matching_explicit_values_and_is_a_no_op_without_deepspeed():
    c = TrainConfig()
    ds = ds_json("zero2")
    ds.update(gradient_clipping=c.optim.max_grad_norm, train_micro_batch_size_per_gpu=c.trainer.micro_batch_size)
    configure_deepspeed(fake_accelerator(ds), c, hidden_size=64)
    acc = fake_accelerator(None)
    assert configure_deepspeed(acc, c, hidden_size=64) is None
    assert zero_stage(acc) is None and zero_stage(fake_accelerator(ds)) == 2
    with frozen_target_context(acc):
        pass


# ---------------------------------------------------------------- ZeRO-3 sees the loss


def test_zero3_output_adapter_exposes_the_loss_to_deepspeed_hooks():
    """DeepSpeed attaches its re-gather-before-backward hook only to tensors it finds in a module's
    output: it finds none in the dataclass LossOutput (the bug this adapter fixes), and exactly the
    loss in the adapter, which keeps the loop's attribute access."""
    from deepspeed.runtime.zero.utils import apply_to_tensors_only

    from drafttrain.drafters.base import LossOutput

    loss = torch.tensor(2.0, requires_grad=True) * 1.5
    sums = {"tau_groups": torch.tensor(3.0)}
    seen: list[torch.Tensor] = []

    def hook(t):
        seen.append(t)
        return t * 1.0

    raw = LossOutput(loss=loss, sums=sums, num_tokens=7)
    apply_to_tensors_only(hook, raw)
    assert seen == []  # invisible
    out = apply_to_tensors_only(hook, Zero3LossOutput(raw))
    assert len(seen) == 1 and seen[0] is loss  # only the loss, not the metric sums
    assert out.loss is not loss and torch.equal(out.loss, loss)  # the hooked tensor replaces it in place
    assert out.sums is sums and out.num_tokens == 7 and list(out) == ["loss"]


# ---------------------------------------------------------------- notebook helpers


def test_eval_report_loader_reads_several_layouts_and_skips_what_is_missing(tmp_path):
    from drafttrain.eval.plots import load_eval_reports

    (tmp_path / "flat.json").write_text(json.dumps(
        [{"recipe": "medusa", "prompts": "gsm8k", "batch_size": b, "tau": 1.5 + b / 10, "speedup": 1.2} for b in (1, 4)]))
    (tmp_path / "nested.json").write_text(json.dumps(
        {"drafter": {"name": "eagle"}, "prompts": "mt_bench",
         "results": {"unpadded": {"mode": "unpadded", "by_batch_size": {"1": {"tau": 2.0, "speedup": 1.5},
                                                                        "8": {"τ": 1.9, "speedup": 1.1}}}}}))  # fmt: skip
    (tmp_path / "notes.json").write_text("not json")
    rows = load_eval_reports(tmp_path, tmp_path / "missing.json")
    got = sorted((r["recipe"], r["prompt_set"], r["batch_size"], r["tau"], r["mode"]) for r in rows)
    assert got == [("eagle", "mt_bench", 1, 2.0, "unpadded"), ("eagle", "mt_bench", 8, 1.9, "unpadded"),
                   ("medusa", "gsm8k", 1, 1.6, ""), ("medusa", "gsm8k", 4, 1.9, "")]  # fmt: skip
    assert load_eval_reports(tmp_path / "nowhere") == []


def test_plots_draw_from_a_run_folder(tmp_path):
    from drafttrain.eval import plots

    rows = [{"step": s, "train/loss": 3.0 / s, "train/tau_sim": 1 + s / 10, "train/acc_0": 0.5, "train/acc_1": 0.2,
             "train/cond_acc_0": 0.5, "train/cond_acc_1": 0.3} for s in (1, 2, 3)]  # fmt: skip
    rows.append({"step": 3, "eval/tau": 1.4, "eval/accept_hist": {"0": 5, "2": 1}, "eval/prompts": "mt_bench[0:2]"})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "final_metrics.json").write_text(json.dumps({"step": 3, "eval/tau": 1.4, "eval/speedup": 0.9}))
    (tmp_path / "config.json").write_text(json.dumps({"drafter": {"name": "parallelspec"}}))
    run = plots.load_run(tmp_path)
    assert run.series("train/tau_sim") == ([1, 2, 3], [1.1, 1.2, 1.3])
    assert run.history[-1]["eval/tau"] == 1.4 and run.history[-1]["train/loss"] == 1.0  # rows of a step merged
    assert plots.run_eval_rows(run)[0]["batch_size"] == 1
    figs = {"a": plots.plot_tau(run), "b": plots.plot_position_acceptance(run), "c": plots.plot_accept_hist(run),
            "d": plots.plot_batch_sizes(plots.run_eval_rows(run)), "e": plots.plot_batch_sizes([])}  # fmt: skip
    bars = [p.get_height() for p in figs["c"].axes[0].patches]
    assert bars == pytest.approx([5 / 6, 1 / 6])
    paths = plots.save_figures(figs, tmp_path / "png")
    assert [p.stat().st_size > 1000 for p in paths] == [True] * 5
    with pytest.raises(FileNotFoundError):
        plots.load_run(tmp_path / "empty")


# ---------------------------------------------------------------- the SLURM job script


def test_slurm_script_launches_one_accelerate_per_node_with_its_rank(tmp_path):
    """scripts/slurm/train_multinode.sbatch with stand-ins for srun (runs the task once per node with
    SLURM_NODEID), scontrol (the node list) and accelerate (records its arguments)."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls.txt"
    stubs = {
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nfor i in 0 1; do SLURM_NODEID=$i "$@"; done\n',
        "scontrol": "#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n",
        "fake-accelerate": f'#!/bin/bash\necho "$*" >> {record}\n',
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_DIR": str(REPO), "ACCELERATE": str(bin_dir / "fake-accelerate")}  # fmt: skip
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "train_multinode.sbatch"), "+recipe=parallelspec",
                           "output_dir=/shared/run one"], env=env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    common = ("launch --config_file conf/accelerate/multinode_zero3.yaml --num_machines 2 --num_processes 8 "
              "--machine_rank {} --main_process_ip node-a --main_process_port 29500 train.py +recipe=parallelspec "
              "output_dir=/shared/run one")  # fmt: skip
    assert record.read_text().splitlines() == [common.format(0), common.format(1)]


def test_notebook_defines_no_logic_of_its_own():
    """The notebook only imports drafttrain (+ os/pathlib for its settings) and calls it: no function,
    class or loop of its own that tests would not cover."""
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / "acceptance_length.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for word in ("def ", "class ", "lambda", "while ", "\nfor "):
        assert word not in code, word
    imports = [line.split()[1] for line in code.splitlines() if line.startswith(("import ", "from "))]
    assert sorted(set(imports)) == ["drafttrain.eval", "os", "pathlib"], imports
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed without outputs


def test_frozen_target_is_loaded_outside_zero3_init():
    """transformers builds models inside ZeRO-3's zero.Init whenever a ZeRO-3 DeepSpeed config is
    registered (accelerate registers it): the frozen target must load with none registered."""
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    hf = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    acc = fake_accelerator({"zero_optimization": {"stage": 3}})
    acc.state.deepspeed_plugin.dschf = hf
    try:
        assert is_deepspeed_zero3_enabled()
        with frozen_target_context(acc):
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()  # restored for the rest of the run
    finally:
        unset_hf_deepspeed_config()
    with frozen_target_context(fake_accelerator(None)):
        assert not is_deepspeed_zero3_enabled()
