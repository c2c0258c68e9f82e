"""Caches and checks identify the target by content, not by name.

Why: the self-distillation cache was keyed by the target folder's basename (two different models in
``a/model`` and ``b/model`` shared a cache), ``scripts.generate_data`` and the feature cache by
``target.name``, and the harness compared names only: a feature cache or a checkpoint made with
another target of the same name was used silently.
"""

from __future__ import annotations

import json

import datasets
import pytest

from drafttrain import fingerprint as F
from drafttrain.config import ConfigError, EvalConfig, TargetConfig
from drafttrain.data.feature_cache import FeatureCacheError, attach_feature_cache, build_feature_cache


@pytest.fixture()
def two_folders(tmp_path, monkeypatch):
    """Two tiny HF model folders with the same basename (``model``) and different weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    out = []
    for seed in (0, 1):
        import torch

        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1)  # fmt: skip
        folder = tmp_path / f"run{seed}" / "model"
        LlamaForCausalLM(cfg).save_pretrained(folder)
        out.append(folder)
    return out


def test_same_basename_different_weights_differ(two_folders):
    a, b = two_folders
    fa, fb = F.target_fingerprint(TargetConfig(path=str(a))), F.target_fingerprint(TargetConfig(path=str(b)))
    assert fa != fb
    # the name plays no part: the same folder under another name is the same target
    assert F.target_fingerprint(TargetConfig(path=str(a), name="other")) == fa


def test_file_hash_is_remembered_and_invalidated_by_a_change(two_folders, monkeypatch):
    a, _ = two_folders
    weights = next(a.glob("*.safetensors"))
    first = F.file_sha256(weights)
    known = json.loads(F._hash_cache_path().read_text())
    assert list(known.values()) == [first]
    reads = []
    real_open = type(weights).open
    monkeypatch.setattr(type(weights), "open", lambda self, *a, **k: (reads.append(self) if self == weights.resolve() else None) or real_open(self, *a, **k))
    assert F.file_sha256(weights) == first and not reads  # remembered: the file is not read again
    with open(weights, "ab") as f:
        f.write(b"\0")
    assert F.file_sha256(weights) != first  # size/mtime changed: hashed again


def test_tiny_targets_differ_by_seed_not_name():
    assert F.target_fingerprint(TargetConfig(random_init=True, seed=0)) != F.target_fingerprint(TargetConfig(random_init=True, seed=1))
    assert F.target_fingerprint(TargetConfig(random_init=True, name="x")) == F.target_fingerprint(TargetConfig(random_init=True))


def test_feature_cache_of_another_target_fails_naming_both(tiny_target, tmp_path):
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10, 11]]})
    made_with = TargetConfig(random_init=True, seed=0)  # tiny_target
    build_feature_cache(tiny_target, ds, tmp_path / "fc", shard_size=2, progress=False,
                        target_fingerprint=F.target_fingerprint(made_with))  # fmt: skip
    assert len(attach_feature_cache(ds, tmp_path / "fc", target_cfg=made_with)) == 2
    other = TargetConfig(random_init=True, seed=1)  # the same target.name
    with pytest.raises(FeatureCacheError) as err:
        attach_feature_cache(ds, tmp_path / "fc", target_cfg=other)
    assert F.target_fingerprint(made_with) in str(err.value) and F.target_fingerprint(other) in str(err.value)


def test_harness_refuses_a_checkpoint_of_another_target_with_the_same_name(checkpoint, tmp_path):
    from drafttrain.eval.harness import check_checkpoint

    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    for f in (checkpoint / "drafter").iterdir():
        (run / "drafter" / f.name).write_bytes(f.read_bytes())
    trained_for = TargetConfig(random_init=True, seed=0)
    (run / "config.json").write_text(json.dumps({"target": {"name": trained_for.name}}))
    (run / "target.json").write_text(json.dumps({"name": trained_for.name, "fingerprint": F.target_fingerprint(trained_for)}))
    assert check_checkpoint(EvalConfig(target=trained_for, checkpoint=str(run))) == run / "drafter"
    other = TargetConfig(random_init=True, seed=1)  # same name, other weights
    with pytest.raises(ConfigError) as err:
        check_checkpoint(EvalConfig(target=other, checkpoint=str(run)))
    assert F.target_fingerprint(trained_for) in str(err.value) and F.target_fingerprint(other) in str(err.value)
