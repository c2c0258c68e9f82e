"""Build the SSSD datastore (suffix array over token ids, SSSD §3.1.2) once from the training data.

    python -m scripts.build_datastore                                       # ShareGPT, all assistant answers
    python -m scripts.build_datastore source=<self-distill job folder> output=data/datastore/selfdistill
    python -m scripts.build_datastore source=my_conversations.jsonl heldout=0 output=data/datastore/mine

``source`` is ``sharegpt`` (the packaged ShareGPT file), a ``.jsonl`` of conversations (both tokenized
with the target's chat template through :func:`drafttrain.data.dataset.build_sft_dataset`, cached), or a
folder of already tokenized rows with ``input_ids`` + ``loss_mask``: a ``datasets`` folder
(``save_to_disk``) or a self-distillation job folder (``manifest.json`` + ``shard_*``, written by
:func:`drafttrain.data.selfdistill.self_distill`). ``heldout`` rows (chosen by ``seed``) are kept out of
the datastore and written to ``<output>/heldout.jsonl`` for ``scripts.sssd_grid`` and
``scripts.bench_sssd_datastore``; held-out rows whose first answer also occurs verbatim as a training
row's first answer (ShareGPT has duplicates) are dropped, and counted. The folder is memory-mapped by
:meth:`drafttrain.verify.methods.sssd_datastore.Datastore.load`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("drafttrain.build_datastore")
HELDOUT_FILE = "heldout.jsonl"


@dataclass
class BuildDatastoreConfig:
    """Schema of ``conf/build_datastore.yaml`` (validated before anything is loaded)."""

    source: str = "sharegpt"  # sharegpt | path/to/conversations.jsonl | folder of tokenized rows
    max_conversations: int | None = None  # conversations read (sharegpt / jsonl); null = all
    max_length: int = 1024  # tokens kept per conversation
    answers_only: bool = True  # documents = assistant answers (loss_mask runs) rather than whole rows
    heldout: int = 200  # rows kept out of the datastore for simulated acceptance
    seed: int = 0
    tokenizer: str | None = None  # HF tokenizer folder; null = the converted target's folder
    output: str = "data/datastore/sharegpt"
    sort_depth: int | None = None  # see build_suffix_array; null = full suffix array
    cache_dir: str | None = None  # tokenized-conversation cache; null = <cache_root>/data


def load_rows(c: BuildDatastoreConfig):
    """Tokenized rows (``datasets.Dataset`` with ``id``, ``input_ids``, ``loss_mask``) from ``c.source``.

    Raises:
        FileNotFoundError / ValueError: the source is neither ``sharegpt``, a .jsonl file nor a rows folder.
    """
    import datasets

    src = c.source
    path = Path(src).expanduser()
    if src != "sharegpt" and path.is_dir():
        if (path / "manifest.json").is_file():  # a self-distillation job folder
            shards = sorted(path.glob("shard_*"))
            if not shards:
                raise FileNotFoundError(f"{path} has a manifest but no shard_* folders")
            ds = datasets.concatenate_datasets([datasets.load_from_disk(str(s)) for s in shards])
            if "order" in ds.column_names:  # restore the input order
                ds = ds.select(sorted(range(len(ds)), key=ds["order"].__getitem__))
        else:
            ds = datasets.load_from_disk(str(path))
        missing = {"input_ids", "loss_mask"} - set(ds.column_names)
        if missing:
            raise ValueError(f"{path}: rows need columns input_ids and loss_mask (missing {sorted(missing)})")
        keep = [k for k in ("id", "input_ids", "loss_mask") if k in ds.column_names]
        return ds.select_columns(keep)

    from transformers import AutoTokenizer

    from drafttrain import assets
    from drafttrain.data.dataset import build_sft_dataset
    from drafttrain.data.sources import LoadStats, load_conversations_jsonl, load_sharegpt

    if src == "sharegpt":
        convs = load_sharegpt(max_conversations=c.max_conversations)
        name = "sharegpt"
    elif src.endswith(".jsonl") and path.is_file():
        convs = load_conversations_jsonl(path, max_conversations=c.max_conversations)
        name = path.stem
    else:
        raise FileNotFoundError(f"source must be 'sharegpt', an existing .jsonl file or a rows folder; got {src!r}")
    tok_dir = Path(c.tokenizer).expanduser() if c.tokenizer else assets.converted_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    cache_root = Path(c.cache_dir).expanduser() if c.cache_dir else assets.cache_root() / "data"
    stats = LoadStats(name="sft")
    ds = build_sft_dataset(convs, tokenizer, c.max_length, cache_root / f"datastore-sft-{name}-{c.max_length}", stats)
    log.info(stats.report())
    return ds


def run(cfg) -> dict:
    """Build, save and describe the datastore. Returns the summary (also in ``datastore.json``).

    Raises:
        drafttrain.config.ConfigError: bad config (before any data is read).
    """
    import numpy as np

    from drafttrain.cliconfig import validate_into
    from drafttrain.config import ConfigError
    from drafttrain.data.dataset import split_heldout
    from drafttrain.verify.methods.sssd_datastore import Datastore, documents_from_rows, first_answer_split

    c = validate_into(BuildDatastoreConfig, cfg)
    if c.heldout < 0 or c.max_length < 1 or (c.sort_depth is not None and c.sort_depth < 1):
        raise ConfigError("heldout must be >= 0, max_length >= 1, sort_depth null or >= 1")
    t0 = time.perf_counter()
    rows = load_rows(c)
    t_rows = time.perf_counter() - t0
    train, held = split_heldout(rows, min(c.heldout, len(rows)), c.seed)
    train_rows = train.to_list()

    def answer_key(row) -> tuple | None:
        split = first_answer_split(row["input_ids"], row["loss_mask"])
        return None if split is None else tuple(split[1])

    seen = {answer_key(r) for r in train_rows}
    held_rows, dropped = [], 0
    for r in held.to_list():
        key = answer_key(r)
        if key is None:
            continue
        if key in seen:
            dropped += 1
            continue
        held_rows.append(r)

    t1 = time.perf_counter()
    meta = {
        "source": c.source,
        "answers_only": c.answers_only,
        "max_length": c.max_length,
        "rows": len(rows),
        "heldout_rows": len(held_rows),
        "heldout_dropped_duplicates": dropped,
        "seed": c.seed,
        "config": asdict(c),
    }
    ds = Datastore.from_documents(documents_from_rows(train_rows, c.answers_only), sort_depth=c.sort_depth, meta=meta)
    t_build = time.perf_counter() - t1
    ds.meta.update(load_rows_seconds=round(t_rows, 2), total_build_seconds=round(t_build, 2))
    out = ds.save(Path(c.output).expanduser())
    with (out / HELDOUT_FILE).open("w") as f:
        for r in held_rows:
            f.write(json.dumps({"id": r.get("id", ""), "input_ids": list(map(int, r["input_ids"])),
                                "loss_mask": list(map(int, r["loss_mask"]))}) + "\n")
    summary = {
        "output": str(out),
        "num_tokens": ds.meta["num_tokens"],
        "num_documents": ds.meta["num_documents"],
        "bytes": ds.nbytes,
        "suffix_array_seconds": ds.meta["build_seconds"],
        "total_build_seconds": ds.meta["total_build_seconds"],
        "load_rows_seconds": ds.meta["load_rows_seconds"],
        "heldout_rows": len(held_rows),
        "heldout_dropped_duplicates": dropped,
        "sa_dtype": str(np.asarray(ds.suffix_array[:0]).dtype),
    }
    log.info("datastore: %s", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("drafttrain").setLevel(logging.INFO)
    c = parse_cli(BuildDatastoreConfig, argv, config_name="build_datastore")
    print(json.dumps(run(c), indent=1))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
