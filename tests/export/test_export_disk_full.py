"""A full disk while an export is written: the previous export in ``output_dir`` stays whole and verifies, no
partial folder is left, the one-line message names the folder, and the same command (``overwrite=true``) then
writes the new export.

Why: ``export_run`` wrote straight into ``output_dir``; a disk that filled up between the weights and
``export_info.json`` left a folder whose weights no longer matched its digests.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from drafttrain.atomic import DiskFullError
from drafttrain.export import export_run
from drafttrain.export.verify import verify_export


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_target):
    """A Medusa drafter of the tiny target saved as a training run whose target is saved to disk."""
    import torch

    from drafttrain.drafters import build_drafter

    base = tmp_path_factory.mktemp("diskfull")
    tdir = base / "target"
    tiny_target.model.save_pretrained(tdir)
    tiny_target.tokenizer.save_pretrained(tdir)
    run = base / "run"
    torch.manual_seed(0)
    build_drafter("medusa", {}, tiny_target).save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "tiny", "path": str(tdir)}}))
    return run


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_full_disk_keeps_the_previous_export_and_the_rerun_replaces_it(run, tiny_target, tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "export"
    export_run(run, output_dir=out, target=tiny_target, num_speculative_tokens=2)
    before = _files(out)
    real = safetensors.torch.save_file

    def save_file(tensors, filename, *a, **k):  # writes part of the weights, then the disk is full
        Path(filename).write_bytes(b"\0" * 5000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(DiskFullError) as err:
        export_run(run, output_dir=out, target=tiny_target, num_speculative_tokens=3, overwrite=True)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"disk full: writing the ") and f"export in {tmp_path} failed after " in msg
    assert "ENOSPC" in msg and f"older exports beside {out}" in msg
    assert _files(out) == before  # the previous export, whole
    assert verify_export(out, tiny_target)["num_speculative_tokens"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .tmp_export / .old_export
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    export_run(run, output_dir=out, target=tiny_target, num_speculative_tokens=3, overwrite=True)  # space freed
    assert verify_export(out, tiny_target)["num_speculative_tokens"] == 3


def test_overwrite_into_a_folder_of_other_files_keeps_them(run, tiny_target, tmp_path):
    """``overwrite=true`` on a folder that is not an export (no export_info.json) moves the export's files in and
    leaves the user's other files there (the whole-folder rename is for previous exports only)."""
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    export_run(run, output_dir=out, target=tiny_target, num_speculative_tokens=2, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    verify_export(out, tiny_target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed"]
