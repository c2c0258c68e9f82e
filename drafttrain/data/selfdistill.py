"""Self-distillation: the target regenerates the assistant answer of every prompt (greedy).

The drafter then learns the target's own distribution (ParallelSpec section 5.3: self-distilled data
is its best setting). The target's last hidden states come out of the generation itself
(:meth:`drafttrain.target.Target.generate_greedy`), so training needs no second target forward.

Work is written in shards with a manifest: an interrupted run restarted with the same arguments
skips finished shards and neither duplicates nor drops a prompt. Rows are built from the generated
token ids themselves (no re-tokenisation of decoded text).

Stored columns: ``id`` str, ``input_ids`` int32 [L], ``loss_mask`` int8 [L] (1 on generated tokens),
``features`` float16 [L-1, d] (f_0..f_{L-2}), ``finish_reason`` str, ``num_prompt`` int32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

FORMAT_VERSION = 2


def distill_key(
    conversations: list[dict], target_name: str, max_new_tokens: int, max_length: int, max_prompt_length: int | None = None
) -> str:
    """Fingerprint of a self-distillation job (inputs + generation settings)."""
    h = hashlib.sha256()
    for c in conversations:
        h.update(c["id"].encode())
        h.update(json.dumps(c["messages"], sort_keys=True).encode())
    h.update(f"{target_name}|{max_new_tokens}|{max_length}|{max_prompt_length}|v{FORMAT_VERSION}".encode())
    return h.hexdigest()[:16]


def _prompt_messages(messages: list[dict]) -> list[dict] | None:
    """Messages up to and including the first user turn (system kept); None if there is no user turn."""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            return messages[: i + 1]
    return None


def self_distill(
    target,
    conversations: list[dict],
    out_dir: str | Path,
    max_new_tokens: int,
    max_length: int,
    batch_size: int = 16,
    progress: bool = True,
    max_prompt_length: int | None = None,
):
    """Regenerate the first assistant turn of every conversation with the target and store the rows.

    Args:
        target: a :class:`drafttrain.target.Target` (with tokenizer).
        conversations: ``[{"id", "messages": [{"role", "content"}]}]`` (e.g. from ``load_sharegpt``).
        out_dir: job folder; shards and ``manifest.json`` live here; reused when complete.
        max_new_tokens: answer length cap (tokens).
        max_length: cap on prompt + answer; prompts longer than ``max_length - 8`` are skipped.
        max_prompt_length: optional tighter cap on prompt tokens (long prompts make batched
            generation slow and teach the drafter little about answers); longer prompts are skipped.
        batch_size: prompts per generation batch (also the shard size).

    Returns:
        ``(dataset, report)``: a memory-mapped ``datasets.Dataset`` in input order (skipped prompts
        left out) and a dict of counts with ``generated + skipped == input``.
    """
    import datasets

    from drafttrain.data.template import prompt_ids

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    d = target.config.hidden_size

    skipped: Counter = Counter()
    todo: list[tuple[str, list[int]]] = []
    for conv in conversations:
        msgs = _prompt_messages(conv["messages"])
        if msgs is None:
            skipped["no user turn"] += 1
            continue
        try:
            ids = prompt_ids(tok, msgs)
        except Exception as e:  # a template that cannot render this conversation
            skipped[f"template error: {type(e).__name__}"] += 1
            continue
        if len(ids) > min(max_length - 8, max_prompt_length or max_length):
            skipped["prompt too long"] += 1
            continue
        todo.append((conv["id"], ids))

    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"shards": {}}
    # shards group prompts of similar length (little left padding); the input order is restored at the end
    by_length = sorted(range(len(todo)), key=lambda i: (len(todo[i][1]), i))
    shards = [by_length[i : i + batch_size] for i in range(0, len(by_length), batch_size)]
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "features": datasets.Array2D(shape=(None, d), dtype="float16"),
            "finish_reason": datasets.Value("string"),
            "num_prompt": datasets.Value("int32"),
            "order": datasets.Value("int32"),
        }
    )
    pending = [i for i in range(len(shards)) if str(i) not in manifest["shards"]]
    bar = tqdm(total=len(todo), desc="self-distill", unit="prompt", disable=not progress,
               initial=sum(len(shards[i]) for i in range(len(shards)) if str(i) in manifest["shards"]))
    t0, new_tokens = time.time(), 0
    for i in pending:
        batch = [todo[j] for j in shards[i]]
        results = target.generate_greedy([ids for _, ids in batch], max_new_tokens=max_new_tokens)
        rows = {k: [] for k in features}
        for j, (cid, _), r in zip(shards[i], batch, results):
            rows["order"].append(j)
            tokens = r["tokens"][:max_length]
            n_prompt = r["num_prompt"]
            new_tokens += len(r["tokens"]) - n_prompt
            rows["id"].append(cid)
            rows["input_ids"].append(tokens)
            rows["loss_mask"].append([0] * n_prompt + [1] * (len(tokens) - n_prompt))
            rows["features"].append(r["features"][: len(tokens) - 1].to(torch.float16).numpy())
            rows["finish_reason"].append(r["finish_reason"])
            rows["num_prompt"].append(n_prompt)
        shard_dir = out_dir / f"shard_{i:05d}"
        tmp = out_dir / f".tmp_shard_{i:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp))
        shutil.rmtree(shard_dir, ignore_errors=True)
        tmp.rename(shard_dir)
        manifest["shards"][str(i)] = {"rows": len(batch)}
        _atomic_write(manifest_path, json.dumps(manifest))  # the shard counts only once recorded here
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    bar.close()
    parts = [datasets.load_from_disk(str(out_dir / f"shard_{i:05d}")) for i in range(len(shards))]
    if parts:
        ds = datasets.concatenate_datasets(parts)
        ds = ds.select(_argsort(ds["order"]))  # back to input order
    else:
        ds = datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    report = {
        "input": len(conversations),
        "generated": len(todo),
        "skipped": sum(skipped.values()),
        "skip_reasons": dict(skipped),
        "generated_tokens_this_run": new_tokens,
        "seconds_this_run": round(time.time() - t0, 1),
    }
    _atomic_write(out_dir / "report.json", json.dumps(report, indent=1))
    log.info("self-distillation: %s", report)
    return ds, report


def _argsort(values) -> list[int]:
    values = list(values)
    return sorted(range(len(values)), key=values.__getitem__)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
