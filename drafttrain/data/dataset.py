"""Tokenized SFT dataset (``id``, ``input_ids``, ``loss_mask``) with an atomic, fingerprinted disk cache."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from datasets import Dataset, Features, List, Value, load_from_disk

from drafttrain.atomic import fsync_path, replace_dir
from drafttrain.data import template
from drafttrain.data.sources import LoadStats

log = logging.getLogger(__name__)

#: Bump when the row format or the tokenization rules change: every cache is rebuilt.
FORMAT_VERSION = 1
#: Written inside the saved dataset folder, so it is renamed into place together with the data.
META_FILE = "drafttrain_sft.json"
FEATURES = Features({"id": Value("string"), "input_ids": List(Value("int32")), "loss_mask": List(Value("int8"))})


def _fingerprint(conversations: Sequence[dict], tokenizer, max_length: int) -> str:
    h = hashlib.sha256()
    for conv in conversations:
        h.update(json.dumps([conv["id"], conv["messages"]], ensure_ascii=False, sort_keys=True).encode("utf-8"))
        h.update(b"\0")
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "max_length": max_length,
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode("utf-8"))
    return h.hexdigest()


def _read_meta(path: Path) -> dict | None:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def _merge_stats(stats: LoadStats | None, saved: dict) -> None:
    if stats is not None:
        stats.read += saved["read"]
        stats.kept += saved["kept"]
        stats.skipped.update(saved["skipped"])


def build_sft_dataset(
    conversations: Sequence[dict],
    tokenizer,
    max_length: int,
    cache_path: Path | None,
    stats: LoadStats | None = None,
) -> Dataset:
    """Tokenize conversations into a training dataset, cached on disk.

    Args:
        conversations: ``[{"id": str, "messages": [{"role", "content"}, ...]}, ...]`` (as returned by
            the loaders in :mod:`drafttrain.data.sources`).
        tokenizer: Hugging Face tokenizer with a chat template (the target's).
        max_length: tokens kept per row (the start of the conversation).
        cache_path: folder for the cached dataset, or None for no cache. A cache is reused only when
            its fingerprint matches: sha256 of every conversation's id + messages, the tokenizer's
            ``name_or_path``, vocab size and chat template, ``max_length`` and :data:`FORMAT_VERSION`.
            Otherwise the dataset is rebuilt, saved to a temporary folder beside ``cache_path`` and
            renamed into place (an interrupted build never leaves a cache that a later run trusts).
        stats: counters of this stage (pass a fresh ``LoadStats(name="sft")``): ``read`` += number of
            conversations, ``kept`` += rows, ``skipped[reason]`` for each conversation dropped
            (the :class:`~drafttrain.data.template.TemplateError`'s ``reason``, e.g.
            ``"no assistant token within max_length"``). On a cache hit the saved counts are added.

    Returns:
        ``datasets.Dataset`` with columns ``id`` (string), ``input_ids`` (list[int32], length s_i <=
        max_length) and ``loss_mask`` (list[int8], same length, at least one 1); memory-mapped from
        ``cache_path`` when a cache is used.

    Raises:
        ValueError: ``max_length`` < 1.
        OSError: the cache folder cannot be written.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    fingerprint = None
    if cache_path is not None:
        cache_path = Path(cache_path)
        fingerprint = _fingerprint(conversations, tokenizer, max_length)
        meta = _read_meta(cache_path)
        if meta is not None and meta.get("fingerprint") == fingerprint:
            ds = load_from_disk(str(cache_path))
            _merge_stats(stats, meta["stats"])
            log.info("loaded %d cached SFT rows from %s", len(ds), cache_path)
            return ds

    local = LoadStats(name="sft")
    rows: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    for conv in conversations:
        local.read += 1
        try:
            out = template.tokenize_conversation(tokenizer, conv["messages"], max_length=max_length)
        except template.TemplateError as err:
            local.skipped[err.reason] += 1
            log.debug("skipping conversation %s: %s", conv.get("id"), err)
            continue
        if not any(out["loss_mask"]):  # tokenize_conversation already refuses this; kept as a guard
            local.skipped["no assistant token within max_length"] += 1
            continue
        local.kept += 1
        rows["id"].append(str(conv["id"]))
        rows["input_ids"].append(out["input_ids"])
        rows["loss_mask"].append(out["loss_mask"])
    log.info(local.report())
    _merge_stats(stats, local.as_dict())
    ds = Dataset.from_dict(rows, features=FEATURES)
    if cache_path is None:
        return ds

    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_path.parent, prefix=f".{cache_path.name}.tmp-"))  # unique per process
    try:
        ds.save_to_disk(str(tmp))
        (tmp / META_FILE).write_text(
            json.dumps({"fingerprint": fingerprint, "format_version": FORMAT_VERSION, "max_length": max_length,
                        "tokenizer": str(getattr(tokenizer, "name_or_path", "")), "stats": local.as_dict()}, indent=1)
        )
        fsync_path(tmp)
        replace_dir(tmp, cache_path)  # drafttrain.atomic: the old folder whole until the rename
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("saved %d SFT rows to %s", len(ds), cache_path)
    return load_from_disk(str(cache_path))


def split_heldout(ds: Dataset, n_heldout: int, seed: int) -> tuple[Dataset, Dataset]:
    """Split off ``n_heldout`` random rows, deterministically for a given ``seed``.

    Args:
        ds: any dataset.
        n_heldout: rows in the held-out part, 0 <= n_heldout <= len(ds).
        seed: numpy ``default_rng`` seed choosing the held-out rows.

    Returns:
        ``(train, heldout)``; both keep the original row order; no indices cache file is written.

    Raises:
        ValueError: ``n_heldout`` out of range.
    """
    if not 0 <= n_heldout <= len(ds):
        raise ValueError(f"n_heldout must be in [0, {len(ds)}], got {n_heldout}")
    chosen = np.zeros(len(ds), dtype=bool)
    chosen[np.random.default_rng(seed).permutation(len(ds))[:n_heldout]] = True
    train = ds.select(np.flatnonzero(~chosen).tolist(), keep_in_memory=True)
    heldout = ds.select(np.flatnonzero(chosen).tolist(), keep_in_memory=True)
    return train, heldout
