"""Fixtures the export tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, tiny_target):
    """The tiny random target saved as an HF folder (model + tokenizer): what an engine loads."""
    from helpers import save_target

    return save_target(tiny_target, tmp_path_factory.mktemp("tiny_target"))
