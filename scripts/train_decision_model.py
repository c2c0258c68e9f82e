"""Train the MCSD early-stop decision model (MCSD-improved §3.3): its own job, no target, no drafter.

    python -m scripts.evaluate checkpoint=RUN 'methods=[mcsd]' 'mcsd.target_roots=[1]' \
        mcsd.decisions_out=outputs/decisions/mt_bench.jsonl prompt_offset=16 num_prompts=40   # the labels
    python -m scripts.train_decision_model 'data=[outputs/decisions/mt_bench.jsonl]'          # the model
    python -m scripts.evaluate checkpoint=RUN 'methods=[mcsd]' mcsd.decision_model=outputs/decision_model/decision_model

Config: :class:`drafttrain.config.DecisionModelConfig` (``--help`` lists the keys), validated before
anything is read. Writes ``<output_dir>/decision_model/`` (the model ``mcsd.decision_model`` loads),
``metrics.jsonl`` and ``final_metrics.json``; a W&B offline run when ``logging.wandb``.
Why not ``train.py``: that entry point trains a drafter for a frozen target; this model is a small MLP
on logged level features, with its own keys, so it gets its own schema instead of a switch inside
:class:`~drafttrain.config.TrainConfig`.
"""

from __future__ import annotations

from typing import Any

from drafttrain.config import DecisionModelConfig


def run(cfg: Any) -> dict[str, Any]:
    """Validate ``cfg`` (a :class:`DecisionModelConfig`, a dict or a composed config) and train.

    Returns:
        The final metrics (also in ``<output_dir>/final_metrics.json``).

    Raises:
        ConfigError: an unknown key or a bad value (before any data is read).
        FileNotFoundError / ValueError: unreadable decision logs (:func:`drafttrain.train.decision_model.read_decisions`).
    """
    from drafttrain.validation import validate
    from drafttrain.train.decision_model import train_decision_model

    return train_decision_model(validate(cfg, DecisionModelConfig))


def main(argv: list[str] | None = None) -> None:
    import logging

    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(parse_cli(DecisionModelConfig, argv))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
