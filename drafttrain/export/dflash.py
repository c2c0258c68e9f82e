"""DFlash -> vLLM's DFlash loader (speculators format): ``speculative_config={"model": DIR, "method": "dflash",
"num_speculative_tokens": B - 1}`` (or ``vllm serve DIR``).

What vLLM 0.32 reads (``transformers_utils/configs/speculators/algos.py`` ``update_dflash``,
``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``) and what the speculators package
(0.9, ``speculators/models/dflash``) writes and computes:

- ``config.json``: ``speculators_model_type`` ``dflash``, ``architectures`` [``DFlashSpeculator``] (vLLM
  replaces it by ``DFlashDraftModel`` -> ``DFlashQwen3ForCausalLM``), ``transformer_layer_config`` (a Qwen3
  config: ``num_hidden_layers`` = the draft layers, sizes, eps and RoPE; vLLM builds the draft config
  from it and defaults a missing ``rope_theta`` to 1e6, so it is always written), ``draft_vocab_size``,
  ``target_hidden_size``, ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids``,
  ``sample_from_anchor`` (false: slot 0 holds the bonus token, slots 1..B-1 draft) and
  ``sliding_window_non_causal`` (see "causal" below), ``speculators_config`` (greedy, ``speculative_tokens``
  = B - 1; ``verifier.name_or_path``).
- ``model.safetensors``: ``fc.weight`` [d, m*d], ``hidden_norm.weight``, ``layers.{i}.*`` (q/k/v/o, q_norm,
  k_norm, gate/up/down, input_layernorm, post_attention_layernorm; vLLM stacks q/k/v into qkv_proj and
  gate/up into gate_up_proj), ``norm.weight``. No ``embed_tokens``: both engines embed the bonus and
  [MASK] tokens with the target's rows, as we do. ``lm_head`` only with a restricted draft vocabulary
  ([N, d], the target's rows of the draft ids) together with ``d2t`` (offsets; vLLM renames it
  ``draft_id_to_target_id`` and scatters the N logits to target ids with -inf elsewhere, as
  :meth:`Drafter.full_vocab_logits`) and ``t2d`` (vLLM skips it, speculators reads it); with the full
  vocabulary vLLM shares the target's LM head and speculators reloads it from the verifier.
  ``mask_hidden`` is refused by vLLM's DFlash loader (an assert): never written.

Layer ids. drafttrain's ``target_layer_ids`` name the hidden state *entering* decoder layer i (HF
``output_hidden_states[i]``). vLLM captures ``hidden + residual`` before layer i for every id in
``eagle_aux_hidden_state_layer_ids`` (the same tensor for i in [0, L - 1]) and ``update_dflash`` copies the
speculators field ``aux_hidden_state_layer_ids`` there unchanged, so that field holds **our ids as they are**
(speculators generates its training features through vLLM, so its aux ids are the same convention).
``dflash_config.target_layer_ids`` = ids - 1 is the DFlash reference code's "output of layer i" convention;
vLLM derives it itself. vLLM concatenates the captured states in layer order, once each: the ids must be
strictly increasing.

The network, compared (drafttrain :class:`~drafttrain.drafters.dflash.DFlashDrafter` / vLLM
``DFlashQwen3Model`` / speculators ``DFlashDraftModel``), all the same:

- context c = hidden_norm(fc(concat features)), fc without bias; the context does **not** go through a
  layer's input_layernorm; each layer's keys/values of c are its own k_proj / v_proj, **k_norm on the
  context keys**, RoPE at the context tokens' own positions (0..a);
- the block: embedding of [bonus token, mask x (B - 1)] at positions a + 1 .. a + B (vLLM: last context
  position + 1 + offset; speculators: the anchor's position + offset); each layer: x + o_proj(attn(
  input_layernorm(x))) then + MLP(post_attention_layernorm(.)), q_norm / k_norm per head, neox RoPE,
  scale head_dim ** -0.5; final ``norm`` then the LM head;
- attention: every block query sees all context keys <= a and the whole block, **bidirectionally**;
- drafts: block slots 1..B-1 (vLLM samples ``query_off > 0``; speculators with ``sample_from_anchor`` false).

Causal flag: vLLM's ``update_dflash`` sets ``dflash_config.causal = not sliding_window_non_causal`` (absent =
true -> non-causal) and that override applies to **every** layer, full-attention ones included, while the
speculators package defaults the field to false and keeps full-attention layers bidirectional. A folder with
``sliding_window_non_causal: false`` (speculators' default) would therefore run a causal block in vLLM: we
always write true (no draft layer slides, so speculators reads the same bidirectional network).

vLLM 0.32's CPU build (docs/serving.md, "DFlash"): lossless, but its ``ops.rms_norm`` applies row 0 of the
grouped [layers, head_dim] weight that ``_normalize_context_k`` passes, so every layer's context keys get
layer 0's k_norm: with per-layer k_norm weights its drafts differ from ours and speculators' (a kernel
defect, not the format: nothing to write differently; equal k_norm weights give our drafts exactly).

Refused (:class:`ExportError`): another recipe; a target whose embedding module is not a plain row lookup
(Gemma's sqrt(d) scaling inside the module: both engines embed with the raw rows); biases anywhere; a
non-SiLU MLP; RoPE other than default / linear / llama3 (closed forms both sides compute alike) or partial
rotary; layer ids not strictly increasing in [0, L - 1]; ``num_speculative_tokens`` other than B - 1 (vLLM's
block is 1 + num_speculative_tokens slots: another count attends over another block than the one trained).

Shape letters: d hidden, m fused layers, v target vocab, N draft vocab, B block size, L target layers.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from drafttrain.export.common import ExportError, check_consumed, load_tensors, save_tensors, write_json, fc_layout

WEIGHTS = "model.safetensors"
ENGINE = "vLLM DFlash loader (qwen3_dflash.py, speculators format)"
MODEL_TYPE = "dflash"  # speculators' model type of the folder (the drafter declares it: serving_formats)
SPECULATORS_VERSION = "0.9.0"  # the release whose DFlash classes the tests load the folder with
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")  # fmt: skip
ROPE_TYPES = ("default", "linear", "llama3")


def vllm_consumed_names(num_layers: int, restricted: bool) -> set[str]:
    """Tensor names ``DFlashQwen3ForCausalLM.load_weights`` maps onto a parameter of a ``num_layers``-layer
    drafter without its own embedding: fc, hidden_norm, layers.{i}.* (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj; checkpoint-local layer ids), norm; with a restricted vocabulary lm_head, d2t (->
    draft_id_to_target_id) and t2d (skipped by vLLM, read by speculators)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    names |= {f"layers.{i}.{n}" for i in range(int(num_layers)) for n in LAYER_WEIGHTS}
    if restricted:
        names |= {"lm_head.weight", "d2t", "t2d"}
    return names


def _rope(drafter) -> dict:
    rope = dict(getattr(drafter.qwen3_config, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(getattr(drafter.qwen3_config, "rope_theta", 10000.0)))
    return rope


def check_drafter(drafter, num_speculative_tokens: int | None = None) -> None:
    """Refuse a drafter whose network vLLM's / speculators' DFlash would not compute exactly (module docstring).

    Raises:
        ExportError: naming the difference.
    """
    from drafttrain.export.formats import check_declares

    check_declares(drafter, "dflash")
    bsz = drafter.block_size
    if num_speculative_tokens is not None and int(num_speculative_tokens) != bsz - 1:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens}: a DFlash drafter trained with block_size "
                          f"{bsz} drafts {bsz - 1} tokens per pass; vLLM's block is 1 + num_speculative_tokens "
                          "slots, so another count would attend over a block the drafter was not trained on")  # fmt: skip
    emb = drafter.shared.embed_tokens
    probe = torch.tensor([[0, drafter.mask_token_id, drafter.vocab_size // 2]], device=emb.weight.device)
    with torch.no_grad():
        if not torch.equal(emb(probe)[0], emb.weight[probe[0]]):
            raise ExportError(f"the target's embedding module ({type(emb).__name__}) is not a plain row lookup (e.g. "
                              "Gemma's sqrt(d) scaling inside it); vLLM's and speculators' DFlash embed the bonus and "
                              "[MASK] tokens with the raw rows, so they would run another network")  # fmt: skip
    if getattr(drafter.shared.lm_head, "bias", None) is not None:
        raise ExportError("the target's LM head has a bias; vLLM's DFlash head (ParallelLMHead) has none")
    if drafter.fc.bias is not None:
        raise ExportError("fc has a bias; vLLM's and speculators' DFlash fc have none")
    for i, layer in enumerate(drafter.layers):
        for name, mod in list(layer.self_attn.named_children()) + list(layer.mlp.named_children()):
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                raise ExportError(f"layers.{i}.{name} has a bias; the exported Qwen3 config says attention_bias false")
    qcfg = drafter.qwen3_config
    if getattr(qcfg, "hidden_act", "silu") != "silu":
        raise ExportError(f"hidden_act {qcfg.hidden_act!r}: vLLM's DFlash MLP (Qwen2MLP) runs SiLU only")
    rope = _rope(drafter)
    if rope["rope_type"] not in ROPE_TYPES or float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ExportError(f"RoPE {rope}: exported only for rope_type in {ROPE_TYPES} over the full head dim, whose "
                          "closed forms vLLM's get_rope and transformers compute alike")  # fmt: skip
    ids = [int(i) for i in drafter.feature_layers]
    n_layers = int(drafter.shared.model_config.num_hidden_layers)
    if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= n_layers:
        raise ExportError(f"target_layer_ids {ids}: vLLM concatenates the captured layers in layer order, once each, "
                          f"so the ids must be strictly increasing in [0, {n_layers - 1}] (retrain with sorted ids)")  # fmt: skip


def layer_config(drafter, target_config) -> dict:
    """``transformer_layer_config``: the draft layers as a Qwen3 config dict (sizes from the target, SiLU, no
    biases, every layer full attention, no sliding window), plus the bos/eos/pad ids."""
    q = drafter.qwen3_config
    rope = _rope(drafter)
    n = int(q.num_hidden_layers)
    cfg = {
        "model_type": "qwen3",
        "vocab_size": int(q.vocab_size),
        "hidden_size": int(q.hidden_size),
        "intermediate_size": int(q.intermediate_size),
        "num_hidden_layers": n,
        "num_attention_heads": int(q.num_attention_heads),
        "num_key_value_heads": int(q.num_key_value_heads),
        "head_dim": int(q.head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(q.max_position_embeddings),
        "initializer_range": float(q.initializer_range),
        "rms_norm_eps": float(q.rms_norm_eps),
        "rope_parameters": rope,
        "rope_theta": float(rope["rope_theta"]),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * n,
        "tie_word_embeddings": False,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(target_config, key, None)
        if value is not None:
            cfg[key] = value
    return cfg


def config_dict(drafter, *, verifier: str, num_speculative_tokens: int, target_config) -> dict:
    """The speculators ``config.json`` of ``drafter`` (module docstring)."""
    tcfg = target_config or drafter.shared.model_config
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": _speculators_version(),
        "transformer_layer_config": layer_config(drafter, tcfg),
        "draft_vocab_size": int(drafter.d2t.numel()),
        "target_hidden_size": int(tcfg.hidden_size),
        "block_size": int(drafter.block_size),
        "aux_hidden_state_layer_ids": [int(i) for i in drafter.feature_layers],
        "mask_token_id": int(drafter.mask_token_id),
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,  # vLLM: dflash_config.causal = false for every layer (module docstring)
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],  # fmt: skip
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(tcfg, "architectures", None)
                                                                       or ["Qwen3ForCausalLM"])},  # fmt: skip
        },
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
    }


def _speculators_version() -> str:
    try:
        return version("speculators")
    except PackageNotFoundError:
        return SPECULATORS_VERSION


def drafter_tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under the loaders' names (module docstring)."""
    sd = drafter.state_dict()
    out = {k: sd[k] for k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    out.update({f"layers.{i}.{n}": sd[f"layers.{i}.{n}"] for i in range(len(drafter.layers)) for n in LAYER_WEIGHTS})
    if drafter.restricted_vocab:
        out["lm_head.weight"] = drafter.draft_head_rows()[0]
        out["d2t"] = sd["d2t"].long()
        out["t2d"] = sd["t2d"].bool()
    return out


def export(drafter, out_dir: Path, *, verifier: str | None = None, num_speculative_tokens: int | None = None,
           target_config=None, **_) -> dict:  # fmt: skip
    """Write ``drafter`` in the speculators DFlash format. Returns the config written.

    Raises:
        ExportError: see :func:`check_drafter`.
    """
    check_drafter(drafter, num_speculative_tokens)
    tensors = drafter_tensors(drafter)
    check_consumed(set(tensors), vllm_consumed_names(len(drafter.layers), drafter.restricted_vocab), ENGINE)
    cfg = config_dict(drafter, verifier=verifier or "", num_speculative_tokens=drafter.block_size - 1,
                      target_config=target_config)  # fmt: skip
    save_tensors(Path(out_dir) / WEIGHTS, tensors, {"format": "pt"})
    write_json(Path(out_dir) / "config.json", cfg)
    return cfg


def load(directory: Path, target):
    """Read a speculators DFlash folder back into drafttrain's :class:`DFlashDrafter`, bound to ``target``.

    Raises:
        ExportError: not a DFlash folder, a variant our network does not compute (anchor sampling, a
            causal or sliding block), sizes that do not fit ``target``, or tensors that do not fill the drafter.
    """
    from drafttrain.data.shards import read_json
    from drafttrain.drafters import SharedTargetModules
    from drafttrain.export.formats import reader_class

    directory = Path(directory)
    cfg = read_json(directory / "config.json", "export the drafter again")
    if cfg.get("speculators_model_type") != MODEL_TYPE:
        raise ExportError(f"{directory}: speculators_model_type {cfg.get('speculators_model_type')!r}, expected {MODEL_TYPE}")
    cls = reader_class("dflash", MODEL_TYPE, directory)
    if cfg.get("sample_from_anchor"):
        raise ExportError(f"{directory}: sample_from_anchor true (the anchor slot drafts too); drafttrain's DFlash "
                          "drafts from the mask slots only")  # fmt: skip
    if not cfg.get("sliding_window_non_causal", True):
        raise ExportError(f"{directory}: sliding_window_non_causal false makes vLLM run every layer causal; "
                          "drafttrain's DFlash block is bidirectional")  # fmt: skip
    lc = cfg["transformer_layer_config"]
    if any(t != "full_attention" for t in lc.get("layer_types") or []) or lc.get("use_sliding_window"):
        raise ExportError(f"{directory}: sliding-window draft layers; drafttrain's DFlash layers attend fully")
    v = int(target.lm_head.weight.shape[0])
    n_vocab = int(cfg["draft_vocab_size"])
    dcfg = {"num_layers": int(lc["num_hidden_layers"]), "block_size": int(cfg["block_size"]),
            "target_layer_ids": [int(i) for i in cfg["aux_hidden_state_layer_ids"]],
            "mask_token_id": int(cfg["mask_token_id"]), "draft_vocab_size": 0 if n_vocab == v else n_vocab,
            "init_from_target_layer": False}  # fmt: skip
    try:
        drafter = cls(dcfg, SharedTargetModules.from_target(target), init_weights=False)
    except ValueError as err:
        raise ExportError(f"{directory}: does not fit this target: {err}") from None
    q = drafter.qwen3_config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size"):  # fmt: skip
        if lc.get(key) is not None and lc[key] != getattr(q, key):
            raise ExportError(f"{directory}: transformer_layer_config.{key} = {lc[key]}, the target gives {getattr(q, key)}")
    if (lc.get("rope_parameters") or {}) != _rope(drafter):
        raise ExportError(f"{directory}: RoPE {lc.get('rope_parameters')} differs from the target's {_rope(drafter)}")
    w = load_tensors(directory / WEIGHTS)
    want = vllm_consumed_names(dcfg["num_layers"], drafter.restricted_vocab)
    if set(w) != want:
        raise ExportError(f"{directory}: tensors {sorted(set(w) - want)} have no place in drafttrain's DFlash drafter; "
                          f"missing {sorted(want - set(w))}")  # fmt: skip
    state = drafter.state_dict()
    for name, t in w.items():
        if name != "lm_head.weight":
            state[name] = t.to(state[name].dtype).reshape(state[name].shape)
    drafter.load_state_dict(state)
    if drafter.restricted_vocab:
        rows = drafter.draft_head_rows()[0]
        if not torch.equal(w["lm_head.weight"].to(device=rows.device, dtype=rows.dtype), rows):
            raise ExportError(f"{directory}: lm_head is not the target's rows of the draft vocabulary; drafttrain's "
                              "DFlash shares the target's head")  # fmt: skip
    return drafter.to(target.device)


def layout(cfg: dict, shapes: dict) -> dict:
    """The sizes ``config.json`` states and the tensor shapes they imply (``lm_head`` only with a restricted draft
    vocabulary: the target's rows)."""
    return fc_layout(cfg, cfg.get("transformer_layer_config"), cfg.get("aux_hidden_state_layer_ids") or [], shapes,
                     head_optional=True, vocab_map=("lm_head.weight", "d2t", "t2d"))  # fmt: skip
