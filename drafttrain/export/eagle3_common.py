"""What the two EAGLE-3 folder formats (vLLM's speculators format, SGLang's) share: the checks that the
drafter computes what the engines compute, the layer-id conventions, and the one-layer Llama config
(for a target of any family: the draft layer is Llama-style whatever the target is, as in the engines).

The network both engines run (vLLM ``model_executor/models/llama_eagle3.py`` 0.32, SGLang
``srt/models/llama_eagle3.py``): g = fc([low; mid; high]) (no bias); layer 0 attends over
cat(input_layernorm(e), hidden_norm(g)) with 2d-wide q/k/v; the residual is g itself (vLLM:
``norm_before_residual`` false; SGLang always); h = residual + attention, h + MLP(post-norm(h)); logits =
lm_head(norm(h)) over the draft vocabulary, scattered to target ids i + d2t[i]; the next step's g is h
before ``norm``. :class:`drafttrain.drafters.eagle3.Eagle3Drafter` computes this with the same names.

Layer ids (docs/design.md, "Serving formats"). drafttrain and vLLM: id i = the hidden state *entering* decoder layer
i (HF ``output_hidden_states[i]``); vLLM captures them while walking the layers in order, so its fc
input is [h_i for i in sorted(set(ids))]: ids must be strictly increasing or vLLM concatenates them in
another order (or fewer of them). SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and
adds 1 (its ids name the *output* of layer i), so it gets ids - 1 there. vLLM reads a top-level
``eagle_aux_hidden_state_layer_ids`` first and only then the nested one *without* adding 1: a folder
with only the nested SGLang ids would load in vLLM one layer off. Our SGLang folder therefore writes
both (top level: vLLM's ids; nested: SGLang's), and each engine reads its own.

Shape letters: d hidden, v target vocab, N draft vocab.
"""

from __future__ import annotations

import torch

from drafttrain.export.common import ExportError

LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")  # fmt: skip
# keys of the target's config that say nothing about the draft layer (or would mislead a loader)
_DROP = ("architectures", "_name_or_path", "transformers_version", "auto_map", "quantization_config", "torch_dtype",
         "dtype", "layer_types", "use_cache", "output_hidden_states", "return_dict", "_attn_implementation_autoset",
         "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions")  # fmt: skip


def check_drafter(drafter, fmt: str) -> str:
    """Refuse a drafter whose network the engines would not reproduce; returns the model type it declares for ``fmt``.

    Raises:
        ExportError: the drafter does not declare ``fmt`` (:func:`drafttrain.export.formats.check_declares`); biases
            the engines do not build; layer ids that break
            :func:`drafttrain.drafters.eagle3.aux_layer_ids_problem` (three strictly increasing ids in
            [0, L - 1]; the message suggests the default ids for the target's depth).
    """
    from drafttrain.export.formats import check_declares

    kind = check_declares(drafter, fmt)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if not isinstance(drafter.layer, LlamaDecoderLayer):
        raise ExportError(f"this drafter's layer is the target's own {type(drafter.layer).__name__} (draft_layer="
                          f"{drafter.config.get('draft_layer')!r}, a checkpoint from before the Llama-style layer), "
                          "not the Llama layer the engines build; retrain with drafter.draft_layer=llama")  # fmt: skip
    if drafter.fc.bias is not None:
        raise ExportError("fc has a bias; vLLM's and SGLang's EAGLE-3 fc have none")
    attn = drafter.layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(attn, name).bias is not None:
            raise ExportError(f"layers.0.self_attn.{name} has a bias; the engines' EAGLE-3 layer (Llama) has none")
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(drafter.layer.mlp, name).bias is not None:
            raise ExportError(f"layers.0.mlp.{name} has a bias; the engines' EAGLE-3 MLP has none")
    from drafttrain.drafters.eagle3 import NUM_AUX, aux_layer_ids_problem, suggested_aux_layer_ids

    ids = [int(i) for i in drafter.aux_layer_ids]
    n_layers = int(drafter.shared.model_config.num_hidden_layers)
    problem = aux_layer_ids_problem(ids, n_layers)  # the same rule training's config check applies
    if problem:
        hint = f" (train with {suggested_aux_layer_ids(n_layers)})" if n_layers >= NUM_AUX else ""
        raise ExportError(f"aux_layer_ids {ids}: {problem}{hint}")
    return kind


def sglang_layer_ids(vllm_ids) -> list[int]:
    """SGLang's ids for the same tensors: it captures id + 1 (ids name a layer's *output*)."""
    return [int(i) - 1 for i in vllm_ids]


def vllm_captured_ids(config: dict, num_target_layers: int) -> list[int]:
    """The HF hidden-state indices vLLM 0.32 feeds the fc, in order, for a draft ``config.json`` as vLLM
    sees it (``GPUModelRunner._get_eagle3_aux_layers_from_config`` + ``_maybe_add_hidden_state``):
    top-level ids, else nested ``eagle_config`` ids (no + 1), else (2, L // 2, L - 3); captured in layer order."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    return sorted(set(int(i) for i in ids))


def sglang_captured_ids(config: dict, num_target_layers: int) -> list[int]:
    """The HF hidden-state indices SGLang feeds the fc (``set_eagle3_layers_to_capture``): nested
    ``eagle_config`` ids + 1, else (2, L // 2, L - 3); captured in layer order."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [int(i) + 1 for i in ids] if ids else [2, num_target_layers // 2, num_target_layers - 3]
    return sorted(set(ids))


def layer_config(target_config) -> dict:
    """The one draft decoder layer as a Llama config dict, for a target of any family
    (:func:`drafttrain.target.families.draft_layer_config`: the target's sizes, SiLU, no biases, 1 layer, untied),
    plus the bos/eos/pad ids the engines' tokenizer-side code reads."""
    from drafttrain.target import families

    mc = families.draft_layer_config(target_config)
    rope = mc["rope_parameters"]
    mc["rope_theta"] = rope.get("rope_theta", 10000.0)  # readers of transformers 4 (SGLang) take these two
    mc["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else dict(rope)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(target_config, key, None)
        if value is not None:
            mc[key] = value
    return mc


def drafter_tensors(drafter, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The drafter's weights under the engines' names: the tensors it declares (``serving_tensor_names``: fc,
    its variant's norms, norm, lm_head), ``{layer_prefix}.*``, and the
    draft-vocabulary buffers d2t (offsets) / t2d (bool) when the vocabulary is restricted (with N = v,
    vLLM has no ``draft_id_to_target_id`` parameter and would refuse a d2t)."""
    sd = drafter.state_dict()
    out = {n: sd[n] for n in drafter.serving_tensor_names()}  # the drafter's own declaration
    out.update({f"{layer_prefix}.{n}": sd[f"layers.0.{n}"] for n in LAYER_WEIGHTS})
    if drafter.restricted_vocab:
        out["d2t"] = sd["d2t"].long()
        out["t2d"] = sd["t2d"].bool()
    if "mask_hidden" in sd:
        out["mask_hidden"] = sd["mask_hidden"].reshape(-1)
    return out


def build_drafter(directory, target, *, cls, aux_ids, draft_vocab_size: int, depth: int, layer_prefix: str,
                  weights: dict, extra: dict | None = None):  # fmt: skip
    """A drafter of class ``cls`` (the one declaring the folder's format and model type:
    :func:`drafttrain.export.formats.reader_class`) holding an exported folder's weights (for the round trips).

    Raises:
        ExportError: the folder's tensors do not fill the drafter exactly.
    """
    from drafttrain.drafters import SharedTargetModules

    v = target.lm_head.weight.shape[0]
    cfg = {"aux_layer_ids": list(aux_ids), "draft_vocab_size": 0 if draft_vocab_size == v else draft_vocab_size,
           "draft_depth": int(depth), **(extra or {})}  # fmt: skip
    drafter = cls({k: val for k, val in cfg.items() if k in cls.defaults}, SharedTargetModules.from_target(target),
                  init_weights=False)  # fmt: skip
    state = {k: val for k, val in drafter.state_dict().items()}
    for name, t in weights.items():
        key = name.replace(f"{layer_prefix}.", "layers.0.", 1) if name.startswith(layer_prefix + ".") else name
        if key not in state:
            raise ExportError(f"{directory}: tensor {name} has no place in drafttrain's {cls.name} drafter")
        state[key] = t.reshape(state[key].shape)
    missing = sorted(k for k in drafter.state_dict() if k not in {
        n.replace(f"{layer_prefix}.", "layers.0.", 1) for n in weights} and k not in ("d2t", "t2d"))  # fmt: skip
    if missing:
        raise ExportError(f"{directory}: no tensors for {missing}")
    drafter.load_state_dict(state)
    return drafter
