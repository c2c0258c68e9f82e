"""The pre-flight check (drafttrain.preflight) and the one-line refusals a user meets before any work.

Why: a target class nobody listed used to crash after self-distillation had tried every conversation (22 of 22
failed with the same cache error), or in a Hydra traceback for a folder without weights. The check runs a few
tokens through the model's own forward and the engine first; a refusal is one line naming the class, the part that
failed and what still works; a systematic failure inside self-distillation stops after a few conversations.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.preflight import check_target
from drafttrain.target import Target, tiny
from drafttrain.target.families import UnsupportedTarget
from drafttrain.sweep import vary_weights
from helpers import compose_dict


def _target(name: str, tokenizer) -> Target:
    model = tiny.build(name, tokenizer)
    vary_weights(model)
    return Target(model, tokenizer)


def _save(name: str, tokenizer, folder):
    model = tiny.build(name, tokenizer)
    vary_weights(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_check_passes_and_says_what_it_ran(tiny_target):
    report = check_target(_target("Qwen3_5ForCausalLM", tiny_target.tokenizer),
                          drafter=("parallelspec_eagle3", {"num_mask_tokens": 3}))  # fmt: skip
    assert report.model_class == "Qwen3_5ForCausalLM"
    assert report.layer_kinds == ["recurrent", "recurrent", "recurrent", "attention"]
    assert any("greedy-equal" in c and "replay" in c for c in report.checks)
    assert any(c.startswith("drafter: parallelspec_eagle3") for c in report.checks)


def test_an_engine_that_decodes_differently_is_refused_in_one_line(tiny_target):
    """Mamba-1's own forward over a cache is not its full forward for more than one new token: the verification of a
    draft goes wrong, and the check refuses the class naming the engine and what still works."""
    with pytest.raises(UnsupportedTarget) as e:
        check_target(_target("MambaForCausalLM", tiny_target.tokenizer))
    msg = str(e.value)
    assert msg.startswith("MambaForCausalLM: the engine (prefill, 2 decoding steps, a verification") and "\n" not in msg
    assert msg.endswith("HF generation still works: data.generation.backend=hf and trainer.spec_eval.num_prompts=0 "
                        "train a drafter without the engine")  # fmt: skip


def test_a_drifting_engine_is_caught_by_the_logits_check(tiny_target, monkeypatch):
    """The mutation of the check itself: an engine whose hidden states come out 1% too large keeps every argmax (the
    tokens are still equal) but is refused by the logits comparison against the model's own forward."""
    from drafttrain.verify import engine as E

    target = _target("LlamaForCausalLM", tiny_target.tokenizer)
    check_target(target)
    real = E.SpecEngine._forward

    def drifting(self, *a, **k):
        feats, logits = real(self, *a, **k)
        return [f * 1.01 for f in feats], logits

    monkeypatch.setattr(E.SpecEngine, "_forward", drifting)
    with pytest.raises(UnsupportedTarget, match="logits differ from the model's own forward by 0.01"):
        check_target(target)


def test_train_refuses_an_unsupported_target_before_self_distillation(tiny_target, tmp_path, monkeypatch):
    """``train.run`` on a saved Mamba-1 folder: the one-line refusal comes before any conversation is generated."""
    from drafttrain import train as T
    from drafttrain.data import selfdistill

    folder = _save("MambaForCausalLM", tiny_target.tokenizer, tmp_path / "mamba")
    monkeypatch.setattr(selfdistill, "generate_dataset", lambda *a, **k: pytest.fail("self-distillation started"))
    with pytest.raises(UnsupportedTarget, match="^MambaForCausalLM: the engine"):
        T.run(compose_dict("train", ["+recipe=parallelspec", f"target.path={folder}", f"output_dir={tmp_path / 'run'}",
                                     f"data.cache_dir={tmp_path / 'data'}", "logging.wandb=false",
                                     "trainer.mixed_precision=no", "trainer.num_threads=1"]))  # fmt: skip


def test_a_folder_without_weights_is_refused_in_one_line_naming_it(tiny_target, tmp_path):
    """config.json and a tokenizer, no weights: loading it is a config error naming the folder and what it lacks
    (it used to end in a Hydra traceback, ``FileNotFoundError: ... has no weight file``), before the tokenizer or any
    weight loads; a shard its index lists and a missing tokenizer are named too."""
    import json

    from drafttrain.config import ConfigError, TargetConfig
    from drafttrain.target import load_target

    folder = _save("LlamaForCausalLM", tiny_target.tokenizer, tmp_path / "t")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=f"^target.path={folder}: the folder lacks a weight file \\(model.safetensors"):
        load_target(TargetConfig(path=str(folder)))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                                    "b": "model-00002-of-00002.safetensors"}}))  # fmt: skip
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"lacks 1 of the 2 weight shards model.safetensors.index.json lists \(model-00002"):
        load_target(TargetConfig(path=str(folder)))
    folder2 = _save("LlamaForCausalLM", tiny_target.tokenizer, tmp_path / "t2")
    for f in folder2.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConfigError, match="the folder lacks a tokenizer"):
        load_target(TargetConfig(path=str(folder2)))


def test_a_systematic_self_distillation_failure_stops_at_once(tiny_target, monkeypatch):
    """Every conversation fails with the same error: self-distillation stops after SYSTEMATIC_FAILURES of them, in one
    line, instead of trying all of them (the first failure's cause in it)."""
    from drafttrain.config import GenerationConfig
    from drafttrain.data import selfdistill
    from drafttrain.data.selfdistill import SystematicFailure

    calls = []

    def boom(target, batch, *a, **k):
        calls.append(len(batch))
        raise ValueError("Cannot get conv state for non linear attention layer 0")

    monkeypatch.setattr(selfdistill, "_generate_batch", boom)
    convs = [{"id": str(i), "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": "answer"}]} for i in range(20)]  # fmt: skip
    gen = GenerationConfig(backend="hf", batch_size=4)
    plans, skipped = selfdistill.plan_conversations(tiny_target.tokenizer, convs, gen)
    assert len(plans) == 20 and not skipped
    with pytest.raises(SystematicFailure, match="the first 3 conversations failed with the same error.*Cannot get conv"):
        selfdistill.generate_shard(tiny_target, plans, gen)
    assert calls == [4, 1, 1, 1]  # the first batch, then its rows one by one until 3 failed alike: not all 20


def test_a_model_whose_own_forward_fails_is_named_broken_not_a_drafttrain_limit(tiny_target, monkeypatch):
    """A model whose own forward raises (a broken config or folder) is refused as such: the one line says the model's
    own forward fails and does not claim that HF generation still works; a model whose own forward works but whose
    decoder refuses what drafttrain asks of it (hidden states) keeps the old refusal with 'HF generation ... is
    unaffected'. The mutation: dropping the own-forward probe turns the first case into the second's message."""
    from drafttrain.target.families import BrokenModel, backbone_of

    target = _target("LlamaForCausalLM", tiny_target.tokenizer)
    backbone = backbone_of(target.model)
    real = backbone.forward

    def broken(*a, **k):
        raise KeyError("4")

    monkeypatch.setattr(backbone, "forward", broken)
    with pytest.raises(BrokenModel) as e:
        check_target(target, engine=False)
    msg = str(e.value)
    assert msg.startswith("LlamaForCausalLM: the model's own forward fails on 4 tokens (KeyError: '4')") and "\n" not in msg
    assert "unaffected" not in msg and "neither drafttrain nor HF generation" in msg

    def no_hidden_states(*a, output_hidden_states=None, **k):
        if output_hidden_states:
            raise RuntimeError("no hidden states here")
        return real(*a, **k)

    target = _target("LlamaForCausalLM", tiny_target.tokenizer)
    monkeypatch.setattr(backbone_of(target.model), "forward", no_hidden_states)
    with pytest.raises(UnsupportedTarget) as e:
        check_target(target, engine=False)
    assert not isinstance(e.value, BrokenModel)
    assert "its decoder's forward fails on 4 tokens (RuntimeError: no hidden states here)" in str(e.value)
    assert str(e.value).endswith("(HF generation of the model itself is unaffected)")
