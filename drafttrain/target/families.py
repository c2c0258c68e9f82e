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
        """Why drafttrain's engine cannot decode this family exactly (None: it can)."""
        if self.sinks:
            return "its attention sinks (a learned per-head logit in every softmax) are not in the engine's attention"
        if self.softcap:
            return "its attention logit soft-capping is not in the engine's attention"
        if self.mla:
            return "its MLA attention (keys and values of other head sizes than head_dim) is not in the engine's KV cache"
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
                  softcap=bool(get("attn_logit_softcapping", None)), mla=mla_attention(config) is not None)  # fmt: skip


def _getter(config):
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


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

    Raises:
        ValueError: the family has attention sinks or soft-capping, or MLA attention (:func:`mla_attention`);
            the message names the family (MLA: the architecture, ``DeepseekV3``) and why.
    """
    howto = "train with data.generation.backend=hf and trainer.spec_eval.num_prompts=0"
    mla = mla_attention(config)
    if mla:
        raise ValueError(f"{architecture_name(config)} uses MLA attention ({mla}); the engine's KV cache does not "
                         f"support it yet (it holds keys and values of one head_dim), so {where} refuses it "
                         f"({howto})")  # fmt: skip
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
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
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
    w = next(norm.parameters())
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 0.0)
    out = norm(torch.ones(1, hidden_size, dtype=torch.float32, device=w.device).to(w.dtype)).float()[0]
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
