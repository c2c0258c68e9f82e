"""The training data pipeline: sources -> rows -> datasets, the held-out split.

:func:`prepare_data` is what the training loop (:mod:`drafttrain.train`) and the scripts and tests that
need a run's exact datasets call: conversations from the configured source (:func:`load_conversations`),
self-distilled by the target (:mod:`drafttrain.data.selfdistill`, the default), tokenized as they are
(:mod:`drafttrain.data.dataset`), or read from a folder ``scripts.generate_data`` wrote; features from
the rows themselves, a feature cache (:mod:`drafttrain.data.feature_cache`) or a live target forward per
batch (:func:`drafttrain.data.batches.get_batch`), always of the layers the drafter declares
(:class:`drafttrain.drafters.base.DrafterSpec`). Batches and their order: :mod:`drafttrain.data.batches`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from drafttrain.config import TrainConfig

log = logging.getLogger(__name__)


def load_conversations(c: TrainConfig) -> list[dict]:
    """Conversations from the configured source (ShareGPT by default, a .jsonl/.json file or an HF dataset folder)."""
    from drafttrain.data.sources import LoadStats
    from drafttrain.data.sources import load_conversations as load_source

    stats = LoadStats(name=c.data.source)
    convs = load_source(c.data.source, split=c.data.split, max_conversations=c.data.max_conversations, stats=stats)
    log.info(stats.report())
    if c.data.first_turn_only:
        convs = [_first_turn(conv) for conv in convs]
    return convs


def _first_turn(conv: dict) -> dict:
    msgs = conv["messages"]
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and i > 0:
            return {**conv, "messages": msgs[: i + 1]}
    return conv


def data_cache_dir(c: TrainConfig) -> Path:
    from drafttrain.assets import cache_root

    return Path(c.data.cache_dir).expanduser() if c.data.cache_dir else cache_root() / "data"


def prepare_data(c: TrainConfig, target, accelerator, feature_layers=None, reports: dict | None = None):
    """Build (rank 0 first, the others then load the cache) the train and held-out datasets.

    Rows come from ``data.source``: self-distilled in training (``data.self_distill``, the default),
    tokenized as they are, or read from a folder ``scripts.generate_data`` wrote
    (``data.source=generated data.path=...``). Features: the rows' stored ``features`` column
    (``data.features=auto``), a feature cache (``cache``), or a live target forward per batch (``live``).

    ``feature_layers``: the target layers the drafter declares (``Drafter.layers_for``; default the final
    post-norm state). Self-distillation stores exactly these; a feature cache must hold exactly these
    (else :class:`~drafttrain.data.feature_cache.FeatureCacheError`); a generated dataset's stored
    features are used only when they are these (its ``report.json``), else features are computed live.

    ``reports``: a dict that gets the self-distillation report as ``reports["selfdistill"]`` (with ``budget``
    and ``budget_cut`` when ``data.self_distill_minutes`` applied; :func:`drafttrain.data.selfdistill.generate_dataset`).

    Raises:
        RuntimeError: self-distillation failed on every conversation (the message: how many, and the first
            failure's conversation id and exception in one line), or no training sequence is left.
    """
    from drafttrain.data.dataset import build_sft_dataset, split_heldout
    from drafttrain.data.sources import LoadStats
    from drafttrain.data.selfdistill import all_failed_message, distill_key, load_generated, self_distill
    from drafttrain.target import resolve_feature_layers

    L = target.num_hidden_layers
    layers = resolve_feature_layers(feature_layers, L)
    key_layers = None if layers == (L,) else layers  # the final state keeps the cache keys of older runs
    stored_ok = True  # the dataset's own features column (if any) holds the declared layers
    with accelerator.main_process_first():
        if c.data.source == "generated":
            ds = load_generated(c.data.path)
            log.info("generated dataset %s: %d rows", c.data.path, len(ds))
            report = Path(c.data.path) / "report.json"
            stored = json.loads(report.read_text()).get("feature_layers") if report.is_file() else None
            stored_ok = tuple(stored) == layers if stored is not None else layers == (L,)
        else:
            convs = load_conversations(c)
            n_input = len(convs)
            raw_part = None
            if c.data.self_distill and c.data.dataset_share > 0:  # a mix: these conversations stay as they are
                convs, raw_convs = split_share(convs, c.data.dataset_share)
                raw_stats = LoadStats(name="dataset rows")
                raw_part = build_sft_dataset(raw_convs, target.tokenizer, c.data.max_length,
                                             data_cache_dir(c) / "sft" / f"mix-{len(raw_convs)}-{c.data.max_length}",
                                             stats=raw_stats)  # fmt: skip
                stored_ok = False  # one features source for every row: live or the labelled cache
            if c.data.self_distill:
                from drafttrain.fingerprint import target_fingerprint

                name = target_fingerprint(c.target)  # the target's content (config + weights), not its name
                gen = c.data.generation
                key = distill_key(convs, name, gen.max_new_tokens, c.data.max_length, gen.max_prompt_length,
                                  c.data.first_turn_only, key_layers, gen.backend, target.dtype_name)
                ds, report = self_distill(
                    target,
                    convs,
                    data_cache_dir(c) / "selfdistill" / key,
                    max_new_tokens=gen.max_new_tokens,
                    max_length=c.data.max_length,
                    batch_size=gen.batch_size,
                    max_prompt_length=gen.max_prompt_length,
                    first_turn_only=c.data.first_turn_only,
                    target_name=name,
                    progress=c.trainer.progress and accelerator.is_main_process,
                    feature_layers=layers,
                    backend=gen.backend,
                    vllm=gen.vllm,
                    budget_minutes=c.data.self_distill_minutes,
                )
                if reports is not None:
                    reports["selfdistill"] = report
                failure = all_failed_message(report)  # every conversation failed: its cause, not "no training sequences"
                if failure:
                    raise RuntimeError(failure)
                if raw_part is not None:
                    ds, mix = mix_rows(ds, raw_part, report, raw_stats, n_input)
                    if reports is not None:
                        reports["mix"] = mix
            else:
                key = f"sft-{len(convs)}-{c.data.max_length}"
                ds = build_sft_dataset(convs, target.tokenizer, c.data.max_length, data_cache_dir(c) / "sft" / key)
    if c.data.features == "cache":
        from drafttrain.data.feature_cache import attach_feature_cache

        folder = c.data.feature_cache
        if folder == "auto":
            with accelerator.main_process_first():
                folder = label_rows(c, target, ds, layers, progress=c.trainer.progress and accelerator.is_main_process)
        ds = attach_feature_cache(ds, folder, target_cfg=c.target, feature_layers=layers, num_hidden_layers=L)
    elif not stored_ok and "features" in ds.column_names:
        log.info("the dataset's stored features are not of layers %s (the drafter's): computing them live", list(layers))
    keep = [k for k in ("input_ids", "loss_mask", "features") if k in ds.column_names]
    if c.data.features == "live" or (c.data.features == "auto" and not stored_ok):
        keep = [k for k in keep if k != "features"]
    ds = ds.select_columns(keep)
    if c.data.source == "generated" and c.data.max_length:
        ds = truncate_rows(ds, c.data.max_length)
    ds = ds.with_format("torch")
    if c.data.heldout > 0 and len(ds) > c.data.heldout and c.data.heldout_split == "head":
        train, held = ds.select(range(c.data.heldout, len(ds))), ds.select(range(c.data.heldout))
    elif c.data.heldout > 0 and len(ds) > c.data.heldout:
        train, held = split_heldout(ds, c.data.heldout, c.seed)
    else:
        train, held = ds, None
    if len(train) == 0:
        raise RuntimeError("no training sequences: check data.source / data.max_conversations")
    return train, held


def split_share(convs: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """(conversations to self-distil, conversations kept as they are): a conversation is a dataset row when the
    first 8 hex digits of sha256(its id), read as a fraction of 2^32, fall below ``share`` (``data.dataset_share``).
    Decided per conversation, so growing ``max_conversations`` keeps every earlier conversation on its side."""
    import hashlib

    def raw(conv) -> bool:
        return int(hashlib.sha256(str(conv["id"]).encode()).hexdigest()[:8], 16) / 2**32 < share

    return [cv for cv in convs if not raw(cv)], [cv for cv in convs if raw(cv)]


def mix_rows(distilled, dataset_rows, report: dict, raw_stats, n_input: int):
    """The mixed training set: self-distilled rows then dataset rows (``input_ids``, ``loss_mask``), and its counts
    ``{"input", "self_distilled", "dataset", "skipped"}`` with ``self_distilled + dataset + skipped == input``
    (skipped: self-distillation's skipped, failed and budget-cut conversations and the dataset rows' skipped ones).

    Raises:
        RuntimeError: the counts do not add up (a conversation was lost).
    """
    import datasets

    cols = ["input_ids", "loss_mask"]
    feats = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                               "loss_mask": datasets.List(datasets.Value("int8"))})  # fmt: skip
    a = distilled.with_format(None).select_columns(cols).cast(feats)
    b = dataset_rows.with_format(None).select_columns(cols).cast(feats)
    skipped = report["skipped"] + report["failed"] + report.get("budget_cut", 0) + sum(raw_stats.skipped.values())
    mix = {"input": n_input, "self_distilled": len(a), "dataset": len(b), "skipped": skipped}
    if mix["self_distilled"] + mix["dataset"] + mix["skipped"] != n_input:
        raise RuntimeError(f"lost count: self_distilled + dataset + skipped != input in {mix}")
    log.info("training rows: input %d = self-distilled %d + dataset rows %d + skipped %d", n_input, len(a), len(b), skipped)
    return datasets.concatenate_datasets([a, b]), mix


def label_rows(c: TrainConfig, target, ds, layers, progress: bool = True) -> Path:
    """Label ``ds``'s rows with the frozen target once (``data.feature_cache=auto``): its teacher-forced hidden
    states of the drafter's ``layers`` at every position, whatever the text's origin (self-distilled or dataset
    rows: the drafter's labels are then the target's own distribution, read through its LM head from the
    final state), stored in ``data.feature_cache_dtype`` under ``<data cache>/features/<key>``
    (:func:`drafttrain.data.feature_cache.build_feature_cache`: shards, resumable, its size estimated before
    it is written). The key: the rows' fingerprint, the target's content and loaded dtype, the layers,
    the storage dtype and ``data.pack_tokens``. Returns the folder."""
    import hashlib

    from drafttrain.data.feature_cache import ROWS_FINGERPRINT, build_feature_cache, estimate_bytes
    from drafttrain.fingerprint import dataset_fingerprint, target_fingerprint

    fp = target_fingerprint(c.target)
    rows_fp = dataset_fingerprint(ds, **ROWS_FINGERPRINT)
    key = hashlib.sha256(json.dumps([rows_fp, fp, target.dtype_name, list(layers), c.data.feature_cache_dtype,
                                     c.data.pack_tokens]).encode()).hexdigest()[:16]  # fmt: skip
    folder = data_cache_dir(c) / "features" / key
    lengths = [len(x) for x in ds.with_format(None)["input_ids"]]
    est = estimate_bytes(lengths, target.config.hidden_size, 0, 64, num_layers=len(layers))
    log.info("labelling %d rows (%d tokens) with the target (%s), layers %s: about %.1f GiB in %s", len(ds),
             sum(lengths), target.dtype_name, list(layers), est / 2**30, folder)
    build_feature_cache(target, ds, folder, dtype=c.data.feature_cache_dtype, batch_size=8, shard_size=64,
                        target_name=c.target.name, target_fingerprint=fp, progress=progress, feature_layers=layers,
                        pack_tokens=c.data.pack_tokens)
    return folder


class LocalProcess:
    """Stands in for an Accelerator in :func:`prepare_data` outside ``accelerate launch`` (one process:
    scripts and tests that need the run's exact datasets)."""

    is_main_process = True
    process_index = 0
    num_processes = 1

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()


def truncate_rows(ds, max_length: int):
    """Keep the first ``max_length`` tokens of every row (features: the first ``max_length - 1``).

    Rows left without any loss-mask 1 are dropped (counted in the log), so no all-zero mask is trained on.
    """
    lengths = [len(x) for x in ds.with_format(None)["input_ids"]]
    if max(lengths, default=0) <= max_length:
        return ds

    def cut(row):
        out = {"input_ids": row["input_ids"][:max_length], "loss_mask": row["loss_mask"][:max_length]}
        if "features" in row:
            out["features"] = row["features"][: max_length - 1]
        return out

    before = len(ds)
    ds = ds.map(cut, desc="truncate", keep_in_memory=True)
    ds = ds.filter(lambda row: any(row["loss_mask"]), keep_in_memory=True)
    if len(ds) < before:
        log.warning("%d rows have no answer token within data.max_length=%d and were dropped", before - len(ds), max_length)
    return ds
