"""A full disk while a checkpoint or the final drafter is written: the previous complete checkpoint is kept and
loads, no partial folder is left, the one-line message names the checkpoints folder and what to free, and the
relaunch resumes from the last complete checkpoint. Also the atomic writers under a real file-size limit
(``RLIMIT_FSIZE``: EFBIG, not ENOSPC) and the entry points' one line.

Why: a save that hit a full disk raised a bare ``OSError`` from inside accelerate / safetensors and left
``checkpoints/.tmp_step_N`` taking the space; the checkpoint was never fsynced before its rename.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from drafttrain.atomic import DiskFullError
from drafttrain.train import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]


def _enospc_after_partial(path, *a, **k):
    """A ``save_pretrained`` that writes part of its weights file, then finds the disk full."""
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "model.safetensors").write_bytes(b"\0" * 3000)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture()
def run(tmp_path, make_drafter):
    from accelerate import Accelerator

    from drafttrain.validation import resolve_mixed_precision, validate
    from helpers import compose_dict

    c = validate(compose_dict("train", ["+recipe=parallelspec", "target=tiny", f"output_dir={tmp_path / 'run'}",
                                        "trainer.keep_checkpoints=2"]))  # fmt: skip
    c.trainer.mixed_precision = resolve_mixed_precision(c.trainer.mixed_precision)
    acc = Accelerator(cpu=True)
    drafter = make_drafter(seed=1)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    drafter, opt = acc.prepare(drafter, opt)
    state = ck.TrainState()
    acc.register_for_checkpointing(state)
    return c, acc, drafter, state, Path(c.output_dir)


def test_full_disk_during_a_checkpoint_keeps_the_previous_one_and_resume_loads_it(run, tiny_target, monkeypatch):
    from drafttrain.drafters import Drafter

    c, acc, drafter, state, out = run
    state.step, state.samples = 2, 16
    ck.save_checkpoint(acc, drafter, c, state, out)
    weights = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():  # the step-4 weights differ from the step-2 ones
        next(p for p in drafter.parameters() if p.requires_grad).add_(1.0)
    state.step, state.samples = 4, 32
    monkeypatch.setattr(drafter, "save_pretrained", _enospc_after_partial)
    with pytest.raises(DiskFullError) as err:
        ck.save_checkpoint(acc, drafter, c, state, out)
    msg = str(err.value)
    root = out / ck.CHECKPOINTS
    assert "\n" not in msg and msg.startswith(f"disk full: writing checkpoint step_0000004 in {root} failed after ")
    assert "ENOSPC" in msg and f"older checkpoints under {root}" in msg and "trainer.keep_checkpoints=2" in msg
    assert "resumes from the last complete state" in msg
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]  # no .tmp_step_0000004
    latest = ck.latest_checkpoint(out)
    assert latest.name == "step_0000002"
    # the relaunch: the resume check passes and the state loads as it was at step 2
    assert ck.check_resume(c) == latest
    state.step = state.samples = 0
    acc.load_state(str(latest))
    assert (state.step, state.samples) == (2, 16)
    saved = Drafter.from_pretrained(latest / "drafter", tiny_target)
    for k, v in saved.state_dict().items():
        if k in weights:
            assert torch.equal(v, weights[k]), k
    monkeypatch.undo()  # space freed: the next save goes through
    state.step = 4
    ck.save_checkpoint(acc, drafter, c, state, out)
    assert ck.latest_checkpoint(out).name == "step_0000004"


def test_full_disk_on_the_final_drafter_keeps_the_old_folder(run, monkeypatch):
    c, acc, drafter, state, out = run
    model = acc.unwrap_model(drafter)
    ck.atomic_save_pretrained(model, out / "drafter")
    before = sorted(p.name for p in (out / "drafter").iterdir())
    monkeypatch.setattr(model, "save_pretrained", _enospc_after_partial)
    with pytest.raises(DiskFullError, match=rf"writing the drafter \(drafter/\) in {out} failed after 2.9 KiB"):
        ck.atomic_save_pretrained(model, out / "drafter")
    assert sorted(p.name for p in (out / "drafter").iterdir()) == before
    assert not list(out.glob(".tmp_*")) and not list(out.glob(".old_*"))


WRITER = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from drafttrain.atomic import DiskFullError, atomic_dir, atomic_write_text

    root = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    try:
        atomic_write_text(root / "manifest.json", "x" * 200000)
    except DiskFullError as e:
        print("FILE", e)
    try:
        with atomic_dir(root / "shard", "shard 1", "the feature cache dir") as tmp:
            (tmp / "small.json").write_text("{}")
            (tmp / "data.arrow").write_bytes(b"y" * 200000)
    except DiskFullError as e:
        print("DIR", e)
""")


def test_a_file_size_limit_efbig_is_a_full_disk_and_keeps_the_old_files(tmp_path):
    (tmp_path / "manifest.json").write_text("old manifest")
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "data.arrow").write_bytes(b"old")
    proc = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["FILE", "DIR"], proc.stdout
    assert lines[0].startswith(f"FILE disk full: writing manifest.json in {tmp_path} failed after ") and "EFBIG" in lines[0]
    assert lines[1].startswith(f"DIR disk full: writing shard 1 in {tmp_path} failed after 64.0 KiB (EFBIG")
    assert "Free space (the feature cache dir)" in lines[1]
    assert (tmp_path / "manifest.json").read_text() == "old manifest"
    assert (tmp_path / "shard" / "data.arrow").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard"]  # no temporary left


def test_entry_points_print_a_full_disk_in_one_line(capsys, tmp_path):
    from drafttrain.cliconfig import run_cli

    def main():
        raise DiskFullError("disk full: writing shard 3 in /x failed after 1.0 MiB (ENOSPC: ...)", tmp_path, 1 << 20)

    with pytest.raises(SystemExit) as code:
        run_cli(main)
    assert code.value.code == 1
    assert capsys.readouterr().err == "disk full: writing shard 3 in /x failed after 1.0 MiB (ENOSPC: ...)\n"


def test_other_write_errors_pass_through_and_still_remove_the_temporary(tmp_path):
    from drafttrain.atomic import atomic_dir

    with pytest.raises(PermissionError):
        with atomic_dir(tmp_path / "x", "x", "-") as tmp:
            (tmp / "f").write_text("partial")
            raise PermissionError(errno.EACCES, "denied")
    assert list(tmp_path.iterdir()) == []
