"""One evaluator: ``python -m scripts.evaluate preset=training`` runs a training run's own evaluation again on its
saved drafter and gives the run's eval/tau and outputs exactly (tiny target, the hybrid tree with SSSD candidates
from the run's training answers, batch 4, lock-step timing)."""

from __future__ import annotations

import json

import pytest

from helpers import compose_dict


@pytest.mark.slow
def test_evaluate_preset_training_reproduces_the_runs_eval(tmp_path, monkeypatch):
    """The run saves SSSD's datastore over its training answers (eval_datastore/); the preset reads it and never
    rebuilds the training data (prepare_data raises after the run)."""
    import shutil

    import drafttrain.data.pipeline
    from drafttrain import train as T
    from drafttrain.eval.in_training import EVAL_DATASTORE
    from scripts.evaluate import main

    run = tmp_path / "run"
    metrics = T.run(compose_dict("train", ["+recipe=parallelspec", "target=tiny", "trainer.max_steps=4",
                                           "trainer.progress=false", "trainer.num_threads=1", "logging.wandb=false",
                                           "trainer.mixed_precision=no", "trainer.spec_eval.sssd.source=data",
                                           f"output_dir={run}", f"data.cache_dir={tmp_path / 'data'}"]))  # fmt: skip
    assert metrics["eval/greedy_equal"] is True
    assert (run / EVAL_DATASTORE / "tokens.npy").is_file()

    def no_data(*a, **k):
        raise AssertionError("preset=training rebuilt the training data instead of reading the run's datastore")

    monkeypatch.setattr(drafttrain.data.pipeline, "prepare_data", no_data)
    again = main(["preset=training", f"checkpoint={run}"])
    assert again["eval/tau"] == metrics["eval/tau"]
    assert again["eval/accept_hist"] == metrics["eval/accept_hist"]
    ours = [json.loads(x) for x in (run / "eval_outputs.jsonl").read_text().splitlines()]
    theirs = [json.loads(x) for x in (run / "eval_preset" / "eval_outputs.jsonl").read_text().splitlines()]
    assert ours == theirs and len(ours) > 0
    saved = json.loads((run / "eval_preset" / "eval_metrics.json").read_text())  # the decisions behind the speedups
    assert saved["metrics"]["eval/tau"] == metrics["eval/tau"] and "planner_b16" in " ".join(saved["metrics"])
    assert saved["host"]["cpus"] >= 1
    elsewhere = tmp_path / "elsewhere"  # output_dir= on the command line is where the outputs go
    main(["preset=training", f"checkpoint={run}", f"output_dir={elsewhere}"])
    assert [json.loads(x) for x in (elsewhere / "eval_outputs.jsonl").read_text().splitlines()] == ours
    shutil.rmtree(run / EVAL_DATASTORE)  # a run older than eval_datastore/: its training data is rebuilt (patched here)
    with pytest.raises(AssertionError, match="rebuilt the training data"):
        main(["preset=training", f"checkpoint={run}"])


@pytest.mark.parametrize("content,match", [
    (None, r"prompts file '.*nope.jsonl' does not exist"),
    ("", r"holds no prompts"),
    ('{"prompt": "hi"}\nnot json\n', r"p.jsonl:2: malformed json"),
    ('{"question": "hi"}\n', r"prompt row 0 has none of 'prompt'"),
])  # fmt: skip
def test_a_bad_prompts_file_fails_in_one_line_before_the_target_loads(tmp_path, monkeypatch, content, match):
    import drafttrain.target
    from drafttrain.config import ConfigError
    from scripts.evaluate import main

    def no_target(*a, **k):
        raise AssertionError("the target loaded before the prompts were checked")

    monkeypatch.setattr(drafttrain.target, "load_target", no_target)
    path = tmp_path / ("nope.jsonl" if content is None else "p.jsonl")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        main(["target=tiny", "untrained_drafter=true", f"prompts={path}", f"output_dir={tmp_path / 'out'}"])


def test_preset_needs_a_run_folder(tmp_path):
    from drafttrain.config import ConfigError
    from scripts.evaluate import main

    with pytest.raises(ConfigError, match="preset=training needs checkpoint"):
        main(["preset=training", f"checkpoint={tmp_path}"])
    with pytest.raises(ConfigError, match="preset must be"):
        main(["preset=trainig", f"checkpoint={tmp_path}"])
