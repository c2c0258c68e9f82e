"""Tiny random targets of any transformers causal-LM class, built from the class's own config defaults.

The sweep (:mod:`drafttrain.sweep`, ``tests/target/test_sweep.py``) builds one of every decoder-only
text causal LM transformers exports. No hub access: each target comes from its config class's defaults with
every size shrunk (:func:`shrink_config`), so the structure the class defines (layer kinds and their pattern,
MoE, MLA, recurrent layers, norms, rotary variants) is kept and only the sizes change.

Shrinking is by rule, not by family: a size attribute the config has (:data:`SIZES`) gets the tiny value; a
per-layer list (``layer_types``, ``layers_block_type``, ``mlp_layer_types``, ...: any list as long as the
layer count) is cut to :data:`NUM_LAYERS` entries that keep every kind the full list has (the last layer
keeps the full model's last kind); head counts and head sizes are made consistent with the tiny width.

Shape letters: d hidden.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

log = logging.getLogger(__name__)

#: decoder layers of a tiny target (enough for a hybrid pattern to keep each of its layer kinds)
NUM_LAYERS = 4
D = 64  # hidden size

#: tiny values of the size attributes transformers configs use (only those a config has are set)
SIZES: dict[str, Any] = {
    # width, heads
    "hidden_size": D, "n_embd": D, "d_model": D, "n_embed": D, "dim": D, "embed_dim": D, "emb_dim": D,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "attention_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "attention_head_dim": 16, "head_size": 16, "qk_head_dim": None,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128, "d_ff": 128,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": None,
    "attention_hidden_size": None, "global_attn_every_n_layers": None,
    # MoE
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "shared_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "expert_intermediate_size": 32, "moe_ffn_hidden_size": 32,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "n_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2, "topk": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    # MLA, sparse-attention indexer
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2,
    # linear attention, state-space, short convolutions
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_num_heads": 8,
    "mamba_head_dim": 16, "n_mamba_heads": 8, "mamba_headdim": 16, "ssm_state_size": 16, "state_size": 16,
    "d_state": 16, "n_groups": 1, "time_step_rank": 8, "mamba_chunk_size": 64, "chunk_size": 64,
    "lru_width": D, "block_width": D,
    # positions
    "max_position_embeddings": 4096, "n_positions": 4096, "max_seq_len": 4096, "seq_length": 4096,
    "n_ctx": 4096, "max_sequence_length": 4096, "rotary_dim": 8, "mamba_d_ssm": 128,
}  # fmt: skip

#: size attributes set even where the class's default is None (its default does not build otherwise)
FILL_NONE = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "head_dim", "num_key_value_heads")

#: config classes whose own defaults do not build a model (a value real checkpoints always set): what they get
DEFAULTS_THAT_DO_NOT_BUILD: dict[str, dict[str, Any]] = {
    "Lfm2MoeConfig": {"layer_types": ["conv", "conv", "full_attention", "conv"], "num_dense_layers": 1},
    "Lfm2Config": {"layer_types": ["conv", "conv", "full_attention", "conv"]},  # default: every layer attention
}
#: layer kinds without attention (a tiny pattern of only these gets one attention layer last: transformers' own
#: cache then has an attention layer to read the sequence length from, as every released hybrid has)
RECURRENT_KINDS = ("linear_attention", "mamba", "conv", "recurrent", "rwkv", "ssm")

#: per-layer list attributes cut to the tiny layer count (any other list as long as the layer count is cut too)
LAYER_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types", "block_types", "attention_layer_types",
               "sliding_window_pattern_list", "no_rope_layers", "kv_sharing_modes")  # fmt: skip
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers")


def _keep_kinds(values: list, n: int) -> list:
    """``n`` entries of a per-layer list that keep every distinct kind it has, in its order, the last entry
    staying the full list's last (e.g. [lin, lin, lin, full] * 8 -> [lin, lin, lin, full])."""
    if len(values) <= n:
        return list(values)
    out = list(values[: n - 1]) + [values[-1]]
    kinds = list(dict.fromkeys(map(repr, values)))
    for kind in kinds:
        if kind in map(repr, out):
            continue
        value = next(v for v in values if repr(v) == kind)
        counts = {}
        for v in out:
            counts[repr(v)] = counts.get(repr(v), 0) + 1
        j = next((j for j in range(n - 2, -1, -1) if counts[repr(out[j])] > 1), None)
        if j is None:
            break  # more kinds than layers
        out[j] = value
    return out


def shrink_config(config_cls, tokenizer=None, num_layers: int = NUM_LAYERS, **overrides):
    """A tiny config of ``config_cls`` (a transformers ``PretrainedConfig`` subclass) keeping its structure.

    Args:
        config_cls: the config class (its defaults give the structure).
        tokenizer: gives the vocabulary size and the special token ids (None: the class's vocabulary).
        num_layers: decoder layers.
        **overrides: set last (after the rules).

    Returns:
        a deep copy of the built config.

    Raises:
        whatever the config class raises for values it refuses (the sweep records it as "cannot build").
    """
    base = config_cls()
    d = base.to_dict()
    kw: dict[str, Any] = {}
    full_layers = next((int(d[k]) for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    for key, value in SIZES.items():
        if key not in d or value is None or isinstance(d[key], bool):
            continue
        if isinstance(d[key], (int, float)) or (d[key] is None and key in FILL_NONE):
            kw[key] = value
        elif isinstance(d[key], list) and d[key] and all(isinstance(v, int) for v in d[key]):  # one size per layer
            kw[key] = [value] * num_layers
    if "qk_head_dim" in d and "qk_nope_head_dim" in kw:  # MLA: the query/key head = nope + rope
        kw["qk_head_dim"] = kw["qk_nope_head_dim"] + kw.get("qk_rope_head_dim", 0)
    if "qk_rope_head_dim" in kw and "head_dim" in d:  # MLA configs name the rotary part head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if d.get("kv_lora_rank") and "num_key_value_heads" in kw:  # MLA: one key/value head per query head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if "expand" in d and "num_heads" in kw and "head_dim" in kw:  # Mamba-2: heads x head size = expand x d
        kw["num_heads"] = int(d["expand"]) * D // kw["head_dim"]
    for key, value in (("attn_layer_period", 2), ("attn_layer_offset", 1), ("expert_layer_period", 2),
                       ("expert_layer_offset", 1)):  # fmt: skip
        if isinstance(d.get(key), int):
            kw[key] = value
    if "attn_layer_indices" in d:
        kw["attn_layer_indices"] = [num_layers - 1]
    if "attention_hidden_size" in d and d["attention_hidden_size"]:  # Zamba: attention over cat(h, embeddings)
        kw["attention_hidden_size"] = 2 * D
    for key in LAYER_COUNTS:
        if isinstance(d.get(key), int):
            kw[key] = num_layers
    for key, value in d.items():
        if isinstance(value, list) and value and full_layers and len(value) == full_layers or key in LAYER_LISTS:
            if isinstance(value, list) and value:
                kw[key] = _keep_kinds(value, num_layers)
    for key in ("layer_types", "layers_block_type"):
        kinds = kw.get(key)
        if isinstance(kinds, list) and kinds and all(isinstance(k, str) and k in RECURRENT_KINDS for k in kinds):
            kw[key] = kinds[:-1] + ["full_attention" if "full_attention" in str(kinds) or key == "layer_types"
                                    else "attention"]  # fmt: skip
    if isinstance(d.get("num_kv_shared_layers"), int) and d["num_kv_shared_layers"] > 0:  # KV sharing: the shared
        kw["num_kv_shared_layers"] = num_layers // 2  # half reads the first half's caches, every kind in each half
        kinds = list(dict.fromkeys(d.get("layer_types") or []))
        if kinds:
            kw["layer_types"] = (kinds * num_layers)[:num_layers]
    if isinstance(d.get("hybrid_layer_ids"), list):  # Zamba-2: shared attention blocks where the pattern says hybrid
        kinds = kw.get("layers_block_type") or []
        kw["hybrid_layer_ids"] = [i for i, k in enumerate(kinds) if k == "hybrid"]
    if isinstance(d.get("full_attn_idxs"), list):
        kw["full_attn_idxs"] = [num_layers - 1]
    if tokenizer is not None:
        kw.update(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    kw["tie_word_embeddings"] = d.get("tie_word_embeddings", True)
    kw.update(DEFAULTS_THAT_DO_NOT_BUILD.get(config_cls.__name__, {}))
    kw.update(overrides)
    try:
        cfg = config_cls(**kw)
    except Exception:  # a derived value the class recomputes from what it was given: set attributes instead
        cfg = copy.deepcopy(base)
        for k, v in kw.items():
            setattr(cfg, k, v)
    return copy.deepcopy(cfg)


#: parameters a tiny target may have at most (the SmolLM2 vocabulary alone is 3.1M at d = 64)
MAX_PARAMS = 40_000_000


class TinyTooLarge(ValueError):
    """The shrunk config still describes a large model (a size the rules do not know)."""


def build(model_cls_name: str, tokenizer=None, seed: int = 0, dtype=None, attn_implementation: str = "sdpa", vocab_size: int | None = None, **overrides):
    """A tiny random model of the transformers class ``model_cls_name`` (e.g. ``"Qwen3_5ForCausalLM"``).

    Returns:
        the model (eval mode; ``config.architectures`` set to the class name).

    Raises:
        AttributeError: transformers has no such class; anything the config or model class raises.
    """
    import torch
    import transformers

    model_cls = getattr(transformers, model_cls_name)
    config_cls = model_cls.config_class  # the config the class declares (a text config under a multimodal one)
    if vocab_size is not None:
        overrides = {"vocab_size": vocab_size, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
                     **overrides}  # fmt: skip
    cfg = shrink_config(config_cls, tokenizer, **overrides)
    cfg.architectures = [model_cls_name]
    with torch.device("meta"):  # count first: a size the rules did not shrink must not allocate gigabytes
        try:
            probe = model_cls._from_config(copy.deepcopy(cfg), attn_implementation=attn_implementation)
        except (ValueError, ImportError):
            probe = model_cls._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    n = sum(p.numel() for p in probe.parameters())
    del probe
    if n > MAX_PARAMS:
        raise TinyTooLarge(f"{model_cls_name}'s tiny config still has {n / 1e6:.0f}M parameters (a size attribute "
                           f"the shrinking rules do not know)")  # fmt: skip
    torch.manual_seed(seed)
    try:
        model = model_cls._from_config(cfg, attn_implementation=attn_implementation)
    except (ValueError, ImportError):
        model = model_cls._from_config(cfg, attn_implementation="eager")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
