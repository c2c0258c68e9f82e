"""Checkpoints of a training run: loop counters, atomic saves, resume checks, test-only fault points.

A checkpoint is ``output_dir/checkpoints/step_N`` with a COMPLETE marker: accelerate's state (drafter,
optimizer, scheduler, RNG, :class:`TrainState`), the drafter's safetensors, the config and git SHA. A run
killed at any point leaves either a complete checkpoint or a temporary folder the next save removes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from drafttrain.config import TrainConfig, to_dict
from drafttrain.fingerprint import git_sha

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"


class TrainState:
    """Loop counters saved with every checkpoint (accelerate custom checkpoint object)."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.samples = 0  # global samples consumed (the data position)
        self.train_seconds = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples": self.samples, "train_seconds": self.train_seconds}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.step, self.samples, self.train_seconds = int(d["step"]), int(d["samples"]), float(d["train_seconds"])


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint folder under ``out_dir/checkpoints`` (None if there is none)."""
    root = out_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())
    return done[-1] if done else None


def remove_incomplete_checkpoints(out_dir: Path) -> list[Path]:
    """Delete what a killed save left behind: ``.tmp_*`` / ``.old_*`` folders and ``step_*`` folders
    without the COMPLETE marker (rank 0 only). Returns the removed paths."""
    root = out_dir / CHECKPOINTS
    gone = [p for p in root.glob(".tmp_step_*")] + [p for p in root.glob(".old_step_*")]
    gone += [p for p in root.glob("step_*") if not (p / COMPLETE).is_file()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
        log.warning("removed an incomplete checkpoint folder %s (a save was interrupted)", p)
    return gone


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final`` (same file system), replacing an older ``final``.

    Both renames are atomic: a kill leaves either the old folder, or none at ``final`` (the old one
    is then at ``.old_<name>`` and removed by the next save), never a half-written ``final``
    (:func:`drafttrain.atomic.replace_dir`).
    """
    from drafttrain.atomic import replace_dir as replace

    replace(tmp, final)


def free_hint(c: TrainConfig, out_dir: Path) -> str:
    """What to delete to make room for a checkpoint (for :class:`drafttrain.atomic.DiskFullError`)."""
    return (f"older checkpoints under {out_dir / CHECKPOINTS} (trainer.keep_checkpoints={c.trainer.keep_checkpoints} "
            f"keeps the newest), older runs' folders, the self-distillation / feature cache under data.cache_dir="
            f"{c.data.cache_dir or '<cache_root>/data'}")


def fault_point(name: str, step: int) -> None:
    """Test-only fault injection: ``DRAFTTRAIN_FAULT=<name>@<step>`` makes this process SIGKILL itself at
    the named point of that step (``step``: mid-step, after backward and before the optimizer step;
    ``checkpoint``: while a checkpoint is being written, state saved but no marker; ``complete``: right
    after a checkpoint became COMPLETE). Unset (always, outside ``tests/test_train_cli.py``): nothing."""
    spec = os.environ.get("DRAFTTRAIN_FAULT")
    if spec and spec == f"{name}@{step}":
        import signal

        print(f"[drafttrain] DRAFTTRAIN_FAULT: SIGKILL at {spec}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(accelerator, drafter, c: TrainConfig, state: TrainState, out_dir: Path, metrics_lines: int = 0,
                    strategy_state: dict | None = None) -> Path:  # fmt: skip
    """accelerate state (drafter, optimizer, scheduler, RNG, TrainState) + drafter safetensors + config + git SHA.

    Written into ``checkpoints/.tmp_step_N`` by every rank, then (after a barrier across ranks, so
    every rank's shards are on disk) rank 0 writes the COMPLETE marker and renames the folder to
    ``step_N``. A run killed at any point leaves either a complete checkpoint or a temporary folder
    that the next save (or resume) removes; :func:`latest_checkpoint` only trusts COMPLETE ones.
    ``metrics_lines`` (rows of ``metrics.jsonl`` so far) goes into ``meta.json``: a resume cuts the
    file back to it, so every step is logged once. ``strategy_state`` (the training strategy's own state,
    ``TrainingStrategy.state_dict``) goes there too when not empty. Old checkpoints beyond ``keep_checkpoints``
    are removed.
    """
    from drafttrain.train.distributed import full_drafter

    root = out_dir / CHECKPOINTS
    path = root / f"step_{state.step:07d}"
    tmp = root / f".tmp_{path.name}"
    from drafttrain.atomic import disk_full_guard, fsync_path

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    # a full disk: the partial .tmp_step_N is removed, the previous checkpoints stay, DiskFullError names root
    with disk_full_guard(root, f"checkpoint {path.name}", free_hint(c, out_dir),
                         partial=tmp if accelerator.is_main_process else None):  # fmt: skip
        accelerator.save_state(str(tmp))  # DeepSpeed: its engine checkpoint (sharded optimizer state per rank)
        model = full_drafter(accelerator, drafter)  # collective under ZeRO-3
        if accelerator.is_main_process:
            model.save_pretrained(tmp / "drafter")
            (tmp / "config.json").write_text(json.dumps(to_dict(c), indent=1))
            from drafttrain.fingerprint import target_fingerprint

            meta = {"git_sha": git_sha() or "unknown", **state.state_dict(), "metrics_lines": metrics_lines,
                    "target_fingerprint": target_fingerprint(c.target),
                    **({"strategy_state": strategy_state} if strategy_state else {})}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        fault_point("checkpoint", state.step)
        accelerator.wait_for_everyone()  # every rank's part is written before the marker
        if accelerator.is_main_process:
            (tmp / COMPLETE).write_text("ok")
            fsync_path(tmp)  # on disk before the rename makes it the newest checkpoint
            replace_dir(tmp, path)
    if accelerator.is_main_process:
        fault_point("complete", state.step)
        remove_incomplete_checkpoints(out_dir)
        done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())
        for old in done[: -c.trainer.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


#: Keys that may differ between a checkpoint's config and a resumed run's (everything else must match,
#: or ``resume=true`` refuses). Prefixes end with a dot or an underscore. trainer.max_steps: the
#: learning rate follows the warm-up + cosine schedule of the *new* max_steps from the resume step on.
RESUME_MAY_CHANGE = (
    "resume", "run_name", "output_dir", "data.cache_dir", "logging.", "trainer.max_steps", "trainer.max_minutes",
    "trainer.log_every", "trainer.eval_every", "trainer.save_every", "trainer.keep_checkpoints", "trainer.num_threads",
    "trainer.progress", "trainer.spec_eval",
    "data.generation.vllm.",  # where vLLM runs (python, cores, memory), not what it generates; absent before it existed
)  # fmt: skip


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_mismatch(saved: dict, now: dict, defaults: dict | None = None) -> list[str]:
    """Keys (dotted) whose values differ between a checkpoint's config and this run's, leaving out
    :data:`RESUME_MAY_CHANGE`; each as ``"key: checkpoint X, now Y"``.

    A key absent from the checkpoint's config whose value now is its schema default (``defaults``,
    :func:`~drafttrain.validation.train_schema`'s when None: the strategies' sections included) is not a difference: the checkpoint was written
    before the key existed, when the code behaved as that default does (e.g. ``trainer.export``,
    ``trainer.attention``, ``data.self_distill_minutes``). Absent with another value still differs.
    """
    a, b = _flat(saved), _flat(now)
    from drafttrain.validation import train_schema

    d = _flat(to_dict(train_schema()()) if defaults is None else defaults)

    def differs(k: str) -> bool:
        if k.startswith(RESUME_MAY_CHANGE):
            return False
        if k not in a and k in b and k in d and b[k] == d[k]:
            return False  # added after the checkpoint was written, and left at its default
        return a.get(k) != b.get(k)

    keys = sorted(k for k in set(a) | set(b) if differs(k))
    return [f"{k}: checkpoint {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}" for k in keys]


def check_resume(c: TrainConfig) -> Path | None:
    """The checkpoint ``resume=true`` will load, after checking it is this job's (no model loads here).

    Raises:
        ConfigError: the checkpoint's config differs in a key outside :data:`RESUME_MAY_CHANGE`; the
            message names every differing key with both values.
    """
    from drafttrain.config import ConfigError
    from drafttrain.data.shards import read_json

    ckpt = latest_checkpoint(Path(c.output_dir))
    if ckpt is None:
        return None
    saved = read_json(ckpt / "config.json", f"delete {ckpt} (an older checkpoint, if any, is used) and rerun")
    diff = resume_mismatch(saved, to_dict(c))
    meta_path = ckpt / "meta.json"
    meta = read_json(meta_path, f"delete {ckpt} (an older checkpoint, if any, is used) and rerun") if meta_path.is_file() else {}
    if meta.get("target_fingerprint"):
        from drafttrain.fingerprint import target_fingerprint

        now = target_fingerprint(c.target)
        if meta["target_fingerprint"] != now:
            diff.append(f"target weights: checkpoint {meta['target_fingerprint']}, now {now}")
    if diff:
        raise ConfigError(
            f"resume=true: {ckpt} was written by a different job; these keys differ: {'; '.join(diff)}. "
            f"Only {', '.join(RESUME_MAY_CHANGE)} may change on resume. Use another output_dir, or resume=false to "
            f"start over."
        )
    return ckpt


def atomic_save_pretrained(model, final: Path) -> None:
    """``model.save_pretrained`` into a temporary folder, fsynced and renamed into place (:func:`replace_dir`).

    Raises:
        drafttrain.atomic.DiskFullError: the disk filled up (the old ``final`` is kept, the temporary removed).
    """
    from drafttrain.atomic import atomic_dir

    hint = f"older checkpoints under {final.parent / CHECKPOINTS}, older runs' folders or caches on that disk"
    with atomic_dir(final, f"the drafter ({final.name}/)", hint) as tmp:
        model.save_pretrained(tmp)
