"""Hydra entry point: `accelerate launch train.py +recipe=NAME [overrides]`. Safe to import."""

from drafttrain.assets import offline_by_default

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    import logging

    from drafttrain.cliconfig import FatalError
    from drafttrain.config import ConfigError
    from drafttrain.train import run

    logging.getLogger("drafttrain").setLevel(logging.INFO)
    try:
        run(cfg)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    except FatalError as e:  # a full disk, a dead vLLM process: one line; the relaunch resumes
        raise SystemExit(str(e)) from None


def check_moved_keys(argv: list[str]) -> None:
    """A key that moved (``trainer.spec_eval_every`` -> ``trainer.spec_eval.every``) exits naming its new
    home, before Hydra's generic "Could not override" message."""
    from drafttrain.cliconfig import ConfigError, check_moved
    from drafttrain.config import MOVED_KEYS

    if any(a.lstrip("+") == "recipe=decision_model" for a in argv):
        raise SystemExit("config error: the MCSD decision model has its own entry point (no target, no drafter): "
                         "python -m scripts.train_decision_model 'data=[<decision log>.jsonl]' (--help lists the keys)")
    try:
        check_moved([a for a in argv if not a.startswith("-")], MOVED_KEYS)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


if __name__ == "__main__":
    import sys

    offline_by_default()  # HF_HUB_OFFLINE=1 unless set: before any Hugging Face library is imported
    check_moved_keys(sys.argv[1:])
    main()
