"""Self-distillation data generation: the target regenerates every assistant turn of a conversation source.

    python -m scripts.generate_data                                   # conf/generate.yaml: 200 ShareGPT conversations
    python -m scripts.generate_data target=tiny max_conversations=8   # seconds, tiny random target
    python -m scripts.generate_data source=convs.jsonl generation.max_turns=1 generation.sampling.temperature=1.0

Writes ``output_dir/``: ``dataset/`` (a ``datasets`` folder: input_ids, loss_mask and metadata, in
input order), ``report.json`` (``generated + skipped + failed == input`` with every reason),
``skipped.jsonl`` (one line per skipped conversation), ``manifest.json`` + ``shard_*/`` (the unit of
resume). Killed at any point, the same command resumes and finishes without duplicating or dropping a
conversation. The config is validated (``drafttrain.config.GenerateConfig``) before any model loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from drafttrain.config import GenerateConfig, to_dict
from drafttrain.validation import validate

log = logging.getLogger(__name__)


def run(cfg) -> dict:
    """Generate as configured; returns the report (also written to ``output_dir/report.json``).

    Args:
        cfg: a composed ``DictConfig``, a plain dict, or a :class:`GenerateConfig`.

    Raises:
        ConfigError: unknown key / bad value (before anything is loaded).
        drafttrain.data.shards.JobMismatchError: ``output_dir`` holds another job.
    """
    c = validate(cfg, GenerateConfig)
    import torch

    from drafttrain.data.selfdistill import generate_dataset
    from drafttrain.data.sources import LoadStats, load_conversations
    from drafttrain.compose import build_run

    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    out = Path(c.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = LoadStats(name=c.source)
    convs = load_conversations(c.source, split=c.split, max_conversations=c.max_conversations, stats=stats)
    log.info(stats.report())
    target = build_run(c, device="auto").target  # CUDA where torch sees a device
    from drafttrain.preflight import check_target

    with torch.random.fork_rng(devices=[]):  # before any conversation: one line if the target cannot be driven
        check_target(target, engine=c.generation.backend == "engine")
    from drafttrain.fingerprint import target_fingerprint

    fp = target_fingerprint(c.target)  # the target's content (config + weights), not its name
    _, report = generate_dataset(target, convs, out, c.generation, target_name=fp, load_stats=stats, progress=c.progress,
                                 max_seconds=60 * c.max_minutes if c.max_minutes else None)
    (out / "config.json").write_text(json.dumps(to_dict(c), indent=1))
    r = report
    if not r["complete"]:
        print(f"[generate_data] {out}: stopped after max_minutes={c.max_minutes} with {r['conversations_done']} of "
              f"{r['conversations_planned']} conversations done ({r['this_run']['tokens_per_s']} tokens/s); "
              f"run the same command again to continue", flush=True)
        return report
    print(
        f"[generate_data] {out}: input {r['input']} = generated {r['generated']} + skipped {r['skipped']} + failed {r['failed']}\n"
        f"  skipped: {r['skip_reasons'] or 'none'}\n  failed: {r['fail_reasons'] or 'none'}\n"
        f"  turns {r['turns_generated']}, answer tokens {r['tokens_generated']}, finish {r['finish_reasons']}, "
        f"end {r['end_reasons']}\n  this run: {r['this_run']['generated_tokens']} tokens in {r['this_run']['seconds']} s "
        f"({r['this_run']['tokens_per_s']} tokens/s)",
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(parse_cli(GenerateConfig, argv, config_name="generate"))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
