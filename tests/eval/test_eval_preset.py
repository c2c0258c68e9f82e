"""One evaluator: ``python -m scripts.evaluate preset=training`` runs a training run's own evaluation again on its
saved drafter and gives the run's eval/tau and outputs exactly (tiny target, the hybrid tree with SSSD candidates
from the run's training answers, batch 4, lock-step timing)."""

from __future__ import annotations

import json

import pytest

from helpers import compose_dict


@pytest.mark.slow
def test_evaluate_preset_training_reproduces_the_runs_eval(tmp_path):
    from drafttrain import train as T
    from scripts.evaluate import main

    run = tmp_path / "run"
    metrics = T.run(compose_dict("train", ["+recipe=parallelspec", "target=tiny", "trainer.max_steps=4",
                                           "trainer.progress=false", "trainer.num_threads=1", "logging.wandb=false",
                                           "trainer.mixed_precision=no", "trainer.spec_eval.sssd.source=data",
                                           f"output_dir={run}", f"data.cache_dir={tmp_path / 'data'}"]))  # fmt: skip
    assert metrics["eval/greedy_equal"] is True
    again = main(["preset=training", f"checkpoint={run}"])
    assert again["eval/tau"] == metrics["eval/tau"]
    assert again["eval/accept_hist"] == metrics["eval/accept_hist"]
    ours = [json.loads(x) for x in (run / "eval_outputs.jsonl").read_text().splitlines()]
    theirs = [json.loads(x) for x in (run / "eval_preset" / "eval_outputs.jsonl").read_text().splitlines()]
    assert ours == theirs and len(ours) > 0


def test_preset_needs_a_run_folder(tmp_path):
    from drafttrain.config import ConfigError
    from scripts.evaluate import main

    with pytest.raises(ConfigError, match="preset=training needs checkpoint"):
        main(["preset=training", f"checkpoint={tmp_path}"])
    with pytest.raises(ConfigError, match="preset must be"):
        main(["preset=trainig", f"checkpoint={tmp_path}"])
