"""Targets a user brings (``target.path=<folder>``) of transformers classes the family table does not list:
tiny random ones (6 layers, d = 128, the SmolLM2 tokenizer) of the real classes. A trait the engine cannot
honour is refused by name before any data is generated (tests/target: the pre-flight check); a decoder layer whose
modules do not map onto the Llama-style draft layer (OLMo-2's post-norms, Cohere's LayerNorm and parallel
block, Llama-4's ``feed_forward``) starts the draft layer from its own initialisation where they do not, with
the reason logged; a model that scales its logits (Granite, Cohere) gives its own distribution through
:class:`drafttrain.target.Target`. Each family of the README's table (OLMo-2, Cohere-2, Granite, GLM-4, SmolLM3,
Llama-4 text) trains ``eagle3``, ``parallelspec`` and ``dflash`` end to end from a saved folder, decodes through
the engine as its own forward does, and exports for serving (GLM-4's DFlash export refused: partial RoPE)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from drafttrain.target import families
from drafttrain.cliconfig import ConfigError
from drafttrain.drafters import build_drafter
from drafttrain.target import Target
from helpers import compose_dict, make_batch

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096)  # fmt: skip


def _config(kind: str, tokenizer, **extra):
    import transformers

    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    cls = getattr(transformers, kind)
    cfg = cls(**SIZES, **ids, **extra)
    cfg.architectures = [kind.removesuffix("Config").removesuffix("Text") + "ForCausalLM"]
    return cfg


def _target(kind: str, tokenizer, **extra) -> Target:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return Target(AutoModelForCausalLM.from_config(_config(kind, tokenizer, **extra)), tokenizer)


# ------------------------------------------------------------------------------------------------ MLA: read from the config


def test_mla_rule_reads_public_config_attributes(tiny_target):
    import transformers

    assert families.mla_attention(transformers.DeepseekV3Config()) == "kv_lora_rank"
    assert families.mla_attention({"q_lora_rank": 8}) == "q_lora_rank"
    assert families.mla_attention({"v_head_dim": 64, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32}).startswith("v_head_dim")
    assert families.mla_attention({"v_head_dim": 96, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32}) is None
    assert families.mla_attention(tiny_target.config) is None
    assert families.family_of({"model_type": "deepseek_v3", "kv_lora_rank": 32}).mla
    assert families.architecture_name({"architectures": ["DeepseekV3ForCausalLM"]}) == "DeepseekV3"


# ------------------------------------------------------------------------------------------------ init fallback


@pytest.mark.parametrize("kind,reason", [("Olmo2Config", "no input_layernorm"),
                                         ("Cohere2Config", "Cohere2LayerNorm is not an RMSNorm")])  # fmt: skip
def test_draft_layer_init_falls_back_with_the_reason_logged_and_trains(tiny_target, kind, reason, caplog):
    """OLMo-2 (norms after attention and MLP) and Cohere-2 (parallel attention + MLP, LayerNorm): the EAGLE-3
    draft layer takes the projections that map (same weights) and its own norms (ones), logging why; then two
    training steps move it."""
    extra = {"head_dim": 32} if kind == "Cohere2Config" else {}
    target = _target(kind, tiny_target.tokenizer, **extra)
    with caplog.at_level(logging.WARNING, logger="drafttrain.target.families"):
        torch.manual_seed(0)
        drafter = build_drafter("eagle3", {"draft_depth": 3, "ttt_steps": 2}, target).train()
    assert any(reason in r.getMessage() and "fresh Llama-style" in r.getMessage() for r in caplog.records)
    assert drafter.aux_layer_ids == (2, 3, 4)
    d, src = target.config.hidden_size, target.last_layer
    assert torch.equal(drafter.layer.self_attn.q_proj.weight[:, d:], src.self_attn.q_proj.weight)
    assert torch.equal(drafter.layer.mlp.down_proj.weight, src.mlp.down_proj.weight)  # SiLU dense MLP: carried over
    assert torch.equal(drafter.layer.hidden_norm.weight, torch.ones(d))
    batch = make_batch(target)
    ids, lengths = batch["input_ids"], batch["lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    feats = target.forward(ids, attention_mask=mask, with_logits=False, feature_layers=drafter.feature_layers).features
    batch = {**batch, "features": feats[:, :-1]}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    before = copy.deepcopy(drafter.fc.weight)
    for step in range(2):
        out = drafter.training_loss(batch, torch.Generator().manual_seed(step))
        assert torch.isfinite(out.loss)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert not torch.equal(before, drafter.fc.weight)


def test_llama4_feed_forward_is_the_mlp_the_draft_layer_starts_from(tiny_target):
    """Llama-4's decoder layer calls its MLP ``feed_forward``: a dense one carries over (no AttributeError)."""
    target = _target("Llama4TextConfig", tiny_target.tokenizer, head_dim=32, intermediate_size_mlp=256, moe_layers=[],
                     num_local_experts=2)  # fmt: skip
    torch.manual_seed(0)
    drafter = build_drafter("eagle3", {"draft_depth": 3}, target)
    ff = target.last_layer.feed_forward
    assert torch.equal(drafter.layer.mlp.gate_proj.weight, ff.gate_proj.weight)
    assert set(families.split_projections(target.last_layer)) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj"}  # fmt: skip


def test_rms_norm_probe_tells_layer_norm_apart(tiny_target):
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    assert families.is_rms_norm(tiny_target.final_norm, tiny_target.config.hidden_size)
    g = Gemma3RMSNorm(64)
    with torch.no_grad():
        g.weight.normal_()
    assert families.is_rms_norm(g, 64)
    assert not families.is_rms_norm(CohereLayerNorm(64), 64)


# ------------------------------------------------------------------------------------------------ logit scaling


@pytest.mark.parametrize("kind,extra", [("GraniteConfig", {"logits_scaling": 8.0}),
                                        ("CohereConfig", {"logit_scale": 0.25}),
                                        ("Cohere2Config", {"logit_scale": 0.0625, "head_dim": 32})])  # fmt: skip
def test_logits_are_the_models_own_with_its_logit_scale(tiny_target, kind, extra):
    """Target.forward's logits, the LM head the drafters and the engine read, and sampling's logits equal the HF
    model's own forward (which scales them); the model's own forward is unchanged by the fold, the embedding too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, tiny_target.tokenizer, **extra)).eval()
    pristine = copy.deepcopy(model)
    ids = torch.randint(3, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = pristine(ids).logits.float()
        unscaled = pristine.lm_head(pristine.model(ids).last_hidden_state).float()
    assert not torch.allclose(want, unscaled, atol=1e-3)  # the scale matters here
    target = Target(model, tiny_target.tokenizer)
    assert target.logit_multiplier == pytest.approx(families.logit_multiplier(pristine.config)) != 1.0
    out = target.forward(ids)
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.nn.functional.linear(out.hidden, target.lm_head.weight).float(), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(model.get_input_embeddings().weight, pristine.get_input_embeddings().weight)
    plain = Target(copy.deepcopy(pristine), tiny_target.tokenizer)  # a second Target of a folded model: no refold
    assert Target(plain.model, tiny_target.tokenizer).logit_multiplier == 1.0


def test_logit_scale_survives_a_saved_folder(tiny_target, tmp_path):
    """target.path=<folder> of a Granite model: load_target gives its own logits (the folder keeps its scale)."""
    from transformers import AutoModelForCausalLM

    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("GraniteConfig", tiny_target.tokenizer, logits_scaling=4.0))
    model.save_pretrained(tmp_path)
    tiny_target.tokenizer.save_pretrained(tmp_path)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(ids).logits.float()
    target = load_target(TargetConfig(path=str(tmp_path), fast_linear="off"))
    assert target.logit_multiplier == 0.25
    torch.testing.assert_close(target.forward(ids).logits, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ train.run


#: the families a user brings, as tiny saved folders: config class -> the extra keys of the tiny config
USER_FAMILIES = {
    "Olmo2Config": {},
    "Cohere2Config": {"head_dim": 32},
    "GraniteConfig": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                      "attention_multiplier": 0.125},
    "Glm4Config": {"head_dim": 32, "partial_rotary_factor": 0.5},
    "SmolLM3Config": {"no_rope_layer_interval": 2},  # NoPE on every 2nd layer
    # MoE on every 2nd layer, NoPE on every 2nd, chunked attention on the RoPE layers
    "Llama4TextConfig": {"head_dim": 32, "intermediate_size_mlp": 256, "num_local_experts": 2,
                         "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 1024},
}
RECIPES = ("eagle3", "parallelspec", "dflash")
#: (family, recipe) -> what the run prints where its export for serving is refused (the run still succeeds)
EXPORT_REFUSED = {("Glm4Config", "dflash"): "serve: not exported: RoPE"}  # partial RoPE: vLLM's DFlash rotates all


@pytest.fixture(scope="module")
def user_folders(tiny_target, tmp_path_factory):
    """One saved tiny target folder and one self-distilled data cache per family, shared by its recipes
    (the data's fingerprint names the target and the generation, not the drafter)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, object] = {}

    def folder(kind: str):
        if kind not in made:
            root = tmp_path_factory.mktemp(kind.removesuffix("Config").lower())
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(kind, tiny_target.tokenizer, **USER_FAMILIES[kind]))
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():  # as initialised, a tiny model repeats one token: redrawn, continuations vary
                for p in model.parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, 0.3, generator=g)
            model.save_pretrained(root / "target")
            tiny_target.tokenizer.save_pretrained(root / "target")
            made[kind] = root
        return made[kind]

    return folder


@torch.no_grad()
def _own_greedy(model, prompt: list[int], new: int) -> list[int]:
    """The model's own greedy continuation: its full forward over the whole sequence at every step (no cache)."""
    ids = torch.tensor([prompt])
    for _ in range(new):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_user_targets_are_the_families_they_claim(user_folders):
    """The saved folders hold what the table says: Llama-4 with MoE on every 2nd layer, NoPE layers and chunked
    attention on the RoPE ones; SmolLM3 with NoPE layers; GLM-4 with partial RoPE; Granite with its multipliers."""
    from transformers import AutoConfig

    cfg = {k: AutoConfig.from_pretrained(user_folders(k) / "target") for k in USER_FAMILIES}
    assert {k: c.architectures[0] for k, c in cfg.items()} == {
        "Olmo2Config": "Olmo2ForCausalLM", "Cohere2Config": "Cohere2ForCausalLM", "GraniteConfig": "GraniteForCausalLM",
        "Glm4Config": "Glm4ForCausalLM", "SmolLM3Config": "SmolLM3ForCausalLM", "Llama4TextConfig": "Llama4ForCausalLM"}  # fmt: skip
    l4 = cfg["Llama4TextConfig"]
    assert list(l4.moe_layers) == [1, 3, 5] and list(l4.no_rope_layers) == [1, 0, 1, 0, 1, 0]
    assert families.attention_window(l4) == 1024  # chunked attention on the RoPE layers: a window to the engine
    assert list(cfg["SmolLM3Config"].no_rope_layers) == [1, 0, 1, 0, 1, 0]
    assert cfg["Glm4Config"].rope_parameters["partial_rotary_factor"] == 0.5
    assert families.logit_multiplier(cfg["GraniteConfig"]) == 0.25


@pytest.mark.parametrize("kind", list(USER_FAMILIES))
def test_user_target_decodes_through_the_engine_as_its_own_forward(user_folders, kind):
    """The folder loaded as drafttrain loads it: speculative decoding through the engine with each recipe's
    drafter (eagle3, parallelspec's parallelspec_eagle3, dflash) at batch 3 (unpadded, a tree of widths [2, 1],
    continuous batching over 4 prompts) gives, token for token, the greedy tokens of the model's own full
    forward (loaded afresh, no cache). The continuations vary (not one repeated token)."""
    from transformers import AutoModelForCausalLM

    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.proposers import proposer_for

    folder = user_folders(kind) / "target"
    target = load_target(TargetConfig(path=str(folder), fast_linear="off"))
    own = AutoModelForCausalLM.from_pretrained(folder).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.config.vocab_size, (5 + 3 * i,), generator=g).tolist() for i in range(4)]
    want = [_own_greedy(own, p, 12) for p in prompts]
    assert all(len(set(w)) > 2 for w in want)
    configs = {"eagle3": {"draft_depth": 3, "ttt_steps": 2}, "parallelspec_eagle3": {"num_mask_tokens": 3},
               "dflash": {"block_size": 4, "num_layers": 2}}  # fmt: skip
    for name, cfg in configs.items():
        torch.manual_seed(0)
        drafter = build_drafter(name, cfg, target).eval()
        run = SpecEngine(target, proposer_for(drafter, widths=[2, 1]), batch_size=3, max_new_tokens=12,
                         mode="unpadded", stop_token_ids=[]).run(prompts)  # fmt: skip
        assert [r.tokens for r in run.results] == want, name


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", list(USER_FAMILIES))
def test_user_target_folder_trains_every_recipe_end_to_end(user_folders, kind, recipe, tmp_path, capsys):
    """``train.run`` with ``target.path=<folder>`` (a saved tiny model of the family) and ``+recipe=<recipe>``:
    self-distillation through the engine, two training steps, the in-training evaluation through the engine
    greedy-equal (the speculative decode's tokens equal the target's own greedy decode), and the export for
    serving written (``output_dir/export``) or refused with its reason printed (:data:`EXPORT_REFUSED`)."""
    from drafttrain import train as T

    root = user_folders(kind)
    ov = [f"+recipe={recipe}", f"target.path={root / 'target'}", "data.max_conversations=6",
          "data.generation.max_new_tokens=8", "data.heldout=2", "trainer.max_steps=2", "trainer.spec_eval.num_prompts=2",
          "trainer.spec_eval.max_new_tokens=8", "trainer.spec_eval.latency_prompts=0", "trainer.spec_eval.tree.plan=false",
          "trainer.spec_eval.sssd.source=none", "trainer.spec_eval.batch_size=2", "trainer.log_every=1",
          "trainer.progress=false", "trainer.num_threads=1", "trainer.mixed_precision=no", "trainer.micro_batch_size=2",
          "trainer.eval_every=1000", "trainer.save_every=1000", f"output_dir={tmp_path / 'run'}",
          f"data.cache_dir={root / 'data'}", "logging.wandb=false", "drafter.draft_vocab_size=0"]  # fmt: skip
    metrics = T.run(compose_dict("train", ov))
    assert metrics["step"] == 2 and metrics["eval/greedy_equal"] is True
    info = tmp_path / "run" / "export" / "export_info.json"  # the run ends by exporting for serving
    out, refused = capsys.readouterr().out, (kind, recipe) in EXPORT_REFUSED
    assert info.exists() != refused, out[-2000:]
    assert not refused or EXPORT_REFUSED[kind, recipe] in out


def test_chunked_attention_bounds_the_engine_like_a_window():
    """Llama-4's chunked attention is applied through masks the engine does not build: exact while a sequence
    is one chunk, so the engine refuses longer ones as it does past a sliding window."""
    assert families.attention_window({"attention_chunk_size": 8192, "layer_types": ["chunked_attention",
                                                                                    "full_attention"]}) == 8192  # fmt: skip
    assert families.attention_window({"attention_chunk_size": 8192, "layer_types": ["full_attention"]}) is None
    assert families.attention_window({"sliding_window": 4096, "attention_chunk_size": 8192}) == 4096
    assert families.attention_window({"model_type": "llama"}) is None
