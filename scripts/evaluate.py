"""Evaluate a drafter with the bundled batched verifier (plain vs speculative, per batch size and engine mode).

    python -m scripts.evaluate checkpoint=outputs/parallelspec-smollm2-135m-instruct prompts=mt_bench \
        batch_sizes=[1,4,8,16] temperature=0

Config: conf/evaluate.yaml (validated into drafttrain.config.EvalConfig: a typo'd key fails before any
model loads). Writes results.json, outputs.jsonl, report.md and plots/ to ``output_dir``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    import logging

    from drafttrain.config import ConfigError
    from drafttrain.eval.harness import evaluate

    try:
        results = evaluate(cfg)
    except ConfigError as err:
        logging.getLogger("drafttrain").error("%s", err)
        raise SystemExit(2) from None
    print(f"[drafttrain] wrote {cfg.output_dir}/report.md (greedy_equal={results['greedy_equal']})", flush=True)


if __name__ == "__main__":
    main()
