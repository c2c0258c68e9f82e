"""Offline feature cache: run the target once over a dataset and store its hidden states (the final
post-norm state, or the layers a drafter declares: ``feature_layers=[i,j]``).

    python -m scripts.cache_features dataset=data/generated/NAME estimate=true  # print the bytes, exit
    python -m scripts.cache_features dataset=data/generated/NAME top_k=8 dtype=bfloat16

``dataset`` is a ``scripts.generate_data`` output folder or any ``save_to_disk`` folder with
``input_ids``. Writes ``output_dir`` (default ``<dataset>/features-<target>``): shards + manifest
(resumable: the same command continues an interrupted run) and ``feature_cache.json`` (schema
version, dataset fingerprint, bytes estimated and written). Train on it with
``data.features=cache data.feature_cache=<output_dir>``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from drafttrain.config import CacheFeaturesConfig
from drafttrain.validation import validate

log = logging.getLogger(__name__)


def run(cfg) -> dict:
    """Estimate (``estimate=true``) or build the cache; returns ``{"bytes_estimated", ...}`` metadata.

    Raises:
        ConfigError: unknown key / bad value (before anything is loaded).
        FileNotFoundError: ``dataset`` is not a dataset folder.
    """
    c = validate(cfg, CacheFeaturesConfig)
    import torch
    from transformers import AutoConfig

    from drafttrain.target import resolve_feature_layers

    from drafttrain.data.feature_cache import build_feature_cache, estimate_bytes
    from drafttrain.data.selfdistill import load_generated
    from drafttrain.compose import build_run
    from drafttrain.target import resolve_target_dir

    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    ds = load_generated(c.dataset)
    out = Path(c.output_dir or Path(c.dataset) / f"features-{c.target.name}")
    lengths = [len(x) for x in ds.with_format(None)["input_ids"]]
    mcfg = c.target if c.target.random_init else AutoConfig.from_pretrained(resolve_target_dir(c.target))
    d = mcfg.hidden_size
    layers = resolve_feature_layers(c.feature_layers, mcfg.num_hidden_layers)  # a bad id fails before the target loads
    est = estimate_bytes(lengths, d, c.top_k, c.shard_size, num_layers=len(layers))
    print(f"[cache_features] {len(ds)} rows, {sum(max(n - 1, 0) for n in lengths)} positions, d={d}, "
          f"layers={list(layers)}, top_k={c.top_k}: "
          f"estimated {est} bytes ({est / 2**20:.1f} MiB) in {out}", flush=True)
    if c.estimate:
        return {"bytes_estimated": est, "rows": len(ds)}
    target = build_run(c, device="auto").target  # CUDA where torch sees a device
    from drafttrain.fingerprint import target_fingerprint

    fp = target_fingerprint(c.target)  # the target's content (config + weights), not its name
    meta = build_feature_cache(target, ds, out, dtype=c.dtype, top_k=c.top_k, batch_size=c.batch_size,
                               shard_size=c.shard_size, target_name=c.target.name, target_fingerprint=fp, progress=c.progress,
                               feature_layers=layers)
    off = 100 * (meta["bytes_written"] - meta["bytes_estimated"]) / max(meta["bytes_estimated"], 1)
    print(f"[cache_features] wrote {meta['bytes_written']} bytes (estimate {meta['bytes_estimated']}, {off:+.2f}%): "
          f"{json.dumps({k: meta[k] for k in ('rows', 'dtype', 'top_k', 'schema_version')})}", flush=True)
    return meta


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(parse_cli(CacheFeaturesConfig, argv, config_name="cache_features"))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
