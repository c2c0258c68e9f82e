"""Export to serving-engine folders (drafttrain.export, scripts.export): the exported folder read back by
our own loader gives the same draft logits, every tensor written is one the engine's loader consumes
(engines skip unknown names silently), configs validate against the speculators package where it is
installed, and vLLM itself (a second venv, scripts/install_vllm.sh) runs an exported drafter losslessly.

The weights read back equal the drafter's bit for bit; the logits computed from them are compared within
helpers.LOGITS_ATOL with equal argmax (two passes over the same weights may round differently by host kernel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafttrain.drafters import build_drafter
from drafttrain.export import ExportError, export_drafter, formats_for, load_exported, resolve_format
from drafttrain.export.common import draft_token_ids, load_tensors
from helpers import LOGITS_ATOL, assert_same_logits, assert_same_weights


def _randomise(drafter, seed: int = 0):
    """Redraw every float parameter (trained-looking weights: biases non-zero, heads not the target's rows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 and p.numel() > 1 else 0.0))
    return drafter


def _vocab(drafter, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(drafter.vocab_size, generator=g)[:n]
    drafter.set_draft_vocab(ids)
    return ids


# -- format selection -------------------------------------------------------------------------
def test_formats_per_recipe():
    assert formats_for("medusa") == ["vllm_medusa"]
    assert formats_for("eagle") == ["vllm_eagle"]
    assert formats_for("eagle3")[0] == "speculators" and "sglang" in formats_for("eagle3")
    assert resolve_format("medusa", None) == "vllm_medusa"


@pytest.mark.parametrize("recipe", ["parallelspec", "parallelspec_eagle"])
def test_recipe_without_engine_format_fails_listing_formats(recipe):
    with pytest.raises(ExportError) as e:
        resolve_format(recipe, None)
    for fmt in ("speculators", "sglang", "vllm_medusa", "vllm_eagle"):
        assert fmt in str(e.value)


def test_wrong_format_for_recipe_fails():
    with pytest.raises(ExportError, match="does not write 'medusa'"):
        resolve_format("medusa", "speculators")
    with pytest.raises(ExportError, match="unknown export format"):
        resolve_format("medusa", "trtllm")


# -- Medusa -> vLLM ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_vocab", [0, 300])
def test_medusa_roundtrip_identical_logits(tiny_target, tmp_path, n_vocab):
    """Export then read back: weights equal bit for bit, head logits within LOGITS_ATOL with the same argmax."""
    from drafttrain.export.medusa import vllm_consumed_names

    torch.manual_seed(0)
    drafter = build_drafter("medusa", {"num_heads": 3, "draft_vocab_size": n_vocab}, tiny_target)
    if n_vocab:
        ids = _vocab(drafter, n_vocab)
    _randomise(drafter)
    fmt, cfg = export_drafter(drafter, None, tmp_path)
    assert fmt == "vllm_medusa" and cfg["medusa_fc_bias"] is True  # vLLM drops c_k without it
    written = set(load_tensors(tmp_path / "model.safetensors"))
    assert written == vllm_consumed_names(3, 1, True, truncated=bool(n_vocab))
    if n_vocab:  # vLLM's token_map = absolute target ids of the head rows
        assert cfg["truncated_vocab_size"] == n_vocab < cfg["vocab_size"]
        assert torch.equal(load_tensors(tmp_path / "model.safetensors")["token_map"], ids)
    back = load_exported(tmp_path, fmt, tiny_target)
    assert_same_weights(back, drafter)
    f = torch.randn(5, tiny_target.config.hidden_size)
    assert_same_logits(back.head_logits(f), drafter.head_logits(f))
    assert_same_logits(back.full_vocab_logits(back.head_logits(f)), drafter.full_vocab_logits(drafter.head_logits(f)))
    assert torch.equal(draft_token_ids(back), draft_token_ids(drafter))


# -- EAGLE(-1) -> vLLM ------------------------------------------------------------------------
def test_eagle_export_refuses_naming_each_difference(tiny_target, tmp_path):
    torch.manual_seed(0)
    drafter = _randomise(build_drafter("eagle", {}, tiny_target))
    with pytest.raises(ExportError) as e:
        export_drafter(drafter, "vllm_eagle", tmp_path)
    msg = str(e.value)
    assert "bias" in msg and "input RMSNorm" in msg and "final norm" in msg
    assert not (tmp_path / "model.safetensors").exists()


# -- EAGLE-3 -> speculators (vLLM) and SGLang ---------------------------------------------------
def _has(recipe: str) -> bool:
    from drafttrain.drafters import DRAFTERS

    return recipe in DRAFTERS


def _eagle3(target, recipe="eagle3", n_vocab=300, **cfg):
    if not _has(recipe):
        pytest.skip(f"no {recipe} drafter in this drafttrain")
    torch.manual_seed(0)
    drafter = build_drafter(recipe, {"draft_vocab_size": n_vocab, **cfg}, target)
    if n_vocab:
        _vocab(drafter, n_vocab)
    return _randomise(drafter)


@pytest.fixture(scope="module")
def deep_target():
    """A tiny random target with 8 layers and head_dim 32: EAGLE-3's default ids (2, 4, 5) are distinct
    there, and vLLM's CPU attention takes head_dim 32 (not the usual tiny target's 16)."""
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target
    from helpers import need_input

    t = need_input(lambda: load_target(TargetConfig(random_init=True, num_hidden_layers=8, num_attention_heads=2,
                                                    num_key_value_heads=1)))  # missing package: fail, never skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # varied weights: greedy continuations change at every step
        for p in t.model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    return t


def _chain(drafter, target, steps=3, seed=0, autoregressive=False):
    """Greedy chain logits of ``drafter`` from 4 random items (its full inference path, cache included);
    ``autoregressive``: EAGLE-3's own chain even for a parallel drafter (what SGLang runs)."""
    from transformers import DynamicCache

    from drafttrain.drafters.eagle3 import Eagle3Drafter

    g = torch.Generator().manual_seed(seed)
    d = target.config.hidden_size
    ids = torch.randint(0, drafter.vocab_size, (1, 4), generator=g)
    feats = torch.randn(1, 4, 4 * d, generator=g)
    propose = (lambda *a: Eagle3Drafter.propose(drafter, *a)) if autoregressive else drafter.propose
    return propose(ids, feats, DynamicCache())[:, :steps]


@pytest.mark.parametrize("recipe", ["eagle3", "parallelspec_eagle3"])
@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_eagle3_roundtrip_identical_logits(deep_target, tmp_path, recipe, fmt):
    """Export then read back: every weight equal bit for bit, the greedy chain's logits equal within LOGITS_ATOL
    with the same argmax, and one weight moved by 0.01 (of ~0.2) already fails that comparison."""
    drafter = _eagle3(deep_target, recipe)
    _, cfg = export_drafter(drafter, fmt, tmp_path, verifier="/models/target", num_speculative_tokens=3,
                            target_config=deep_target.config)  # fmt: skip
    back = load_exported(tmp_path, fmt, deep_target)
    assert_same_weights(back, drafter)  # bitwise; an SGLang read-back of a parallel drafter lacks mask_hidden
    # SGLang drafts autoregressively: a parallel drafter exported there runs (and reads back) as EAGLE-3
    want = _chain(drafter, deep_target, autoregressive=fmt == "sglang")
    assert_same_logits(_chain(back, deep_target), want)
    with torch.no_grad():  # the tolerance is far below what one wrong weight does to the logits
        back.fc.weight[0, 0] += 1e-2
    with pytest.raises(AssertionError):
        assert_same_logits(_chain(back, deep_target), want)
    with torch.no_grad():
        back.fc.weight[0, 0] -= 1e-2
    assert torch.equal(back.draft_token_ids, drafter.draft_token_ids) and torch.equal(back.t2d, drafter.t2d)
    assert back.name == (recipe if fmt == "speculators" else "eagle3")
    if fmt == "speculators" and recipe == "parallelspec_eagle3":  # the mask slot state vLLM reads
        assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == drafter.mask_token_id
        assert torch.equal(back.mask_hidden, drafter.mask_hidden)
        # every mask slot shares one input; K is the served chain length - 1 (num_speculative_tokens=3 -> K = 2)
        assert back.num_mask_tokens == 2
        torch.testing.assert_close(back.draft_inputs()[0], drafter.draft_inputs()[0], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
@pytest.mark.parametrize("restricted", [True, False])
def test_eagle3_tensor_names_are_the_engines(deep_target, tmp_path, fmt, restricted):
    """Every tensor written is one the engine's loader maps onto a parameter, and none it needs is missing
    (names recorded from vLLM 0.32's llama_eagle3.py / SGLang's llama_eagle3.py)."""
    from drafttrain.export.sglang import sglang_consumed_names
    from drafttrain.export.speculators import vllm_consumed_names

    drafter = _eagle3(deep_target, n_vocab=300 if restricted else 0)
    export_drafter(drafter, fmt, tmp_path, target_config=deep_target.config)
    w = load_tensors(tmp_path / "model.safetensors")
    expected = vllm_consumed_names(restricted, False) if fmt == "speculators" else sglang_consumed_names(restricted)
    assert set(w) == expected
    if restricted:  # the engines' offset convention: target id = i + d2t[i]
        assert torch.equal(w["d2t"] + torch.arange(w["d2t"].numel()), drafter.draft_token_ids)
        assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 300
    assert w["fc.weight"].shape == (64, 3 * 64)
    assert w[("layers.0" if fmt == "speculators" else "midlayer") + ".self_attn.q_proj.weight"].shape[1] == 2 * 64


def test_eagle3_layer_ids_each_engine_reads_its_own(deep_target, tmp_path):
    """Probe of the two conventions: the HF hidden-state indices each engine feeds the fc, computed with the
    engine's own reading rules, are the drafter's ids; vLLM reading the SGLang folder too (top-level ids)."""
    from drafttrain.export.eagle3_common import sglang_captured_ids, vllm_captured_ids

    drafter = _eagle3(deep_target, aux_layer_ids=[1, 3, 6])
    L = deep_target.config.num_hidden_layers
    export_drafter(drafter, "speculators", tmp_path / "v", target_config=deep_target.config)
    export_drafter(drafter, "sglang", tmp_path / "s", target_config=deep_target.config)
    vcfg = json.loads((tmp_path / "v" / "config.json").read_text())
    scfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert vcfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6] == vllm_captured_ids(vcfg, L)
    assert scfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang adds 1
    assert sglang_captured_ids(scfg, L) == [1, 3, 6] == vllm_captured_ids(scfg, L)
    # without the top-level ids vLLM would read SGLang's nested ones one layer off: why both are written
    assert vllm_captured_ids({"eagle_config": scfg["eagle_config"]}, L) == [0, 2, 5]


def test_eagle3_features_are_the_layers_the_ids_name(deep_target):
    """id i = HF output_hidden_states[i] = the state entering decoder layer i, which is what vLLM's
    _maybe_add_hidden_state captures (hidden + residual before layer i; the embeddings for i = 0)."""
    ids = torch.tensor([[5, 9, 13, 17, 21]])
    with torch.no_grad():
        hs = deep_target.model(ids, output_hidden_states=True).hidden_states
        x = deep_target.model.model.embed_tokens(ids)
        pos = torch.arange(5)[None]
        pe = deep_target.model.model.rotary_emb(x, pos)
        entering = []
        for layer in deep_target.model.model.layers:
            entering.append(x)
            x = layer(x, position_embeddings=pe, position_ids=pos, attention_mask=None)
            x = x[0] if isinstance(x, tuple) else x
    for i in range(deep_target.config.num_hidden_layers):
        assert torch.allclose(hs[i], entering[i], atol=1e-5)


@pytest.mark.parametrize("ids", [[4, 2, 6], [2, 2, 5], [1, 3, 8]])
def test_eagle3_export_refuses_ids_vllm_would_reorder(deep_target, tmp_path, ids):
    drafter = _eagle3(deep_target)
    drafter.aux_layer_ids = tuple(ids)
    with pytest.raises(ExportError, match="strictly increasing"):
        export_drafter(drafter, "speculators", tmp_path)


def _speculators_validate(folder: Path) -> dict:
    """Validate ``folder/config.json`` with the speculators package's config classes (here if importable,
    else in the vLLM venv); returns the fields read back. Skips where neither has speculators."""
    code = ("import json, sys\nfrom speculators import SpeculatorModelConfig\n"
            "c = SpeculatorModelConfig.from_pretrained(sys.argv[1])\n"
            "print(json.dumps({'cls': type(c).__name__, 'draft_vocab_size': c.draft_vocab_size,"
            " 'norm_before_residual': c.norm_before_residual, 'ids': c.eagle_aux_hidden_state_layer_ids,"
            " 'verifier': c.speculators_config.verifier.name_or_path,"
            " 'tokens': c.speculators_config.proposal_methods[0].speculative_tokens,"
            " 'layer_cls': type(c.transformer_layer_config).__name__,"
            " 'mask_token_id': getattr(c, 'mask_token_id', None)}))\n")  # fmt: skip
    import importlib.util
    import subprocess
    import sys

    from drafttrain.generation.vllm_client import vllm_install_state, vllm_python

    if importlib.util.find_spec("speculators") is not None:
        py = sys.executable
    else:
        state, why = vllm_install_state()
        if state != "ready":
            pytest.skip(f"speculators is not installed here, and in vLLM's venv: {why}")
        py = vllm_python()
    out = subprocess.run([str(py), "-c", code, str(folder)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe", ["eagle3", "parallelspec_eagle3"])
def test_speculators_config_validates(deep_target, tmp_path, recipe):
    drafter = _eagle3(deep_target, recipe)
    export_drafter(drafter, "speculators", tmp_path, verifier="/models/target", num_speculative_tokens=3,
                   target_config=deep_target.config)  # fmt: skip
    got = _speculators_validate(tmp_path)
    assert got["cls"] == ("PEagleSpeculatorConfig" if recipe == "parallelspec_eagle3" else "Eagle3SpeculatorConfig")
    assert got["draft_vocab_size"] == 300 and got["norm_before_residual"] is False
    assert got["ids"] == list(drafter.aux_layer_ids) and got["verifier"] == "/models/target" and got["tokens"] == 3
    assert got["layer_cls"] == "LlamaConfig"
    if recipe == "parallelspec_eagle3":
        assert got["mask_token_id"] == drafter.mask_token_id


# -- the CLI ------------------------------------------------------------------------------------
def test_export_cli_writes_folder_and_commands(tiny_target, tiny_target_dir, tmp_path):
    from scripts.export import main

    torch.manual_seed(0)
    drafter = _randomise(build_drafter("medusa", {"num_heads": 2, "draft_vocab_size": 200}, tiny_target))
    drafter.save_pretrained(tmp_path / "run" / "drafter")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"target": {"name": "tiny", "random_init": True}}))
    out = tmp_path / "exported"
    main([f"checkpoint={tmp_path / 'run'}", f"target_path={tiny_target_dir}", f"output_dir={out}"])
    info = json.loads((out / "export_info.json").read_text())
    assert info["format"] == "vllm_medusa" and info["num_speculative_tokens"] == 2
    assert any('"method": "medusa"' in cmd for cmd in info["commands"])
    back = load_exported(out, "vllm_medusa", tiny_target)
    assert_same_weights(back, drafter)
    f = torch.randn(3, tiny_target.config.hidden_size)
    assert_same_logits(back.head_logits(f), drafter.head_logits(f))


def test_export_cli_errors_before_loading(tmp_path, tiny_target):
    from drafttrain.config import ConfigError
    from scripts.export import main

    with pytest.raises(ConfigError, match="checkpoint"):
        main([])
    with pytest.raises(ConfigError):
        main(["checkpont=x"])  # typo'd key
    drafter = build_drafter("parallelspec", {"num_mask_tokens": 2}, tiny_target)
    drafter.save_pretrained(tmp_path / "ps")
    with pytest.raises(ExportError, match="no serving-engine format exists for 'parallelspec'"):
        main([f"checkpoint={tmp_path / 'ps'}"])
    drafter = build_drafter("medusa", {"num_heads": 2}, tiny_target)
    drafter.save_pretrained(tmp_path / "md" / "drafter")
    (tmp_path / "md" / "config.json").write_text(json.dumps({"target": {"name": "tiny", "random_init": True}}))
    with pytest.raises(ConfigError, match="target_path"):  # a random target is on no disk: say so
        main([f"checkpoint={tmp_path / 'md'}"])


@pytest.mark.parametrize("recipe", ["parallelspec_eagle3", "medusa", "parallelspec"])
def test_training_run_ends_with_the_serve_line(deep_target, tmp_path, capsys, recipe):
    """train.run's last step: the run's drafter exported to output_dir/export, and the `vllm serve` line printed."""
    from types import SimpleNamespace

    from drafttrain.train import export_for_serving

    target_dir = tmp_path / "target"
    deep_target.model.save_pretrained(target_dir)
    deep_target.tokenizer.save_pretrained(target_dir)
    cfg = {"num_mask_tokens": 2, "draft_vocab_size": 300} if recipe != "medusa" else {"num_heads": 2}
    drafter = build_drafter(recipe, cfg, deep_target)
    run = tmp_path / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "deep", "path": str(target_dir)}}))
    c = SimpleNamespace(drafter=SimpleNamespace(name=recipe), target=SimpleNamespace(random_init=False))
    out = export_for_serving(c, run)
    printed = capsys.readouterr().out
    if recipe == "parallelspec":  # the Medusa integration: no engine runs it, and the run says so
        assert out is None and "no serving-engine format exists for 'parallelspec'" in printed
        return
    assert out == run / "export"
    info = json.loads((out / "export_info.json").read_text())
    assert "-m vllm.entrypoints.openai.api_server" in printed and info["commands"][-1] in printed  # the CPU line
    method = {"parallelspec_eagle3": "eagle3", "medusa": "medusa"}[recipe]
    assert f'"method": "{method}"' in info["commands"][-1]
    assert ('"parallel_drafting": true' in info["commands"][-1]) == (recipe == "parallelspec_eagle3")
    back = load_exported(out, info["format"], deep_target)
    assert sum(p.numel() for p in back.parameters()) > 0
    c.target.random_init = True  # a random tiny target is on no disk: nothing exported, the reason printed
    assert export_for_serving(c, run) is None and "random tiny target" in capsys.readouterr().out


# -- vLLM itself (optional: scripts/install_vllm.sh) ----------------------------------------------
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3600)  # engine start-ups: ~1 min each on 2 idle cores, far more on a loaded machine
def test_vllm_runs_exported_drafters_losslessly(deep_target, tmp_path):
    """vLLM's CPU build loads the exported EAGLE-3 (speculators; and the SGLang folder) and Medusa folders
    of a tiny target, and its speculative greedy output equals its plain greedy output. Several minutes on 2 cores (engine
    start-ups); skipped without a finished .venv-vllm, so CI (a fresh clone) skips it."""
    from drafttrain.generation.vllm_client import vllm_install_state, vllm_python
    from scripts.serve_check import run_vllm

    state, why = vllm_install_state()
    if state != "ready":  # absent, or a venv whose install has not finished (no stamp): never used
        pytest.skip(why)
    py = vllm_python()
    target_dir = tmp_path / "target"
    deep_target.model.save_pretrained(target_dir)
    deep_target.tokenizer.save_pretrained(target_dir)
    runs = [{"speculative_config": None}]
    if _has("eagle3"):
        export_drafter(_eagle3(deep_target), "speculators", tmp_path / "eagle3", verifier=str(target_dir),
                       num_speculative_tokens=3, target_config=deep_target.config)  # fmt: skip
        runs.append({"speculative_config": {"model": str(tmp_path / "eagle3"), "method": "eagle3",
                                            "num_speculative_tokens": 3}})  # fmt: skip
        # the SGLang folder loads in vLLM too (midlayer.* mapped, top-level ids read first)
        export_drafter(_eagle3(deep_target), "sglang", tmp_path / "sglang", target_config=deep_target.config)
        runs.append({"speculative_config": {"model": str(tmp_path / "sglang"), "method": "eagle3",
                                            "num_speculative_tokens": 3}})  # fmt: skip
    torch.manual_seed(0)  # full vocabulary: vLLM 0.32 cannot load truncated Medusa heads (export/medusa.py)
    medusa = build_drafter("medusa", {"num_heads": 3, "draft_vocab_size": 0}, deep_target)
    export_drafter(medusa, "vllm_medusa", tmp_path / "medusa")
    runs.append({"speculative_config": {"model": str(tmp_path / "medusa"), "method": "medusa", "num_speculative_tokens": 3}})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 5)]
    job = {"model": str(target_dir), "prompts": prompts, "max_new_tokens": 16, "stop_token_ids": [],
           "max_model_len": 256, "eager": True, "runs": runs}  # fmt: skip
    results = run_vllm(py, job, threads="0-1", memory_gb=1, timeout_s=1800, log_path=tmp_path / "vllm.log")
    plain = results[0]
    assert "error" not in plain, plain.get("error")
    assert len(set(map(tuple, plain["outputs"]))) == 2 and all(len(o) == 16 for o in plain["outputs"])
    for run, res in zip(runs[1:], results[1:]):
        method = run["speculative_config"]["model"]
        assert "error" not in res, f"{method}: {res.get('error')}"
        assert res["outputs"] == plain["outputs"], method
        assert res["acceptance"]["num_drafts"] > 0 and len(res["acceptance"]["per_position"]) == 3, method


# -- EAGLE-3.1 (fc_norm, norm_output): the drafter's own flags are its serving format -----------------
@pytest.mark.parametrize("recipe", ["eagle3", "parallelspec_eagle3"])
def test_eagle31_roundtrip_writes_its_flags_and_norms(deep_target, tmp_path, recipe):
    """The speculators folder of an EAGLE-3.1 drafter carries fc_norm / norm_output as the drafter says, one
    fc_norm.{i}.weight per target layer (what vLLM 0.32 consumes), and reads back into the same network."""
    from drafttrain.export.speculators import vllm_consumed_names

    drafter = _eagle3(deep_target, recipe, fc_norm=True, norm_output=True)
    _, cfg = export_drafter(drafter, "speculators", tmp_path, verifier="/models/target", num_speculative_tokens=3,
                            target_config=deep_target.config)  # fmt: skip
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["norm_before_residual"] is False
    w = load_tensors(tmp_path / "model.safetensors")
    assert set(w) == vllm_consumed_names(True, recipe == "parallelspec_eagle3", fc_norm=3)
    back = load_exported(tmp_path, "speculators", deep_target)
    assert back.serving_flags() == drafter.serving_flags()
    assert_same_weights(back, drafter)
    assert_same_logits(_chain(back, deep_target), _chain(drafter, deep_target))


def test_eagle31_plain_eagle3_readback_would_differ(deep_target, tmp_path):
    """Mutation: the same weights read as plain EAGLE-3 (flags dropped) give other chain logits, so the
    round-trip comparison above can fail."""
    drafter = _eagle3(deep_target, fc_norm=False, norm_output=True)
    plain = _eagle3(deep_target, fc_norm=False, norm_output=False)
    plain.load_state_dict(drafter.state_dict())
    with pytest.raises(AssertionError):
        assert_same_logits(_chain(plain, deep_target), _chain(drafter, deep_target))


def test_eagle31_sglang_refuses_by_name(deep_target, tmp_path):
    drafter = _eagle3(deep_target, fc_norm=True)
    with pytest.raises(ExportError, match="computes no fc_norm"):
        export_drafter(drafter, "sglang", tmp_path, target_config=deep_target.config)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_vllm_serves_eagle31_as_we_compute_it(tmp_path):
    """vLLM 0.32 CPU loads an EAGLE-3.1 export (fc_norm + norm_output), its speculative greedy output equals its
    plain output, and its per-position acceptance equals our engine's chain over the same prompts (greedy: the
    same drafts are accepted when both compute the same network; one request at a time). Skipped without a
    finished .venv-vllm."""
    from drafttrain.generation.vllm_client import vllm_install_state, vllm_python
    from drafttrain.verify import PlainProposer, SpecEngine, proposer_for
    from scripts.serve_check import ours_per_position, run_vllm

    state, why = vllm_install_state()
    if state != "ready":
        pytest.skip(why)
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target

    # the deep target as initialised (not varied): its greedy continuations are predictable enough that a drafter
    # started from its last layer drafts some tokens right, so equal acceptance means something
    deep_target = load_target(TargetConfig(random_init=True, num_hidden_layers=8, num_attention_heads=2,
                                           num_key_value_heads=1))  # fmt: skip
    target_dir = tmp_path / "target"
    deep_target.model.save_pretrained(target_dir)
    deep_target.tokenizer.save_pretrained(target_dir)
    torch.manual_seed(0)
    drafter = build_drafter("eagle3", {"draft_vocab_size": 0, "draft_depth": 3, "fc_norm": True, "norm_output": True,
                                       "init_from_target_layer": True}, deep_target).eval()  # fmt: skip
    export_drafter(drafter, "speculators", tmp_path / "e31", verifier=str(target_dir), num_speculative_tokens=3,
                   target_config=deep_target.config)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 5, 13)]
    # mutation: the same weights served as plain EAGLE-3 (flags off, no fc_norm tensors): vLLM must accept otherwise
    import shutil

    shutil.copytree(tmp_path / "e31", tmp_path / "as_e3")
    cfg = json.loads((tmp_path / "as_e3" / "config.json").read_text())
    (tmp_path / "as_e3" / "config.json").write_text(json.dumps({**cfg, "fc_norm": False, "norm_output": False}))
    from drafttrain.export.common import save_tensors

    w = load_tensors(tmp_path / "as_e3" / "model.safetensors")
    save_tensors(tmp_path / "as_e3" / "model.safetensors", {k: v for k, v in w.items() if not k.startswith("fc_norm.")},
                 {"format": "pt"})  # fmt: skip
    runs = [{"speculative_config": None},
            {"speculative_config": {"model": str(tmp_path / "e31"), "method": "eagle3", "num_speculative_tokens": 3}},
            {"speculative_config": {"model": str(tmp_path / "as_e3"), "method": "eagle3", "num_speculative_tokens": 3}}]
    job = {"model": str(target_dir), "prompts": prompts, "max_new_tokens": 24, "stop_token_ids": [],
           "max_model_len": 256, "eager": True, "runs": runs, "max_num_seqs": 1}  # fmt: skip
    plain, spec, mutant = run_vllm(vllm_python(), job, threads="0-1", memory_gb=1, timeout_s=1800,
                                   log_path=tmp_path / "vllm.log")  # fmt: skip
    assert "error" not in spec, spec.get("error")
    assert spec["outputs"] == plain["outputs"]
    ours = SpecEngine(deep_target, proposer_for(drafter), batch_size=1, max_new_tokens=24, stop_token_ids=[-1]).run(prompts)
    ref = SpecEngine(deep_target, PlainProposer(), batch_size=1, max_new_tokens=24, stop_token_ids=[-1]).run(prompts)
    assert [r.tokens for r in ref.results] == plain["outputs"]  # both engines decode the same target greedily
    st = ours.stats
    mine = ours_per_position(st.accept_hist, sum(st.accept_hist.values()), 3)
    theirs = spec["acceptance"]["per_position"]
    other = mutant["acceptance"]["per_position"]
    print("EAGLE-3.1 per-position acceptance: ours", mine, "vLLM", theirs, "vLLM reading it as EAGLE-3", other)
    assert mine[0] > 0.05  # the drafter drafts something right, so the comparison can fail
    for a, b in zip(mine, theirs):
        assert abs(a - b) <= 0.1, (mine, theirs)
    assert max(abs(a - b) for a, b in zip(mine, other)) > 0.1, (mine, other)  # the flags change what vLLM computes
