"""Target model families: the one place that says what each family needs from drafttrain.

A target is any Hugging Face causal LM driven through its public forward. Families differ in ways the
drafters, the engine and the exporters must know about; this module names them once, per family, and
every consumer asks here instead of testing ``model_type`` itself:

=============  =========================================================================================
trait          meaning (who reads it)
=============  =========================================================================================
rotary_call    ``"plain"``: ``rotary_emb(x, position_ids)``; ``"layer_type"``: the rotary module takes the
               layer's attention type too (Gemma3: local and global RoPE bases). :func:`rotary_embeddings`.
embed_scale    the embedding module multiplies by sqrt(d) itself (Gemma). The serving engines' EAGLE-3
               draft models read the *raw* embedding rows, so EAGLE-3 drafters use :func:`raw_embedding`.
norm_offset    the RMSNorm computes ``x * (offset + w)`` (Gemma: 1). Copying a norm into a Llama-style
               layer converts through :func:`effective_norm_weight` (a probe, so unknown families work too).
qk_norm        RMSNorm on queries and keys (Qwen3, Gemma3): the target's own layer computes it; a
               Llama-style draft layer does not have it.
attention_bias biases on q/k/v (Qwen2, gpt-oss).
fused          fused ``qkv_proj`` / ``gate_up_proj`` (Phi3): :func:`split_projections` unfuses them.
moe            mixture-of-experts MLP (Qwen3-MoE, gpt-oss): no dense MLP to start a draft layer from.
sliding        some layers attend a sliding window (Gemma3, Mistral, gpt-oss). The engine's attention
               applies the window only through its masks, which have none: it runs such a target
               exactly only while every sequence fits in the window, and refuses past it
               (:func:`drafttrain.verify.cache.ragged_attention` raises) rather than decode wrongly.
softcap        attention logit soft-capping (Gemma2): not in the engine's attention -> refused.
sinks          learned attention sinks (gpt-oss): not in the engine's attention -> refused.
=============  =========================================================================================

A family with ``engine_refusal`` set cannot be decoded exactly by drafttrain's engine: config validation
(:func:`check_engine_support`) refuses it with the family named, before any model loads, for every
entry point that decodes (training's speculative evaluation, self-distillation through the engine,
``scripts.evaluate``). Training a drafter on such a target still works with HF generation.

Unknown ``model_type`` values get :data:`GENERIC` traits read off the config (sliding window, soft-
capping), so a user's Llama-like family works without an entry here.

Tiny random targets of every family (:func:`tiny_config`, ``target=tiny target.family=qwen3``) are what
the tests train and decode: real transformers classes, 2 layers, d = 64, the SmolLM2 tokenizer.

Shape letters: b batch, s sequence, d hidden.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    """What one target family needs (module docstring: the traits and who reads them)."""

    name: str
    model_types: tuple[str, ...]
    config_class: str  # transformers config class of a tiny target
    rotary_call: str = "plain"  # plain | layer_type
    embed_scale: bool = False
    norm_offset: float = 0.0
    qk_norm: bool = False
    attention_bias: bool = False
    fused: bool = False
    moe: bool = False
    sliding: bool = False
    softcap: bool = False
    sinks: bool = False
    tiny: dict[str, Any] = field(default_factory=dict)  # extra config keys of the tiny target

    @property
    def engine_refusal(self) -> str | None:
        """Why drafttrain's engine cannot decode this family exactly (None: it can)."""
        if self.sinks:
            return "its attention sinks (a learned per-head logit in every softmax) are not in the engine's attention"
        if self.softcap:
            return "its attention logit soft-capping is not in the engine's attention"
        return None


_TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
             "norm_topk_prob": True}  # fmt: skip

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("llama",), "LlamaConfig"),
        Family("qwen2", ("qwen2",), "Qwen2Config", attention_bias=True),
        Family("qwen3", ("qwen3",), "Qwen3Config", qk_norm=True),
        Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeConfig", qk_norm=True, moe=True, tiny=_TINY_MOE),
        Family("mistral", ("mistral",), "MistralConfig", sliding=True, tiny={"sliding_window": 4096}),
        Family("gemma3", ("gemma3_text", "gemma3"), "Gemma3TextConfig", rotary_call="layer_type", embed_scale=True,
               norm_offset=1.0, qk_norm=True, sliding=True,
               tiny={"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"],
                     "query_pre_attn_scalar": 16}),  # fmt: skip
        Family("phi3", ("phi3",), "Phi3Config", fused=True, tiny={"pad_token_id": None}),
        Family("gpt_oss", ("gpt_oss",), "GptOssConfig", attention_bias=True, moe=True, sliding=True, sinks=True,
               tiny={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4096,
                     "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": None}),  # fmt: skip
        Family("gemma2", ("gemma2",), "Gemma2Config", embed_scale=True, norm_offset=1.0, sliding=True, softcap=True,
               tiny={"sliding_window": 4096, "query_pre_attn_scalar": 16}),  # fmt: skip
    )
}
#: the families the tests train and decode (every recipe x every family)
TEST_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "phi3", "gpt_oss")
GENERIC = Family("generic", (), "")


def family_of(config) -> Family:
    """The :class:`Family` of a target config (a transformers ``PretrainedConfig``, or its ``to_dict()``).

    An unknown ``model_type`` gets :data:`GENERIC` traits read from the config: sliding window, soft-capping.
    """
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    mt = str(get("model_type", "") or "")
    for fam in FAMILIES.values():
        if mt in fam.model_types:
            return fam
    return Family(f"generic:{mt or 'unknown'}", (mt,), "", sliding=bool(get("sliding_window", None)),
                  softcap=bool(get("attn_logit_softcapping", None)))  # fmt: skip


def by_name(name: str) -> Family:
    """The family called ``name`` (a key of :data:`FAMILIES`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown target family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def check_engine_support(config, where: str = "drafttrain's engine") -> None:
    """Refuse a target family the engine cannot decode exactly.

    Raises:
        ValueError: the family has attention sinks or soft-capping (message names the family and why).
    """
    fam = family_of(config)
    why = fam.engine_refusal
    if why:
        raise ValueError(f"target family {fam.name!r} cannot be decoded by {where}: {why}; it would decode "
                         f"differently from the target's own forward, so it is refused (train with "
                         f"data.generation.backend=hf and trainer.spec_eval.enabled=false)")  # fmt: skip


def attention_window(config) -> int | None:
    """The smallest sliding window any layer of the target attends (tokens), None where every layer attends
    the whole context. transformers applies a window through the masks it builds; the engine passes its own
    masks, so it runs such a target exactly only while every sequence (prompt + new tokens + drafts) fits.
    """
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    window = get("sliding_window", None)
    if not window or get("use_sliding_window", True) is False:
        return None
    types = get("layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


# ------------------------------------------------------------------------------------------------ tiny targets


def tiny_config(family: str, vocab_size: int, *, hidden_size: int = 64, intermediate_size: int = 128,
                num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                tokenizer=None, attn_implementation: str = "sdpa"):  # fmt: skip
    """A tiny random target's config of ``family`` (transformers' own config class; no hub access).

    head_dim = hidden_size // num_attention_heads everywhere (Qwen3, Gemma3 and Mistral default to 128).

    Raises:
        ValueError: an unknown family, or one this transformers does not have.
    """
    import transformers

    fam = by_name(family)
    cls = getattr(transformers, fam.config_class, None)
    if cls is None:
        raise ValueError(f"target family {family!r} needs transformers.{fam.config_class}, which transformers "
                         f"{transformers.__version__} does not have")  # fmt: skip
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
              num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
              num_key_value_heads=num_key_value_heads, head_dim=hidden_size // num_attention_heads,
              max_position_embeddings=4096, tie_word_embeddings=True,
              eos_token_id=getattr(tokenizer, "eos_token_id", None), pad_token_id=getattr(tokenizer, "pad_token_id", None),
              bos_token_id=getattr(tokenizer, "bos_token_id", None))  # fmt: skip
    extra = dict(fam.tiny)
    if extra.get("layer_types"):
        extra["layer_types"] = (extra["layer_types"] * num_hidden_layers)[:num_hidden_layers]
    if "rope_parameters" in extra and extra["rope_parameters"] is None:  # gpt-oss: plain RoPE, no YaRN
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    if "pad_token_id" in extra and extra["pad_token_id"] is None:
        extra.pop("pad_token_id")
    kw.update(extra)
    cfg = cls(**kw)
    # sinks and soft-capping: transformers runs them with eager attention only
    cfg._attn_implementation = "eager" if (fam.sinks or fam.softcap) else attn_implementation
    return copy.deepcopy(cfg)


# ------------------------------------------------------------------------------------------------ drafters' helpers


@functools.lru_cache(maxsize=None)
def _takes_layer_type(rotary_cls: type) -> bool:
    """Whether a rotary module class's forward takes ``layer_type`` (read once per class: drafting calls it every step)."""
    import inspect

    return "layer_type" in inspect.signature(rotary_cls.forward).parameters


def rotary_embeddings(rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer: nn.Module | None = None):
    """(cos, sin) of ``rotary`` for inputs x [b, s, .] at positions [b, s], however its family calls it.

    Gemma3's rotary module takes a layer type too: ``layer.attention_type`` where the layer has one, else
    ``full_attention`` (a drafter's one layer attends its whole context: the global RoPE base); every
    other family's takes (x, position_ids).
    """
    if _takes_layer_type(type(rotary)):
        layer_type = getattr(layer, "attention_type", None) or "full_attention"
        return rotary(x, position_ids, layer_type=layer_type)
    return rotary(x, position_ids)


def raw_embedding(embed: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ``ids`` without a family's scale (Gemma multiplies by sqrt(d) inside its
    module): what the serving engines' EAGLE-3 draft models read. [b, s] int64 -> [b, s, d]."""
    return torch.nn.functional.embedding(ids, embed.weight)


@torch.no_grad()
def effective_norm_weight(norm: nn.Module, hidden_size: int) -> torch.Tensor:
    """The per-channel scale an RMSNorm applies, as a Llama ``weight`` (x * w): probed with a vector of ones
    (RMS 1), so Gemma's ``x * (1 + w)`` and any other parameterisation come out right. [d] float32."""
    w = next(norm.parameters())
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 0.0)
    out = norm(torch.ones(1, hidden_size, dtype=torch.float32, device=w.device).to(w.dtype)).float()[0]
    return out * (1.0 + eps) ** 0.5


def split_projections(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A target decoder layer's attention and dense-MLP weights under Llama's names, unfusing Phi3's
    ``qkv_proj`` / ``gate_up_proj``. MoE layers have no dense MLP (its names are absent); biases are left out.

    Returns:
        {"q_proj", "k_proj", "v_proj", "o_proj"[, "gate_proj", "up_proj", "down_proj"]} -> weight tensors.
    """
    attn, mlp = layer.self_attn, layer.mlp
    out: dict[str, torch.Tensor] = {}
    if hasattr(attn, "qkv_proj"):
        hd = attn.head_dim
        nq = attn.config.num_attention_heads * hd
        nkv = attn.config.num_key_value_heads * hd
        w = attn.qkv_proj.weight
        out.update(q_proj=w[:nq], k_proj=w[nq : nq + nkv], v_proj=w[nq + nkv : nq + 2 * nkv])
    else:
        out.update({n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj")})
    out["o_proj"] = attn.o_proj.weight
    if hasattr(mlp, "gate_up_proj") and isinstance(mlp.gate_up_proj, nn.Linear):
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
        out.update(gate_proj=gate, up_proj=up, down_proj=mlp.down_proj.weight)
    elif all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        out.update({n: getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")})
    return out


@torch.no_grad()
def llama_init_weights(src: nn.Module, target_config, hidden_size: int) -> dict[str, torch.Tensor]:
    """A target decoder layer's weights where they carry over into a Llama-style layer (x * w norms, SiLU MLP,
    no biases): q/k/v/o projections (:func:`split_projections`), the dense MLP only when the target's is SiLU
    (not an MoE layer, nor Gemma's GELU MLP), and the effective scales of its attention-input norm
    (``input_norm``) and MLP-input norm (``mlp_norm``: Gemma's ``pre_feedforward_layernorm``, else
    ``post_attention_layernorm``) as Llama weights [d] (:func:`effective_norm_weight`)."""
    w = split_projections(src)
    act = getattr(target_config, "hidden_act", None) or getattr(target_config, "hidden_activation", None)
    if act != "silu":
        for name in ("gate_proj", "up_proj", "down_proj"):
            w.pop(name, None)
    mlp_norm = getattr(src, "pre_feedforward_layernorm", None) or src.post_attention_layernorm
    w["input_norm"] = effective_norm_weight(src.input_layernorm, hidden_size)
    w["mlp_norm"] = effective_norm_weight(mlp_norm, hidden_size)
    return w


def draft_layer_config(target_config) -> dict[str, Any]:
    """The Llama config (a dict) of the one EAGLE-3 draft decoder layer the serving engines build for a target
    of any family: sizes from the target, SiLU MLP, no biases, untied, one layer.

    What is taken from the target: vocab_size, hidden_size, num_attention_heads, num_key_value_heads,
    head_dim, intermediate_size (the dense one; 3d for an MoE target without one), rms_norm_eps,
    max_position_embeddings, initializer_range, and RoPE (``rope_parameters``; a per-layer-type dict, as
    Gemma3's, gives its ``full_attention`` entry: the draft layer attends the whole context). hidden_act is
    always ``silu`` (vLLM's Llama MLP supports nothing else). The same recipe the peers use (speculators,
    SpecForge) to draft for Qwen, Gemma and gpt-oss targets with one Llama layer.
    """
    get = target_config.get if isinstance(target_config, dict) else lambda k, d=None: getattr(target_config, k, d)
    d = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim", None) or d // heads)
    inter = get("intermediate_size", None) or 3 * d  # an MoE config without a dense size: 3d, as speculators
    rope = copy.deepcopy(get("rope_parameters", None)) or {"rope_type": "default",
                                                            "rope_theta": float(get("rope_theta", 10000.0))}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    rope = {k: v for k, v in rope.items() if k not in ("type", "mrope_interleaved")}
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    return {
        "model_type": "llama",
        "vocab_size": int(get("vocab_size")),
        "hidden_size": d,
        "intermediate_size": int(inter),
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("num_key_value_heads", None) or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("max_position_embeddings", 4096)),
        "initializer_range": float(get("initializer_range", 0.02) or 0.02),
        "rms_norm_eps": float(get("rms_norm_eps", 1e-6) or 1e-6),
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def llama_layer_config(target_config, attn_implementation: str = "sdpa"):
    """:func:`draft_layer_config` as a transformers ``LlamaConfig`` (attention: sdpa or eager, float 4D masks)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in draft_layer_config(target_config).items() if k != "model_type"})
    cfg._attn_implementation = attn_implementation if attn_implementation in ("sdpa", "eager") else "sdpa"
    return cfg
