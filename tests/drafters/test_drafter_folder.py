"""A drafter folder that is truncated or does not match its config is refused in one line naming the file.

Why: ``scripts.evaluate preset=training`` on a truncated ``drafter.safetensors`` ended in a traceback
(``SafetensorError: ... incomplete metadata``)."""

from __future__ import annotations

import json

import pytest

from drafttrain.cliconfig import FatalError
from drafttrain.drafters import Drafter


@pytest.fixture
def folder(make_drafter, tmp_path):
    make_drafter().save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


def test_a_whole_folder_loads(folder, tiny_target):
    assert Drafter.from_pretrained(folder, tiny_target).name == "parallelspec"


def test_truncated_weights_are_refused_naming_the_file(folder, tiny_target):
    w = folder / "drafter.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(FatalError, match=f"^{w}: cannot be read .*100 bytes.*truncated or corrupt"):
        Drafter.from_pretrained(folder, tiny_target)


def test_missing_weights_and_a_truncated_config_are_refused(folder, tiny_target):
    cfg = folder / "drafter_config.json"
    text = cfg.read_text()
    cfg.write_text(text[: len(text) // 2])
    with pytest.raises(FatalError, match=f"^{cfg}: not a drafter config"):
        Drafter.from_pretrained(folder, tiny_target)
    cfg.write_text(text)
    (folder / "drafter.safetensors").unlink()
    with pytest.raises(FatalError, match="drafter.safetensors: missing"):
        Drafter.from_pretrained(folder, tiny_target)


def test_weights_of_another_config_are_refused_naming_the_tensors(folder, tiny_target):
    cfg = folder / "drafter_config.json"
    c = json.loads(cfg.read_text())
    c["num_mask_tokens"] = int(c["num_mask_tokens"]) + 2  # the config says more [MASK] tokens than were saved
    cfg.write_text(json.dumps(c))
    with pytest.raises(FatalError, match=r"drafter.safetensors: does not match drafter_config.json \(parallelspec\): "
                                         r"tensors of other shapes than drafter_config.json says: mask"):  # fmt: skip
        Drafter.from_pretrained(folder, tiny_target)
