"""Hydra entry point: `accelerate launch train.py +recipe=NAME [overrides]`. Safe to import."""

from drafttrain.assets import offline_by_default

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    import logging

    from drafttrain.config import ConfigError
    from drafttrain.train import run

    logging.getLogger("drafttrain").setLevel(logging.INFO)
    try:
        run(cfg)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


if __name__ == "__main__":
    offline_by_default()  # HF_HUB_OFFLINE=1 unless set: before any Hugging Face library is imported
    main()
