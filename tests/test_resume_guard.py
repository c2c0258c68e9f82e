"""Resume refuses a changed job, before any model loads; a short documented list of keys may change.
Also the checkpoint writing helpers (atomic rename, cleanup of interrupted saves).

Why: ``resume=true`` used to load any checkpoint in ``output_dir`` into whatever the new command
built: another drafter width failed deep inside ``load_state`` and another data or optimizer setting
silently trained a mixture of two jobs.
"""

from __future__ import annotations

import json

import math

import pytest
import torch

from drafttrain import train as T
from drafttrain.train.loop import MetricsLog
from drafttrain.validation import resolve_mixed_precision, validate
from drafttrain.config import ConfigError, to_dict


def _cfg(tmp_path, *overrides):
    from helpers import compose_dict

    return compose_dict("train", ["+recipe=parallelspec", "target=tiny", f"output_dir={tmp_path / 'run'}", *overrides])


def _fake_checkpoint(tmp_path, *overrides, step=3):
    from drafttrain.validation import resolve_mixed_precision, validate

    c = validate(_cfg(tmp_path, *overrides))
    c.trainer.mixed_precision = resolve_mixed_precision(c.trainer.mixed_precision)
    ck = tmp_path / "run" / T.CHECKPOINTS / f"step_{step:07d}"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text(json.dumps(to_dict(c)))
    (ck / T.COMPLETE).write_text("ok")
    return ck


@pytest.fixture()
def no_model(monkeypatch):
    import drafttrain.target

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the resume check")

    monkeypatch.setattr(drafttrain.target, "load_target", boom)


@pytest.mark.parametrize("changed", [["drafter.num_mask_tokens=2"], ["data.max_conversations=100"], ["optim.lr=1e-3"],
                                     ["target.hidden_size=32"], ["seed=1", "optim.weight_decay=0.1"]])  # fmt: skip
def test_resume_refuses_a_changed_job_naming_the_keys(tmp_path, no_model, changed):
    _fake_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="different job") as err:
        T.run(_cfg(tmp_path, "resume=true", *changed))
    for override in changed:
        assert override.split("=")[0] in str(err.value)
    assert "Use another output_dir" in str(err.value)


def test_resume_allows_the_documented_keys(tmp_path):
    ck = _fake_checkpoint(tmp_path)
    c = validate(_cfg(tmp_path, "resume=true", "trainer.max_steps=5000", "trainer.max_minutes=30", "trainer.log_every=3",
                        "trainer.save_every=7", "trainer.keep_checkpoints=4", "logging.wandb=false", "run_name=again"))  # fmt: skip
    c.trainer.mixed_precision = resolve_mixed_precision(c.trainer.mixed_precision)
    assert T.check_resume(c) == ck


def test_resume_accepts_keys_added_since_the_checkpoint_at_their_defaults(tmp_path, no_model):
    """A checkpoint written before a config key existed has no value for it: at the schema default
    (TrainConfig's) now, it is the same job and resume goes on; at another value it is refused,
    naming the key."""
    from drafttrain.config import TrainConfig

    ck = _fake_checkpoint(tmp_path)
    saved = json.loads((ck / "config.json").read_text())
    defaults = to_dict(TrainConfig())
    added = [("trainer", "export"), ("trainer", "attention"), ("data", "self_distill_minutes")]
    for section, key in added:
        del saved[section][key]
    (ck / "config.json").write_text(json.dumps(saved))

    c = validate(_cfg(tmp_path, "resume=true"))
    c.trainer.mixed_precision = resolve_mixed_precision(c.trainer.mixed_precision)
    for section, key in added:  # the new run keeps each at the schema default
        assert getattr(getattr(c, section), key) == defaults[section][key]
    assert T.check_resume(c) == ck

    with pytest.raises(ConfigError, match="different job") as err:
        T.run(_cfg(tmp_path, "resume=true", "trainer.export=false"))  # absent in the checkpoint, not the default now
    assert "trainer.export: checkpoint '<absent>', now False" in str(err.value)
    assert "trainer.attention" not in str(err.value) and "data.self_distill_minutes" not in str(err.value)


def test_changed_max_steps_follows_the_new_schedule():
    """After a resume with another trainer.max_steps, the next step's lr is the warm-up + cosine schedule
    of the NEW max_steps at that step (the already-taken steps keep theirs)."""
    from drafttrain.config import TrainConfig

    c = TrainConfig()
    c.optim.lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 1e-3, 2, 0.1
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=c.optim.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: T.lr_lambda(s, 2, 6, 0.1))  # the first run: 6 steps
    for _ in range(4):
        opt.step()
        sched.step()
    c.trainer.max_steps = 20
    T.set_schedule_lr(opt, sched.base_lrs, 4, c)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * T.lr_lambda(4, 2, 20, 0.1))
    assert opt.param_groups[0]["lr"] != pytest.approx(1e-3 * T.lr_lambda(4, 2, 6, 0.1))


def test_decay_over_minutes_follows_the_clock():
    """optim.decay_over=minutes: warm-up by steps, then the cosine's progress is the training time spent
    over trainer.max_minutes (a time-budgeted run ends its decay at the budget), whatever max_steps is."""
    from drafttrain.config import TrainConfig

    c = TrainConfig()
    c.optim.warmup_steps, c.optim.min_lr_ratio = 2, 0.1
    c.trainer.max_steps, c.trainer.max_minutes = 1_000_000, 10.0
    c.optim.decay_over = "minutes"
    assert T.schedule_factor(0, 0.0, c) == pytest.approx(0.5)  # warm-up: step 1 of 2
    assert T.schedule_factor(50, 0.0, c) == pytest.approx(1.0)
    assert T.schedule_factor(50, 300.0, c) == pytest.approx(0.1 + 0.9 * 0.5)  # half the budget: cosine half-way
    assert T.schedule_factor(51, 600.0, c) == pytest.approx(0.1) == T.schedule_factor(9, 900.0, c)  # spent: the floor
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    T.set_schedule_lr(opt, [1e-3], 50, c, train_seconds=150.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))))
    c.optim.decay_over = "steps"  # the default: the clock is ignored
    assert T.schedule_factor(50, 600.0, c) == pytest.approx(T.lr_lambda(50, 2, 1_000_000, 0.1))


def test_decay_over_is_checked_before_anything_loads(tmp_path):
    from drafttrain.config import ConfigError

    with pytest.raises(ConfigError, match="optim.decay_over must be steps|minutes"):
        validate(_cfg(tmp_path, "optim.decay_over=hours"))
    with pytest.raises(ConfigError, match="needs trainer.max_minutes"):
        validate(_cfg(tmp_path, "optim.decay_over=minutes", "trainer.max_minutes=null"))


def test_interrupted_saves_are_removed_and_replace_is_atomic(tmp_path):
    root = tmp_path / T.CHECKPOINTS
    for name in ("step_0000002", "step_0000004", ".tmp_step_0000006", ".old_step_0000004"):
        (root / name).mkdir(parents=True)
    (root / "step_0000002" / T.COMPLETE).write_text("ok")  # step_4 has no marker: an interrupted save
    gone = T.remove_incomplete_checkpoints(tmp_path)
    assert sorted(p.name for p in gone) == [".old_step_0000004", ".tmp_step_0000006", "step_0000004"]
    assert T.latest_checkpoint(tmp_path).name == "step_0000002"
    new = tmp_path / ".tmp_x"
    new.mkdir()
    (new / "f").write_text("new")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("old")
    T.replace_dir(new, tmp_path / "x")
    assert (tmp_path / "x" / "f").read_text() == "new" and not new.exists() and not (tmp_path / ".old_x").exists()


def test_resume_refuses_other_target_weights_under_the_same_config(tmp_path, no_model):
    """Same config, but the checkpoint's meta.json records another target fingerprint (the weights at
    target.path changed): refused, naming the target weights."""
    ck = _fake_checkpoint(tmp_path)
    (ck / "meta.json").write_text(json.dumps({"step": 3, "target_fingerprint": "0123456789abcdef"}))
    with pytest.raises(ConfigError, match=r"target weights: checkpoint 0123456789abcdef, now tiny-"):
        T.run(_cfg(tmp_path, "resume=true"))


def test_metrics_log_is_cut_back_to_the_checkpoint_on_resume(tmp_path):
    """A resumed run keeps the rows its checkpoint counted and appends after them (each step once); a
    fresh run in the same folder starts an empty file (it used to append to the old run's rows)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4, 5)))  # killed after step 5
    mlog = MetricsLog(path, True)
    mlog.start(3)  # the checkpoint at step 3 had written 3 rows
    mlog.write({"train/loss": 1.0}, 4)
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2, 3, 4] and mlog.lines == 4
    MetricsLog(path, True).start(None)
    assert path.read_text() == ""
