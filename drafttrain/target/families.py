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
mla            multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, Kimi): keys and values of other head
               sizes than ``head_dim``, which the engine's KV cache holds -> refused (:func:`mla_attention`).
=============  =========================================================================================

Traits an unknown family gets from its config, one rule each, public config attributes only:
``sliding`` = ``sliding_window`` set; ``softcap`` = ``attn_logit_softcapping`` set; ``mla`` =
:func:`mla_attention`. Two more rules apply to every family: :func:`logit_multiplier` (Granite's
``logits_scaling``, Cohere's ``logit_scale``: what the model multiplies its LM head's logits by;
:class:`drafttrain.target.Target` folds it into the head) and the decoder-layer layout
:func:`llama_init_weights` reads (pre-norms, a dense SiLU MLP, q/k/v/o of the draft layer's shapes;
what does not carry over falls back to the Llama-style layer's own initialisation, with the reason logged).

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
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from drafttrain.cliconfig import FatalError

log = logging.getLogger(__name__)


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
    mla: bool = False
    tiny: dict[str, Any] = field(default_factory=dict)  # extra config keys of the tiny target

    @property
    def engine_refusal(self) -> str | None:
        """Why drafttrain's engine cannot decode this family exactly (None: it can). Attention sinks and logit
        soft-capping are in the engine's attention (:func:`drafttrain.verify.cache.exact_attention`): no family
        listed here is refused; the pre-flight check (:mod:`drafttrain.preflight`) decides for a loaded target."""
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
    get = _getter(config)
    mt = str(get("model_type", "") or "")
    for fam in FAMILIES.values():
        if mt in fam.model_types:
            return fam
    return Family(f"generic:{mt or 'unknown'}", (mt,), "", sliding=bool(get("sliding_window", None)),
                  softcap=bool(get("attn_logit_softcapping", None)), mla=mla_attention(config) is not None)  # fmt: skip


def _getter(config):
    """``get(key, default)`` of a config or its ``to_dict()``; a per-layer attribute (a heterogeneous config's
    ``head_dim``, Gemma-4) reads as absent rather than raising."""
    if isinstance(config, dict):
        return config.get

    def get(k, d=None):
        try:
            return getattr(config, k, d)
        except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and kin
            return d

    return get


def mla_attention(config) -> str | None:
    """What shows a config's attention is multi-head latent attention (MLA), None where it is not: the rule is
    ``kv_lora_rank`` or ``q_lora_rank`` set, or a ``v_head_dim`` other than the query/key head size
    (``qk_head_dim``, else ``qk_nope_head_dim + qk_rope_head_dim``, else ``head_dim``). Returns the key that
    shows it, e.g. ``"kv_lora_rank"`` (a transformers config or its ``to_dict()``)."""
    get = _getter(config)
    for key in ("kv_lora_rank", "q_lora_rank"):
        if get(key, None):
            return key
    v = get("v_head_dim", None)
    qk = get("qk_head_dim", None) or ((get("qk_nope_head_dim", None) or 0) + (get("qk_rope_head_dim", None) or 0))
    qk = qk or get("head_dim", None)
    if v and qk and int(v) != int(qk):
        return f"v_head_dim {v} != query/key head size {qk}"
    return None


def final_logit_softcap(config) -> float | None:
    """The cap c of a model that soft-caps its final logits, ``c * tanh(logits / c)`` (Gemma-2, VaultGemma,
    NanoChat, Beam: ``final_logit_softcapping``); None where it does not (a transformers config or its ``to_dict()``)."""
    cap = _getter(config)("final_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else None


def architecture_name(config) -> str:
    """The model's name as a user knows it: ``architectures[0]`` without ``ForCausalLM`` (``DeepseekV3``),
    else ``model_type``."""
    get = _getter(config)
    arch = (get("architectures", None) or [None])[0]
    if arch:
        return str(arch).removesuffix("ForCausalLM")
    return str(get("model_type", None) or "this target")


def logit_multiplier(config) -> float:
    """What the model multiplies its LM head's logits by in its own forward: 1 / ``logits_scaling`` (Granite,
    which divides) or ``logit_scale`` (Cohere, Cohere2, which multiply); 1.0 for every other config.

    Raises:
        ValueError: a ``logits_scaling`` of 0 (the model's own forward would divide by zero).
    """
    get = _getter(config)
    scaling = get("logits_scaling", None)
    if scaling is not None:
        if float(scaling) == 0.0:
            raise ValueError("the target's config has logits_scaling = 0: its logits would be divided by zero")
        return 1.0 / float(scaling)
    scale = get("logit_scale", None)
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else 1.0


def by_name(name: str) -> Family:
    """The family called ``name`` (a key of :data:`FAMILIES`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown target family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def check_engine_support(config, where: str = "drafttrain's engine") -> None:
    """Refuse a target the engine cannot decode exactly (a transformers config or its ``to_dict()``).

    MLA attention is not refused: the engine's cache holds each layer's keys and values in the sizes the model
    writes them (:func:`cache_layout`; DeepSeek's latent keys and rotary keys included).

    Raises:
        ValueError: the family has attention sinks or soft-capping; the message names the family and why.
    """
    howto = "train with data.generation.backend=hf and trainer.spec_eval.num_prompts=0"
    fam = family_of(config)
    why = fam.engine_refusal
    if why:
        raise ValueError(f"target family {fam.name!r} cannot be decoded by {where}: {why}; it would decode "
                         f"differently from the target's own forward, so it is refused ({howto})")  # fmt: skip


def attention_window(config) -> int | None:
    """The smallest sliding window any layer of the target attends (tokens), None where every layer attends
    the whole context. transformers applies a window through the masks it builds; the engine passes its own
    masks, so it runs such a target exactly only while every sequence (prompt + new tokens + drafts) fits.
    Chunked attention (Llama-4's ``attention_chunk_size``: tokens attend within their chunk) counts as a
    window of the chunk size: a sequence that fits in one chunk is attended exactly.
    """
    get = _getter(config)
    types = get("layer_types", None)
    windows = []
    window = get("sliding_window", None)
    if window and get("use_sliding_window", True) is not False and (types is None or "sliding_attention" in types):
        windows.append(int(window))
    chunk = get("attention_chunk_size", None)  # Llama-4: attention within chunks of this many tokens
    if chunk and (types is None or "chunked_attention" in types):
        windows.append(int(chunk))  # exact while the whole sequence is one chunk: the same bound as a window
    return min(windows) if windows else None


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
    w = next(norm.parameters(), None)  # a norm without parameters (OLMo's LayerNorm): probed in float32 on the CPU
    dev, dt = (w.device, w.dtype) if w is not None else (torch.device("cpu"), torch.float32)
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 0.0)
    out = norm(torch.ones(1, hidden_size, dtype=torch.float32, device=dev).to(dt)).float()[0]
    return out * (1.0 + eps) ** 0.5


def _dense_mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's MLP module: ``mlp``, or ``feed_forward`` (Llama-4); None where it has neither."""
    return getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)


def split_projections(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A target decoder layer's attention and dense-MLP weights under Llama's names, unfusing Phi3's
    ``qkv_proj`` / ``gate_up_proj``; the MLP is ``mlp`` or ``feed_forward`` (Llama-4). Names a layer does not
    have are absent: the MLP ones for an MoE layer (no dense MLP), the attention ones for attention without
    q/k/v/o linears (MLA's low-rank projections). Biases are left out.

    Returns:
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} (those present) -> weights.
    """
    attn, mlp = getattr(layer, "self_attn", None), _dense_mlp(layer)
    out: dict[str, torch.Tensor] = {}
    if isinstance(getattr(attn, "qkv_proj", None), nn.Linear):
        hd = attn.head_dim
        nq = attn.config.num_attention_heads * hd
        nkv = attn.config.num_key_value_heads * hd
        w = attn.qkv_proj.weight
        out.update(q_proj=w[:nq], k_proj=w[nq : nq + nkv], v_proj=w[nq + nkv : nq + 2 * nkv])
    elif all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj")):
        out.update({n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj")})
    if out and isinstance(getattr(attn, "o_proj", None), nn.Linear):
        out["o_proj"] = attn.o_proj.weight
    else:
        out.clear()  # q/k/v without o (or none): nothing of the attention carries over
    if isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear) and isinstance(getattr(mlp, "down_proj", None), nn.Linear):
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
        out.update(gate_proj=gate, up_proj=up, down_proj=mlp.down_proj.weight)
    elif all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        out.update({n: getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")})
    return out


@torch.no_grad()
def is_rms_norm(norm: nn.Module, hidden_size: int) -> bool:
    """Whether ``norm`` computes an RMSNorm, ``x / rms(x) * w`` for some per-channel w (any parameterisation:
    Gemma's ``1 + w`` too), probed on two fixed vectors against :func:`effective_norm_weight`. False for a
    LayerNorm (it subtracts the mean: Cohere's), whose weights cannot become a Llama RMSNorm's."""
    p = next(norm.parameters(), None)
    if p is None:
        return False
    w = effective_norm_weight(norm, hidden_size)
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 0.0)
    x = torch.randn(2, hidden_size, generator=torch.Generator().manual_seed(0), device="cpu") + 0.5  # a LayerNorm removes the mean
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.cpu()
    got = norm(x.to(p.device, p.dtype)).float().cpu()
    tol = 1e-4 if p.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, atol=tol * float(want.abs().max()), rtol=tol))


@torch.no_grad()
def llama_init_weights(src: nn.Module, target_config, hidden_size: int) -> dict[str, torch.Tensor]:
    """A target decoder layer's weights where they carry over into a Llama-style layer (x * w norms, SiLU MLP,
    no biases): q/k/v/o projections (:func:`split_projections`), the dense MLP only when the target's is SiLU
    (not an MoE layer, nor Gemma's GELU MLP), and the effective scales of its attention-input norm
    (``input_norm``) and MLP-input norm (``mlp_norm``: Gemma's ``pre_feedforward_layernorm``, else
    ``post_attention_layernorm``; a parallel layer without one, as Cohere's, feeds its MLP the attention's
    input norm) as Llama weights [d] (:func:`effective_norm_weight`).

    What does not carry over falls back to what a fresh Llama-style layer starts from, and the reason is
    logged once (a warning naming the layer's class): q/k/v/o of other shapes than the draft layer's, or
    none (MLA) -> N(0, initializer_range) (drawn from torch's global generator); an MLP of other shapes ->
    left out (the draft layer keeps its own); a post-norm layout (OLMo-2: no ``input_layernorm``, norms
    after attention and MLP) or norms that are not RMSNorms (Cohere's LayerNorm) -> norm weights of 1.

    Returns:
        {"q_proj", "k_proj", "v_proj", "o_proj", "input_norm", "mlp_norm"[, "gate_proj", "up_proj",
        "down_proj"]} -> tensors of the draft layer's shapes (norms [d] float32).
    """
    dc = draft_layer_config(target_config)
    d, hd = int(hidden_size), int(dc["head_dim"])
    nq, nkv, inter = dc["num_attention_heads"] * hd, dc["num_key_value_heads"] * hd, int(dc["intermediate_size"])
    shapes = {"q_proj": (nq, d), "k_proj": (nkv, d), "v_proj": (nkv, d), "o_proj": (d, nq),
              "gate_proj": (inter, d), "up_proj": (inter, d), "down_proj": (d, inter)}  # fmt: skip
    w = split_projections(src)
    ref = next(src.parameters())
    reasons = []
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    bad = [n for n in attn if n not in w or tuple(w[n].shape) != shapes[n]]
    if bad:
        reasons.append("its attention has no q/k/v/o projections of the draft layer's shapes" if any(n in w for n in attn)
                       else "its attention has no q/k/v/o projections (e.g. MLA's low-rank ones)")  # fmt: skip
        for n in attn:
            w[n] = torch.empty(shapes[n], dtype=ref.dtype, device=ref.device).normal_(0.0, dc["initializer_range"])
    act = getattr(target_config, "hidden_act", None) or getattr(target_config, "hidden_activation", None)
    mlp_names = ("gate_proj", "up_proj", "down_proj")
    if act != "silu":
        for name in mlp_names:
            w.pop(name, None)
    elif any(n in w and tuple(w[n].shape) != shapes[n] for n in mlp_names):
        reasons.append(f"its dense MLP is not {inter} wide (the draft layer's intermediate_size)")
        for name in mlp_names:
            w.pop(name, None)
    input_norm = getattr(src, "input_layernorm", None)
    mlp_norm = getattr(src, "pre_feedforward_layernorm", None) or getattr(src, "post_attention_layernorm", None)
    if input_norm is None:
        reasons.append("it has no input_layernorm (norms after attention and MLP, none before: a post-norm layout)")
        norms = {}
    else:
        norms = {"input_norm": input_norm, "mlp_norm": mlp_norm if mlp_norm is not None else input_norm}
        odd = [n for n, m in norms.items() if not is_rms_norm(m, d)]
        if odd:
            reasons.append(f"its {type(input_norm if 'input_norm' in odd else mlp_norm).__name__} is not an RMSNorm")
            norms = {}
    for key in ("input_norm", "mlp_norm"):
        w[key] = effective_norm_weight(norms[key], d) if key in norms else torch.ones(d, dtype=torch.float32, device=ref.device)
    if reasons:
        log.warning("draft layer init from the target's %s: %s; those weights start as a fresh Llama-style "
                    "layer's instead", type(src).__name__, "; ".join(reasons))  # fmt: skip
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
    get = _getter(target_config)
    d = int(get("hidden_size"))
    # a target without attention heads (a pure state-space model) gets heads of 64 (d // 64 of them, at least one)
    attn_heads = get("num_attention_heads", None)
    heads = int(attn_heads or max(1, d // 64))
    head_dim = int((get("head_dim", None) if attn_heads else None) or d // heads)
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


# ------------------------------------------------------------------------------------------------ structure


class UnsupportedTarget(FatalError, ValueError):
    """A target whose structure drafttrain cannot read, or that its engine cannot decode exactly. The message is
    one line: the model's class, the part that failed, and what still works (a :class:`FatalError`: the entry
    points print it without a traceback and exit with status 1)."""


class BrokenModel(UnsupportedTarget):
    """A target whose **own** forward fails on a few tokens (``model(input_ids)``, no drafttrain part involved): its
    config or weights are broken, so neither drafttrain nor HF generation can run it. The message says so instead
    of naming a part drafttrain could not read."""


def error_line(e: BaseException) -> str:
    """``"ErrorType: first line of its message"`` (at most 160 characters of it): an exception in a one-line refusal."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def broken_model(cls: str, n_tokens: int, why: str) -> BrokenModel:
    """The one-line :class:`BrokenModel` of class ``cls`` whose own forward on ``n_tokens`` tokens failed with ``why``."""
    return BrokenModel(f"{cls}: the model's own forward fails on {n_tokens} tokens ({why}): its config or weights are "
                       "broken, so neither drafttrain nor HF generation can run it")  # fmt: skip


def own_forward_error(model: nn.Module, ids: torch.Tensor) -> str | None:
    """:func:`error_line` of the exception the model's own forward (``model(input_ids=ids)``, no cache) raises on
    ``ids`` ([1, T] int64), else None."""
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception as e:  # noqa: BLE001 - returned as the reason
        return error_line(e)
    return None


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer keeps between forwards, read off transformers' own cache after one forward
    (:func:`cache_layout`).

    Attributes:
        kind: ``"attention"`` (keys/values per token), ``"recurrent"`` (conv and/or recurrent states, no per-token
            keys: gated delta-net, Mamba, short convolutions), ``"hybrid"`` (both in one layer), ``"none"``
            (nothing: a layer that reads another layer's keys/values, or has no attention).
        key_shape, value_shape: (h_kv, hd_k) and (h_kv, hd_v) of one token (MLA: hd_k != hd_v); None without keys.
        sliding: the layer keeps a sliding window (transformers' sliding-window cache layer).
        indexer_dim: a sparse-attention indexer's key size per token (DeepSeek-V3.2 DSA), else None.
        conv_shapes, recurrent_shapes: per state index, the state's shape for one sequence (no batch axis).
        transformers_class: the transformers cache-layer class the layout was read from (for messages).
    """

    kind: str
    key_shape: tuple[int, int] | None = None
    value_shape: tuple[int, int] | None = None
    sliding: bool = False
    indexer_dim: int | None = None
    conv_shapes: tuple[tuple[int, ...] | None, ...] = ()
    recurrent_shapes: tuple[tuple[int, ...] | None, ...] = ()
    transformers_class: str = ""
    conv_dtypes: tuple[str | None, ...] = ()
    recurrent_dtypes: tuple[str | None, ...] = ()

    def state_dtype(self, which: str, i: int, default: torch.dtype) -> torch.dtype:
        """The dtype state ``i`` was written in (``which``: ``"conv"`` | ``"rec"``; some models keep recurrent states
        in float32 under a bf16 model), else ``default``."""
        names = self.conv_dtypes if which == "conv" else self.recurrent_dtypes
        name = names[i] if i < len(names) else None
        return getattr(torch, name) if name else default

    @property
    def is_recurrent(self) -> bool:
        return self.kind in ("recurrent", "hybrid")


def default_layout(config) -> tuple[LayerCache, ...]:
    """A plain transformer's layout read from its config: every layer attention keys/values of
    ``num_key_value_heads`` x ``head_dim`` (hidden_size // num_attention_heads where unset)."""
    get = _getter(config)
    heads = int(get("num_attention_heads"))
    h_kv = int(get("num_key_value_heads", None) or heads)
    hd = int(get("head_dim", None) or int(get("hidden_size")) // heads)
    return tuple(LayerCache("attention", (h_kv, hd), (h_kv, hd)) for _ in range(int(get("num_hidden_layers"))))


def text_config(config):
    """The decoder's own config: ``get_text_config(decoder=True)`` of a multimodal umbrella config, else the config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def backbone_of(model: nn.Module) -> nn.Module:
    """The module that returns ``last_hidden_state`` (the decoder without its LM head): transformers'
    ``get_decoder()`` where it names another module, else ``base_model``.

    Raises:
        UnsupportedTarget: neither gives a module other than the causal-LM wrapper itself.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None

    def usable(m) -> bool:  # a module other than the wrapper and its LM head, holding the input embeddings
        return (isinstance(m, nn.Module) and m is not model and m is not head
                and (embed is None or any(x is embed for x in m.modules())))  # fmt: skip

    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if usable(dec):
        return dec
    base = getattr(model, "base_model", None)
    if usable(base):
        return base
    children = [m for m in model.children() if usable(m)]  # the one child holding the embeddings
    if len(children) == 1:
        return children[0]
    raise UnsupportedTarget(f"{type(model).__name__}: drafttrain cannot find its decoder (get_decoder() and base_model "
                            "return the causal-LM wrapper itself)")  # fmt: skip


def num_layers_of(config) -> int:
    """L: decoder layers of a (text) config: ``num_hidden_layers`` (transformers' standard name, mapped by each
    config's ``attribute_map``)."""
    return int(text_config(config).num_hidden_layers)


def decoder_layers_of(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: the ``nn.ModuleList`` of the backbone (:func:`backbone_of`) with L entries (L = the
    config's ``num_hidden_layers``), a direct child before a nested one.

    Raises:
        UnsupportedTarget: no module list of L layers.
    """
    backbone = backbone_of(model)
    n = num_layers_of(model.config)
    lists = [(name, m) for name, m in backbone.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise UnsupportedTarget(f"{type(model).__name__}: its decoder {type(backbone).__name__} has no list of "
                                f"{n} decoder layers (num_hidden_layers)")  # fmt: skip
    lists.sort(key=lambda nm: nm[0].count("."))
    return lists[0][1]


def _last_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def probe_structure(model: nn.Module) -> dict[str, Any]:
    """Read the parts of a causal LM that drafttrain drives from the model itself: one forward of 4 tokens.

    Rules (one each; no attribute is read by name):

    - backbone: :func:`backbone_of`; decoder layers: :func:`decoder_layers_of`; embeddings and LM head:
      ``get_input_embeddings()`` / ``get_output_embeddings()``.
    - hidden states: the backbone's ``output_hidden_states`` must hold L + 1 states, the last one equal to
      ``last_hidden_state`` (id i = the state entering layer i, id L = the final post-norm state).
    - final norm: the module of the backbone (outside the decoder layers) that maps the last layer's output to
      ``last_hidden_state``, probed on that output; ``nn.Identity`` where the last layer's output already is it.
    - rotary embedding: the parameter-free module of the backbone (outside the decoder layers) that maps
      (x, position_ids) to a (cos, sin) pair; None where the model has none (learned or no positions).

    Returns:
        {"backbone", "layers", "embed", "head", "final_norm", "rotary"} -> modules (``rotary`` may be None).

    Raises:
        UnsupportedTarget: a part that cannot be read (the message names the class and the part).
    """
    cls = type(model).__name__
    backbone = backbone_of(model)
    layers = decoder_layers_of(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, nn.Module) or not isinstance(getattr(embed, "weight", None), torch.Tensor):
        raise UnsupportedTarget(f"{cls}: get_input_embeddings() gives no embedding table")
    if not isinstance(head, nn.Module) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise UnsupportedTarget(f"{cls}: get_output_embeddings() gives no LM head weight")
    n = len(layers)
    device = embed.weight.device
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % int(embed.weight.shape[0])
    seen: dict[str, torch.Tensor] = {}
    hook = layers[-1].register_forward_hook(lambda m, a, out: seen.__setitem__("last", _last_output(out)))
    try:
        out = backbone(input_ids=ids, output_hidden_states=True, use_cache=False)
    except Exception as e:  # noqa: BLE001 - reported as the part that failed
        hook.remove()  # before the model's own forward below, which would fire it
        own = own_forward_error(model, ids)
        if own is not None:
            raise broken_model(cls, ids.shape[1], own) from e
        raise UnsupportedTarget(f"{cls}: its decoder's forward fails on 4 tokens ({error_line(e)})") from e
    finally:
        hook.remove()
    last = getattr(out, "last_hidden_state", None)
    states = getattr(out, "hidden_states", None)
    if not isinstance(last, torch.Tensor) or states is None:
        raise UnsupportedTarget(f"{cls}: its decoder returns no last_hidden_state / hidden_states")
    if len(states) != n + 1:
        raise UnsupportedTarget(f"{cls}: its output_hidden_states has {len(states)} states, not {n + 1} (the embeddings "
                                f"and one per decoder layer): the feature layer ids would mean other states")  # fmt: skip
    if states[-1].shape != last.shape or not torch.allclose(states[-1].float(), last.float(), atol=1e-5, rtol=1e-4):
        raise UnsupportedTarget(f"{cls}: the last of its output_hidden_states is not its last_hidden_state: the "
                                "feature layer ids would mean other states")  # fmt: skip
    pre = seen.get("last")
    if not isinstance(pre, torch.Tensor) or pre.shape != last.shape:
        got = tuple(pre.shape) if isinstance(pre, torch.Tensor) else type(pre).__name__
        raise UnsupportedTarget(f"{cls}: its last decoder layer's output is {got}, not a hidden state of the decoder's "
                                f"shape {tuple(last.shape)} (several residual streams, e.g. hyper-connections, "
                                "where the engine reads one)")  # fmt: skip
    in_layers = {id(m) for m in layers.modules()}
    final_norm: nn.Module | None = None
    if torch.allclose(pre.float(), last.float(), atol=1e-6, rtol=1e-5):
        final_norm = nn.Identity()
    else:
        for name, m in backbone.named_modules():
            if id(m) in in_layers or m is backbone or m is embed or isinstance(m, (nn.ModuleList, nn.Embedding)):
                continue
            if any(x is embed for x in m.modules()):
                continue
            try:
                got = m(pre)
            except Exception:  # noqa: BLE001 - not a module that maps a hidden state
                continue
            if isinstance(got, torch.Tensor) and got.shape == last.shape and torch.allclose(
                got.float(), last.float(), atol=1e-5, rtol=1e-4
            ):
                final_norm = m
                break
    if final_norm is None:
        raise UnsupportedTarget(f"{cls}: no module of its decoder maps the last layer's output to last_hidden_state "
                                "(its final norm)")  # fmt: skip
    rotary = None
    x = last.new_zeros(1, ids.shape[1], last.shape[-1])
    pos = torch.arange(ids.shape[1], device=device)[None]
    for name, m in backbone.named_modules():
        if id(m) in in_layers or m is backbone or any(True for _ in m.parameters(recurse=False)):
            continue
        if isinstance(m, (nn.ModuleList, nn.Dropout, nn.Identity)) or list(m.children()):
            continue
        try:
            got = rotary_embeddings(m, x, pos)
        except Exception:  # noqa: BLE001 - not a rotary module
            continue
        if isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
            rotary = m
            break
    return {"backbone": backbone, "layers": layers, "embed": embed, "head": head, "final_norm": final_norm,
            "rotary": rotary}  # fmt: skip


def layer_cache_of(layer, keys_of=None) -> LayerCache:
    """The :class:`LayerCache` of one transformers cache layer after a forward (batch axis dropped)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    name = type(layer).__name__
    has_kv = isinstance(layer, CacheLayerMixin) and isinstance(getattr(layer, "keys", None), torch.Tensor)
    has_state = isinstance(layer, LinearAttentionCacheLayerMixin)
    k = v = None
    if has_kv and layer.keys.numel():
        k, v = tuple(layer.keys.shape[1::2]), tuple(layer.values.shape[1::2])  # [b, h, s, hd] -> (h, hd)
    conv = rec = conv_dt = rec_dt = ()
    if has_state:
        n = getattr(layer, "number_of_states", 1)
        c = [layer.conv_states.get(i) for i in range(n)]
        r = [layer.recurrent_states.get(i) for i in range(n)]
        conv = tuple(tuple(t.shape[1:]) if isinstance(t, torch.Tensor) else None for t in c)
        rec = tuple(tuple(t.shape[1:]) if isinstance(t, torch.Tensor) else None for t in r)
        conv_dt = tuple(str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None for t in c)
        rec_dt = tuple(str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None for t in r)
    idx = getattr(layer, "indexer_keys", None)
    indexer = int(idx.shape[-1]) if isinstance(idx, torch.Tensor) else None
    if has_kv and has_state:
        kind = "hybrid"
    elif has_state:
        kind = "recurrent"
    elif has_kv and k is not None:
        kind = "attention"
    elif type(layer).__name__ == "DummyLayer":
        kind = "none"
    elif isinstance(layer, CacheLayerMixin):
        kind = "unwritten"
    else:
        kind = f"unknown:{name}"
    return LayerCache(kind, k, v, sliding=bool(getattr(layer, "is_sliding", False)), indexer_dim=indexer,
                      conv_shapes=conv, recurrent_shapes=rec, transformers_class=name, conv_dtypes=conv_dt,
                      recurrent_dtypes=rec_dt)  # fmt: skip


@torch.no_grad()
def cache_layout(model: nn.Module) -> tuple[LayerCache, ...]:
    """Each decoder layer's :class:`LayerCache`, read off transformers' own ``DynamicCache(config=...)`` after
    one forward of 2 tokens through the model's public forward: the layer kinds (``config.layer_types``,
    per-layer configs) as transformers itself lays them out, and every state's shape (MLA's key and value head
    sizes, per-layer head sizes, conv and recurrent state sizes) as the model writes them.

    Raises:
        UnsupportedTarget: the model does not run with transformers' cache object (a cache class of its own), or a
            layer kind this reading does not know (the message names the class, the layer and its cache class).
    """
    from transformers import DynamicCache

    cls = type(model).__name__
    backbone = backbone_of(model)
    embed = model.get_input_embeddings()
    ids = torch.tensor([[1, 2]], device=embed.weight.device) % int(embed.weight.shape[0])
    try:
        cache = DynamicCache(config=model.config)
        out = backbone(input_ids=ids, cache=cache, use_cache=True)
    except Exception as e:  # noqa: BLE001 - reported as the part that failed
        raise UnsupportedTarget(f"{cls}: its forward does not run with transformers' DynamicCache ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:160]})") from e  # fmt: skip
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
    layers = getattr(cache, "layers", None)
    n = num_layers_of(model.config)
    if not isinstance(layers, list) or len(layers) < n:
        raise UnsupportedTarget(f"{cls}: its forward returns a {type(cache).__name__} without one layer per decoder "
                                "layer (a cache class of its own)")  # fmt: skip
    out_layers = tuple(layer_cache_of(layer) for layer in layers[:n])
    if all(c.kind in ("unwritten", "none") for c in out_layers):
        raise UnsupportedTarget(f"{cls}: its forward writes nothing into transformers' cache object (it keeps no "
                                "keys/values between forwards that the engine could hold)")  # fmt: skip
    bad = [(i, c) for i, c in enumerate(out_layers) if c.kind.startswith("unknown") or c.kind == "unwritten"]
    if bad:
        i, c = bad[0]
        raise UnsupportedTarget(f"{cls}: layer {i} keeps a {c.transformers_class} cache, a kind drafttrain's engine "
                                "does not hold (attention keys/values, conv or recurrent states)")  # fmt: skip
    return out_layers


def target_class_layer(shared, config, purpose: str) -> tuple[nn.Module, nn.Module]:
    """A fresh decoder layer of the target's own class and its rotary embedding, for drafters built from the
    target's layer class (``shared``: :class:`drafttrain.drafters.base.SharedTargetModules`; ``config`` a copy of the
    target's config, attention implementation set). The layer is built at index 0 of a config copy whose per-layer
    kinds (``layer_types`` / ``layers_block_type``) all read the kind of the target layer it copies, so a hybrid
    target gives an attention layer, not a recurrent one.

    Raises:
        UnsupportedTarget: the target has no rotary embedding module its layer class reads, or the class builds no
            ``self_attn`` (the message names ``purpose``, the class and the missing part).
    """
    src = shared.decoder_layer
    cls = type(src).__name__
    if shared.rotary_emb is None:
        raise UnsupportedTarget(f"{purpose} builds its draft layer from the target's own {cls}, which reads rotary "
                                "embeddings the target's decoder computes once; this target's decoder has no rotary "
                                "module (use a recipe with the Llama-style draft layer: parallelspec, eagle3)")  # fmt: skip
    cfg = copy.deepcopy(config)
    idx = shared.decoder_layer_index if shared.decoder_layer_index is not None else -1
    for attr in ("layer_types", "layers_block_type"):
        kinds = getattr(cfg, attr, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            setattr(cfg, attr, [kinds[idx]] * len(kinds))
    layer = type(src)(cfg, layer_idx=0)
    if not isinstance(getattr(layer, "self_attn", None), nn.Module):
        raise UnsupportedTarget(f"{purpose} builds its draft layer from the target's own {cls}, which has no "
                                "self_attn (use a recipe with the Llama-style draft layer: parallelspec, eagle3)")  # fmt: skip
    return layer, type(shared.rotary_emb)(config=cfg)


def recurrent_layers_text(target) -> str:
    """``"Qwen3NextForCausalLM's recurrent layers (0, 1, 2 of 4)"``: the target's class and which layers keep
    recurrent states (for messages)."""
    idx = [i for i, c in enumerate(target.cache_layout) if c.is_recurrent]
    shown = ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")
    return f"{type(target.model).__name__}'s recurrent layers ({shown} of {len(target.cache_layout)})"
