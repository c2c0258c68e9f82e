"""One evaluation schema: ``trainer.spec_eval`` is a preset of ``scripts.evaluate``'s (the same prompt keys,
the same ``tree`` and ``sssd`` dataclasses and defaults), the training run's values set in its own config.

The values recorded here are what the main job's ``trainer.spec_eval`` (``+recipe=parallelspec``) and
``scripts.evaluate``'s defaults resolved to before the two schema families were made one: the restructuring
changes no value either evaluation reads.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import compose_dict

#: The main job's trainer.spec_eval as it resolved before (keys the in-training evaluation reads).
MAIN_JOB = {"every": 0, "prompts": "mt_bench", "num_prompts": 16, "prompt_offset": 0, "prompt_stride": 5,
            "max_new_tokens": 128, "batch_size": 16, "tree": {"widths": [4, 2, 1, 1, 1], "budget": 8}, "chain": False,
            "plan": True, "latency_prompts": 8, "compile_target": False, "sssd": {"source": "data", "nodes": 8}}  # fmt: skip
#: target=tiny's smoke sizes on top of it.
TINY = {**MAIN_JOB, "num_prompts": 4, "max_new_tokens": 16, "latency_prompts": 2}
#: The SSSD drafting parameters the hybrid trees used (SSSDConfig() then).
SSSD_DRAFTING = {"max_prefix_len": 6, "min_prefix_len": 1, "max_depth": 8, "node_budget": 32, "max_samples": 100,
                 "min_continuations": 20, "input_scale": 1.0, "input_depth_damp": 0.7, "input_match_damp": 0.7,
                 "datastore_scale": 1.0, "datastore_depth_damp": 0.7, "datastore_match_damp": 1.0, "combine": "max",
                 "min_score": 0.0, "use_input": True, "use_datastore": True}  # fmt: skip
#: scripts.evaluate's defaults before.
HARNESS = {"prompts": "mt_bench", "num_prompts": 16, "prompt_offset": 0, "prompt_stride": 1, "max_new_tokens": 128,
           "tree": {"widths": None, "budget": None, "choices": None, "batched_drafting": True, "plan": True},
           "sssd": {"datastore": "data/datastore/sharegpt", "node_budgets": None,
                    "tau_table": "docs/benchmarks/sssd_grid.json", "planner_context": 256, "max_prefix_len": 6,
                    "max_depth": 8, "num_threads": 1}}  # fmt: skip


def read_by_training(se) -> dict:
    """What drafttrain.eval.in_training.spec_eval reads of a validated trainer.spec_eval."""
    return {"every": se.every, "prompts": se.prompts, "num_prompts": se.num_prompts, "prompt_offset": se.prompt_offset,
            "prompt_stride": se.prompt_stride, "max_new_tokens": se.max_new_tokens, "batch_size": se.batch_size,
            "tree": {"widths": se.tree.widths, "budget": se.tree.budget}, "chain": se.chain, "plan": se.tree.plan,
            "latency_prompts": se.latency_prompts, "compile_target": se.compile_target,
            "sssd": {"source": se.sssd.source, "nodes": se.sssd.nodes}}  # fmt: skip


@pytest.mark.parametrize("overrides, want", [([], MAIN_JOB), (["target=tiny"], TINY)])
def test_the_main_jobs_training_evaluation_is_unchanged(overrides, want):
    from drafttrain.eval.in_training import sssd_for_eval
    from drafttrain.validation import validate

    c = validate(compose_dict("train", ["+recipe=parallelspec", *overrides]))
    assert read_by_training(c.trainer.spec_eval) == want
    c = dataclasses.replace(c, trainer=dataclasses.replace(
        c.trainer, spec_eval=dataclasses.replace(c.trainer.spec_eval, sssd=dataclasses.replace(c.trainer.spec_eval.sssd, source="input"))))
    sssd = sssd_for_eval(c)  # the SSSD drafter of the hybrid trees (input trie: no data needed)
    assert dataclasses.asdict(sssd.config) == SSSD_DRAFTING and sssd.num_threads == 1


def test_the_harness_defaults_are_unchanged():
    from drafttrain.config import to_dict
    from drafttrain.validation import validate_eval

    d = to_dict(validate_eval(compose_dict("evaluate", ["untrained_drafter=true"])))
    got = {k: d[k] for k in HARNESS}
    got["sssd"] = {k: v for k, v in got["sssd"].items() if k in HARNESS["sssd"]}
    assert got == HARNESS


def test_one_tree_and_one_sssd_schema_with_one_set_of_defaults():
    """The same dataclasses under trainer.spec_eval and scripts.evaluate; their class defaults are the harness's,
    the training run's values live in TrainerConfig's preset (and its yaml, held equal in tests/test_config.py)."""
    from drafttrain import config as C
    from drafttrain.validation import eval_schema, validate, validate_eval

    train = validate(compose_dict("train", ["+recipe=parallelspec"])).trainer.spec_eval
    harness = validate_eval(compose_dict("evaluate", ["untrained_drafter=true"]))
    assert type(train.tree) is type(harness.tree) is C.TreeConfig
    assert type(train.sssd) is type(harness.sssd) is C.SSSDEvalConfig
    assert isinstance(train, C.EvalPromptsConfig) and isinstance(harness, C.EvalPromptsConfig)
    assert {f.name: f.default for f in dataclasses.fields(C.EvalPromptsConfig)} == {
        k: v for k, v in {f.name: f.default for f in dataclasses.fields(eval_schema())}.items()
        if k in {f.name for f in dataclasses.fields(C.EvalPromptsConfig)}}  # fmt: skip
    # the class defaults are one set (the harness's); the preset differs from them by the training run's values only
    preset, plain = dataclasses.asdict(C.training_spec_eval()), dataclasses.asdict(C.SpecEvalConfig())
    assert {k for k in preset if preset[k] != plain[k]} == {"prompt_stride", "tree"}
    assert C.SpecEvalConfig().tree == C.TreeConfig() == harness.tree
    assert C.TrainerConfig().spec_eval == C.training_spec_eval()


def test_the_verifier_reads_no_training_evaluation_schema():
    """verify/proposers.py and verify/hybrid.py take plain arguments: their default node count is the verifier's own."""
    import ast
    import inspect

    from drafttrain.config import SSSDEvalConfig
    from drafttrain.verify import hybrid, proposers

    for mod in (hybrid, proposers):
        tree = ast.parse(inspect.getsource(mod))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "drafttrain.config" not in imported, mod.__name__
    assert inspect.signature(proposers.proposer_for).parameters["sssd_nodes"].default == hybrid.DEFAULT_EXTRA_NODES
    assert SSSDEvalConfig.nodes == hybrid.DEFAULT_EXTRA_NODES  # the evaluations' default is the verifier's


def test_trainer_spec_eval_plan_moved_to_its_tree():
    from drafttrain.cliconfig import ConfigError
    from drafttrain.config import upgrade_saved
    from drafttrain.train import compose_config
    from drafttrain.validation import validate

    with pytest.raises(ConfigError, match=r"'trainer.spec_eval.plan' moved to 'trainer.spec_eval.tree.plan'"):
        compose_config(["+recipe=parallelspec", "trainer.spec_eval.plan=false"])
    d = compose_dict("train", ["+recipe=parallelspec", "trainer.spec_eval.tree.plan=false"])
    assert validate(d).trainer.spec_eval.tree.plan is False
    old = json.loads(json.dumps(d))  # a run saved before: plan beside the tree, the tree without the new keys
    old["trainer"]["spec_eval"]["plan"] = False
    old["trainer"]["spec_eval"]["tree"] = {"widths": [4, 2, 1, 1, 1], "budget": 8}
    old["trainer"]["spec_eval"]["sssd"] = {"source": "data", "nodes": 8}
    with pytest.raises(ConfigError, match="moved to 'trainer.spec_eval.tree.plan'"):
        validate(old)
    se = validate(upgrade_saved(old)).trainer.spec_eval
    assert se.tree.plan is False and read_by_training(se) == {**MAIN_JOB, "plan": False}


@pytest.mark.parametrize("override, message", [
    ("trainer.spec_eval.sssd.tau_table=x.json", "trainer.spec_eval.sssd.tau_table is read by scripts.evaluate only"),
    ("trainer.spec_eval.sssd.node_budgets=[4]", "trainer.spec_eval.sssd.node_budgets is read by scripts.evaluate"),
    ("trainer.spec_eval.num_prompts=null", "trainer.spec_eval.num_prompts must be an int"),
    ("trainer.spec_eval.sssd.max_depth=0", "trainer.spec_eval.sssd.max_depth must be >= 1"),
])  # fmt: skip
def test_a_key_the_training_evaluation_does_not_read_fails(override, message):
    from drafttrain.cliconfig import ConfigError
    from drafttrain.validation import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose_dict("train", ["+recipe=parallelspec", override]))


@pytest.mark.parametrize("override", ["trainer.spec_eval.tree.choices=eagle_default",
                                      "trainer.spec_eval.tree.batched_drafting=false"])
def test_every_tree_key_is_read_by_the_training_evaluation_too(override):
    """One driver: the training run's evaluation builds its tree from every tree key scripts.evaluate reads."""
    from drafttrain.validation import validate

    se = validate(compose_dict("train", ["+recipe=parallelspec", override])).trainer.spec_eval
    assert (se.tree.choices, se.tree.batched_drafting) != (None, True)


@pytest.mark.parametrize("override", ["sssd.nodes=4", "sssd.source=input"])
def test_a_hybrid_key_fails_in_the_harness(override, tmp_path):
    from drafttrain.cliconfig import ConfigError
    from drafttrain.validation import validate_eval

    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]} is read by the in-training evaluation"):
        validate_eval(compose_dict("evaluate", ["target=tiny", "methods=[sssd]", override, f"sssd.datastore={tmp_path}"]))
