"""DFlash export (drafttrain/export/dflash.py): the exported folder read back gives the same draft logits,
every tensor written is one vLLM's DFlash loader consumes, the speculators package's own DFlash model loaded
from the folder computes our drafts (in .venv-vllm, through a subprocess), the refusals, and vLLM's CPU
build running the folder (slow, skipped without a finished .venv-vllm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from drafttrain.drafters import build_drafter
from drafttrain.export import ExportError, export_drafter, formats_for, load_exported, resolve_format
from drafttrain.export.common import load_tensors
from helpers import assert_same_logits, assert_same_weights

B = 4  # block size of the test drafters: 3 drafts per pass


@pytest.fixture(scope="module")
def deep():
    """The tiny 8-layer qwen3 target (2 heads, head_dim 32): DFlash's default ids (2, 4, 6) are distinct."""
    import test_families as TF

    return TF.family_target("qwen3", layers=8)


@pytest.fixture(scope="module")
def deep_dir(deep, tmp_path_factory):
    """The target saved as an HF folder: the verifier speculators reloads the embedding (and head) from."""
    from helpers import save_target

    return save_target(deep, tmp_path_factory.mktemp("qwen3_target"))


def _dflash(target, n_vocab: int = 0, seed: int = 0, **cfg):
    """A DFlash drafter with trained-looking weights (norms around 1, every matrix redrawn)."""
    torch.manual_seed(seed)
    dr = build_drafter("dflash", {"block_size": B, "num_layers": 2, "init_from_target_layer": False,
                                  "draft_vocab_size": n_vocab, **cfg}, target)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    if n_vocab:
        dr.set_draft_vocab(torch.randperm(dr.vocab_size, generator=g)[:n_vocab])
    with torch.no_grad():
        for p in dr.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return dr.eval()


def _inputs(dr, t: int = 9, seed: int = 3):
    """t context items: next ids x_1..x_t [1, t] (x_t is the bonus token) and random features [1, t, F]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, dr.vocab_size, (1, t), generator=g)
    feats = torch.randn(1, t, dr.feature_dim, generator=g)
    return ids, feats


def test_dflash_is_a_format():
    assert formats_for("dflash") == ["dflash"] and resolve_format("dflash", None) == "dflash"


@pytest.mark.parametrize("n_vocab", [0, 300])
def test_dflash_roundtrip_identical_logits(deep, tmp_path, n_vocab):
    """Export then read back: weights equal bit for bit, and `propose` logits equal (within LOGITS_ATOL, same
    argmax: computed logits may round differently by host kernel), in one call and over a cache filled in steps."""
    dr = _dflash(deep, n_vocab)
    fmt, cfg = export_drafter(dr, None, tmp_path, verifier="/models/target", target_config=deep.config)
    assert fmt == "dflash" and cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == list(dr.feature_layers) == [2, 4, 6]  # our ids, unchanged
    assert cfg["block_size"] == B and cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert cfg["mask_token_id"] == dr.mask_token_id and cfg["draft_vocab_size"] == (n_vocab or dr.vocab_size)
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is False  # vLLM: non-causal
    assert cfg["transformer_layer_config"]["rope_parameters"]["rope_theta"] == 10000.0  # vLLM's default is 1e6
    back = load_exported(tmp_path, "dflash", deep).eval()
    assert torch.equal(back.draft_token_ids, dr.draft_token_ids)
    assert_same_weights(back, dr)
    ids, feats = _inputs(dr)
    assert_same_logits(back.propose(ids, feats, DynamicCache()), dr.propose(ids, feats, DynamicCache()))
    c1, c2 = DynamicCache(), DynamicCache()
    for lo, hi in ((0, 5), (5, 9)):
        a, b = dr.propose(ids[:, lo:hi], feats[:, lo:hi], c1), back.propose(ids[:, lo:hi], feats[:, lo:hi], c2)
    assert_same_logits(b, a)


@pytest.mark.parametrize("n_vocab", [0, 300])
def test_dflash_tensor_names_are_the_loaders(deep, tmp_path, n_vocab):
    """Every tensor written is one vLLM's DFlashQwen3ForCausalLM.load_weights maps onto a parameter, and
    every parameter it needs is written (held equal, as for EAGLE-3)."""
    from drafttrain.export.dflash import vllm_consumed_names

    dr = _dflash(deep, n_vocab)
    export_drafter(dr, "dflash", tmp_path, target_config=deep.config)
    w = load_tensors(tmp_path / "model.safetensors")
    assert set(w) == vllm_consumed_names(2, restricted=bool(n_vocab))
    assert not any("embed_tokens" in k or "mask_hidden" in k for k in w)  # shared / asserted against by vLLM
    if n_vocab:
        assert torch.equal(w["lm_head.weight"], deep.lm_head.weight[dr.draft_token_ids])
        assert torch.equal(w["d2t"] + torch.arange(n_vocab), dr.draft_token_ids) and w["t2d"].sum() == n_vocab


def test_dflash_export_refusals(deep, tmp_path):
    dr = _dflash(deep)
    with pytest.raises(ExportError, match="num_speculative_tokens=5"):
        export_drafter(dr, "dflash", tmp_path, num_speculative_tokens=5)
    export_drafter(dr, "dflash", tmp_path / "ok", num_speculative_tokens=B - 1)
    with pytest.raises(ExportError, match="strictly increasing"):
        export_drafter(_dflash(deep, target_layer_ids=[6, 2, 4]), "dflash", tmp_path / "ids")
    with pytest.raises(ExportError, match=r"dflash format writes the drafters that declare it \(dflash\), not .medusa."):
        from drafttrain.export.dflash import export

        export(build_drafter("medusa", {"num_heads": 2}, deep), tmp_path / "md")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "sliding_window_non_causal": False}))
    with pytest.raises(ExportError, match="causal"):
        load_exported(tmp_path / "ok", "dflash", deep)


def test_dflash_export_refuses_a_scaled_embedding(tmp_path):
    """Gemma's embedding module multiplies by sqrt(d): vLLM and speculators embed with the raw rows."""
    import test_families as TF

    target = TF.family_target("gemma3", layers=2)
    with pytest.raises(ExportError, match="plain row lookup"):
        export_drafter(_dflash(target), "dflash", tmp_path)


def test_serve_check_speculative_config(deep, tmp_path):
    from scripts.serve_check import speculative_config

    export_drafter(_dflash(deep), "dflash", tmp_path, target_config=deep.config)
    spec = speculative_config(tmp_path, {"format": "dflash"}, B - 1)
    assert spec == {"model": str(tmp_path.resolve()), "method": "dflash", "num_speculative_tokens": B - 1}
    with pytest.raises(ValueError, match="block_size 4"):
        speculative_config(tmp_path, {"format": "dflash"}, 2)


# -- the speculators package's own DFlash model ----------------------------------------------------
_SPECULATORS_RUN = r"""
import json, sys
import torch
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

job = json.load(open(sys.argv[1]))
out = {}
for case in job["cases"]:
    cfg = DFlashSpeculatorConfig.from_pretrained(case["dir"])
    cfg.transformer_layer_config._attn_implementation = "eager"  # float masks; flex attention needs compile
    model = DFlashDraftModel.from_pretrained(case["dir"], config=cfg).float().eval()
    x = torch.load(case["inputs"])
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(x["hidden_states"], x["input_ids"], x["loss_mask"],
                                                x["verifier_last_hidden_states"], x["document_ids"],
                                                x["position_ids"], max_anchors=1)
    out[case["dir"]] = {"logits": logits[0], "block_size": model.block_size,
                        "aux": list(model.target_layer_ids), "mask": model.mask_token_id}
torch.save(out, job["out"])
print("ok")
"""


def _speculators_python() -> str:
    import importlib.util

    from drafttrain.generation.vllm_client import vllm_install_state, vllm_python

    if importlib.util.find_spec("speculators") is not None:
        return sys.executable
    state, why = vllm_install_state()
    if state != "ready":
        pytest.skip(f"speculators is not installed here, and in vLLM's venv: {why}")
    py = vllm_python()
    return str(py)


def test_speculators_dflash_model_computes_our_drafts(deep, deep_dir, tmp_path):
    """speculators' DFlashDraftModel loaded from the exported folder (its config class, its weight loading,
    the embedding and full-vocabulary head reloaded from the verifier folder) gives the drafts of our
    `propose` for the same context features, tokens and positions: its anchored block at position A holds
    the bonus token and sees the context positions < A, ours is anchored at item a = A - 1. Full and
    restricted vocabulary, one subprocess."""
    py = _speculators_python()
    t = 9  # context items 0..t-1 at positions 0..t-1; the block at positions t..t+B-1
    cases, ours = [], {}
    for n_vocab in (0, 300):
        dr = _dflash(deep, n_vocab, seed=n_vocab)
        d = tmp_path / f"dflash_{n_vocab}"
        export_drafter(dr, "dflash", d, verifier=str(deep_dir), target_config=deep.config)
        ids, feats = _inputs(dr, t, seed=7 + n_vocab)
        seq = t + B + 1  # speculators anchors only positions < seq - B: pad beyond (never attended)
        g = torch.Generator().manual_seed(11)
        hidden = torch.randn(1, seq, dr.feature_dim, generator=g)
        hidden[:, :t] = feats
        input_ids = torch.randint(3, dr.vocab_size, (1, seq), generator=g)
        input_ids[:, 1 : t + 1] = ids  # token at position i + 1 = next id of item i; position t: the bonus token
        loss_mask = torch.zeros(1, seq, dtype=torch.long)
        loss_mask[0, t] = 1  # the one anchor: position t
        x = {"hidden_states": hidden, "input_ids": input_ids, "loss_mask": loss_mask,
             "verifier_last_hidden_states": torch.randn(1, seq, dr.shared.model_config.hidden_size, generator=g),
             "document_ids": torch.zeros(1, seq, dtype=torch.long), "position_ids": torch.arange(seq)[None]}  # fmt: skip
        torch.save(x, tmp_path / f"inputs_{n_vocab}.pt")
        cases.append({"dir": str(d), "inputs": str(tmp_path / f"inputs_{n_vocab}.pt")})
        ours[str(d)] = dr.propose(ids, feats, DynamicCache())[0][:, dr.draft_token_ids]  # [B - 1, N]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases, "out": str(tmp_path / "out.pt")}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see drafttrain's packages
    res = subprocess.run([py, "-c", _SPECULATORS_RUN, str(job)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for d, want in ours.items():
        g = got[d]
        assert g["block_size"] == B and g["aux"] == [2, 4, 6] and g["mask"] == deep.config.vocab_size - 1
        torch.testing.assert_close(g["logits"][1:].float(), want, atol=1e-4, rtol=1e-4)  # slots 1..B-1 draft


# -- vLLM itself (optional: scripts/install_vllm.sh) ----------------------------------------------
def _distil(dr, target, prompts, steps: int = 20, new: int = 40):
    """A few Adam steps of the DFlash loss on the target's own greedy continuations of ``prompts``: drafts
    get partly accepted (20 steps: about half the first drafts), so vLLM's per-position acceptance can be
    held to our engine's, not only its outputs."""
    gen = target.generate(prompts, new, stop_token_ids=[], return_features=False)
    seqs = [g["tokens"] for g in gen]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(p) : len(s)] = 1
    lengths = torch.tensor([len(s) for s in seqs])
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    feats = target.forward(ids, attention_mask=attn, with_logits=False, feature_layers=tuple(dr.feature_layers)).features
    batch = {"input_ids": ids, "loss_mask": mask, "lengths": lengths, "features": feats[:, :-1]}
    opt = torch.optim.Adam(dr.parameters(), lr=3e-3)
    dr.train()
    for step in range(steps):
        loss = dr.training_loss(batch, torch.Generator().manual_seed(step)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return dr.eval()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_vllm_runs_dflash_export_losslessly(deep, deep_dir, tmp_path):
    """vLLM's CPU build loads the tiny qwen3 target and DFlash exports ({"method": "dflash",
    "num_speculative_tokens": B - 1}); speculative greedy == plain greedy for both drafters, and for the one
    whose layers share one k_norm weight vLLM's acceptance counters (drafts, per-position acceptance) equal
    our engine's on the same prompts, i.e. vLLM drafted the same tokens at every step. The other drafter
    (per-layer k_norm weights, as training leaves them) is only lossless there: vLLM 0.32's CPU rms_norm
    kernel applies layer 0's weight when it norms every layer's context keys in one grouped call
    (``_normalize_context_k``), so its drafts differ from ours and from speculators'. Skipped with vLLM's
    message where its CPU build cannot run DFlash; skipped without a finished .venv-vllm."""
    import test_families as TF

    from drafttrain.generation.vllm_client import vllm_install_state, vllm_python
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.proposers import proposer_for
    from scripts.serve_check import ours_per_position, run_vllm

    state, why = vllm_install_state()
    if state != "ready":  # absent, or a venv whose install has not finished (no stamp): never used
        pytest.skip(why)
    py = vllm_python()
    prompts = [p[:9] for p in TF._prompts(deep, 2)]
    tied = _dflash(deep)
    with torch.no_grad():
        for layer in tied.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(tied.layers[0].self_attn.k_norm.weight)
    tied = _distil(tied, deep, prompts)
    untied = _distil(_dflash(deep, seed=1), deep, prompts)
    runs = [{"speculative_config": None}]
    for name, dr in (("tied", tied), ("untied", untied)):
        export_drafter(dr, "dflash", tmp_path / name, verifier=str(deep_dir), target_config=deep.config)
        runs.append({"speculative_config": {"model": str(tmp_path / name), "method": "dflash",
                                            "num_speculative_tokens": B - 1}})  # fmt: skip
    job = {"model": str(deep_dir), "prompts": prompts, "max_new_tokens": 16, "stop_token_ids": [],
           "max_model_len": 256, "eager": True, "runs": runs}  # fmt: skip
    try:
        results = run_vllm(py, job, threads="0-1", memory_gb=1, timeout_s=1800, log_path=tmp_path / "vllm.log")
    except RuntimeError as err:
        pytest.skip(f"vLLM 0.32 CPU could not run the job: {str(err)[-800:]}")
    (tmp_path / "result.json").write_text(json.dumps(results))
    plain, spec_tied, spec_untied = results
    assert "error" not in plain, plain.get("error")
    for spec in (spec_tied, spec_untied):
        if "error" in spec:
            pytest.skip(f"vLLM 0.32 CPU refuses DFlash: {spec['error'][-800:]}")
        assert spec["outputs"] == plain["outputs"]
        assert spec["acceptance"]["num_drafts"] > 0 and len(spec["acceptance"]["per_position"]) == B - 1
    ours = SpecEngine(deep, proposer_for(tied, widths=[1] * (B - 1)), batch_size=1, max_new_tokens=16,
                      stop_token_ids=[]).run(prompts)  # fmt: skip
    assert [list(r.tokens) for r in ours.results] == plain["outputs"]
    acc = spec_tied["acceptance"]
    assert 0 < acc["num_accepted_tokens"] < acc["num_draft_tokens"]  # partly accepted: the counters discriminate
    assert acc["num_drafts"] == ours.stats.seq_steps
    assert acc["per_position"] == pytest.approx(ours_per_position(ours.stats.accept_hist, ours.stats.seq_steps, B - 1))
