"""EAGLE-3 drafter (Li et al. 2025, "EAGLE-3: Scaling up inference acceleration of large language models
via training-time test", sections 3.1-3.2), trained with the training-time test (TTT).

**Inputs.** The drafter reads three of the target's hidden states, low / middle / high, at every
position: layer ids ``aux_layer_ids`` (default ``(2, L // 2, L - 3)``, vLLM's and speculators'
convention: **id i is the hidden state entering decoder layer i**, Hugging Face's
``output_hidden_states[i]``, 0 = the embeddings; SpecForge writes the same tensors as ``[1, L//2 - 1,
L - 4]``, "output of layer i", see docs/design.md, "Serving formats"). Targets with fewer than 7 layers get
the nearest three distinct increasing ids (:func:`default_aux_layer_ids`). It also reads the final post-norm state (id L, the LM head's input) but only
for training: the target's next-token distribution, LM head(f_{i+1}), is the TTT loss's target. The
features handed to it are these layers concatenated in the order of :attr:`Eagle3Drafter.feature_layer_ids`
= the distinct ids of (low, mid, high, L): ``[..., 4d]`` = [low | mid | high | final] on a real target
(a layer named twice, as on the 2-layer test target, is handed once and read twice).

**Network** (one decoder layer; state-dict names are those of the speculators format one-to-one):

    g_i = fc([low_i; mid_i; high_i])                     fc.weight [d, 3d], no bias
    a   = attn(cat(input_layernorm(e(x_{i+1})), hidden_norm(g_i)))   q/k/v_proj read 2d
    h   = g_i + a;   h = h + mlp(post_attention_layernorm(h))        layers.0.*
    logits = lm_head(norm(h))                             norm.weight, lm_head.weight [N, d]

``lm_head`` is the drafter's own head over the draft vocabulary (buffers ``d2t`` / ``t2d`` in the
engines' offset convention, :mod:`drafttrain.drafters.base`), initialised from the target's rows; the
embedding is the target's, shared and frozen (engines share it too). The layer is built from the
target's own decoder-layer class and its public submodules (attention, MLP, RMSNorm): its q/k/v
projections are replaced by 2d-input linears and a ``hidden_norm`` is added; its forward is written
here (the attention module is called with explicit position embeddings, a 4D additive mask and a
cache, the way :mod:`drafttrain.drafters.feature_layer` drives the target's layer). No modeling file
is copied.

**Autoregressive drafting.** The layer's output h (before ``norm``) is the next step's g: drafting
step j + 1 feeds (draft token of step j, h of step j). :meth:`items` tells the two kinds of g apart by
width (target features: ``len(feature_layer_ids) * d``, through fc; the drafter's own h: d).

**Training-time test** (section 3.2): ``ttt_steps`` = K unrolled steps over every position at once.
Step 0 is the teacher-forced pass over the items; step k >= 1 at row j feeds the ground-truth token
x_{j+k+1} with the drafter's own output h of step k - 1 at row j, at RoPE position j + k, attending to
the step-0 keys at 0..j and to its own keys of steps 1..k (:func:`drafttrain.layout.ttt_mask`). Row j
of step k is therefore the greedy chain drafted from item j at depth k whenever the chain is right
(tested against an autoregressive rollout), and guesses y_{j+k} = x_{j+k+2}. Loss:

    L = sum_k loss_decay^k * mean_{j} KL( p_{j+k} || q_{k, j} ),

p = the target's distribution LM head(f_{j+k+1}) renormalised over the draft vocabulary, q = the
drafter's; rows whose label is loss-masked or whose target argmax (over the full vocabulary) is not
in the draft vocabulary are left out. No feature-regression term (EAGLE-3 drops it).

Metrics: acc_k / cond_acc_k / tau_sim over the first min(``draft_depth``, K) steps of the same unrolled
pass (row j = the group of anchor j; an out-of-vocabulary label counts as a miss), plus the per-step
KL ``kl_k``.

Shape letters: b batch, t items, K TTT steps, d hidden, N draft vocab, v target vocab.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from drafttrain.target import families
from drafttrain import layout as L
from drafttrain.attention import implementation_for, ttt_block_mask
from drafttrain.drafters.base import (
    LAST_LAYER,
    Drafter,
    DrafterSpec,
    DraftGroups,
    LossOutput,
    Objective,
    SharedTargetModules,
)
from drafttrain.drafters.feature_layer import FeatureLayerDrafter, init_fresh_
from drafttrain.drafters.groups import choose_groups, pick_drafts
from drafttrain.drafters.target_argmax import full_vocab_argmax, memo_of
from drafttrain.losses import divergence, group_position_weights, weighted_position_mean
from drafttrain.metrics import empty_group_sums, group_acceptance_sums

NUM_AUX = 3  # low, middle, high


def default_aux_layer_ids(num_hidden_layers: int) -> tuple[int, int, int]:
    """The default EAGLE-3 layer ids (low, middle, high) of an L-layer target: vLLM's ``(2, L // 2, L - 3)``
    wherever those are distinct (L >= 7), else the nearest ids that pass :func:`aux_layer_ids_problem`:
    low = min(2, L - 3), high = max(L - 3, low + 2), middle = L // 2 moved into (low, high). Below 3 layers
    no three distinct ids exist: the ids are clamped into [0, L - 1] (such a target trains, but no
    engine format can be exported for it).

    Example: L = 30 -> (2, 15, 27); L = 6 -> (2, 3, 4); L = 3 -> (0, 1, 2); L = 2 -> (1, 1, 0).
    """
    n = int(num_hidden_layers)
    if n < NUM_AUX:
        return tuple(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3))  # type: ignore[return-value]
    low = min(2, n - 3)
    high = max(n - 3, low + 2)
    mid = max(low + 1, min(n // 2, high - 1))
    return (low, mid, high)


def aux_layer_ids_problem(ids, num_hidden_layers: int) -> str | None:
    """Why ``ids`` cannot be an EAGLE-3 drafter's (low, middle, high) layer ids for an L-layer target, None
    when they can: the rule training's config check and the engine exports
    (:func:`drafttrain.export.eagle3_common.check_drafter`) share. vLLM captures the layers while walking
    them in order, once each, so the ids must be three strictly increasing ids in [0, L - 1] (id L, the
    post-norm state, is not a low/middle/high input; negative ids are refused to keep one convention).
    """
    n = int(num_hidden_layers)
    ids = [int(i) for i in ids]
    if n < NUM_AUX:
        return (f"a target with {n} decoder layer(s) has no {NUM_AUX} distinct layer ids, and the engines read "
                f"{NUM_AUX} (use a target with >= {NUM_AUX} layers)")  # fmt: skip
    if len(ids) != NUM_AUX or any(i < 0 or i >= n for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        return (f"must be {NUM_AUX} strictly increasing layer ids in [0, {n - 1}] (id i = the hidden state entering "
                f"decoder layer i; vLLM concatenates the captured layers in layer order, once each), got {ids}")  # fmt: skip
    return None


def suggested_aux_layer_ids(num_hidden_layers: int) -> str:
    """The override that gives an L-layer target valid ids (:func:`default_aux_layer_ids`), for error messages:
    ``drafter.aux_layer_ids=[2,3,4]`` for L = 6."""
    ids = ",".join(str(i) for i in default_aux_layer_ids(num_hidden_layers))
    return f"drafter.aux_layer_ids=[{ids}] (the default for {int(num_hidden_layers)} layers, also what null gives)"


def feature_layer_ids(aux_ids, num_hidden_layers: int) -> tuple[int, ...]:
    """The distinct target layer ids an EAGLE-3 drafter is handed, in order: the three low / middle / high
    ids then L (the final post-norm state). Example: L = 30 -> (2, 15, 27, 30); L = 2 -> (1, 0, 2)."""
    ids = resolve_aux_layer_ids(aux_ids, num_hidden_layers) + (int(num_hidden_layers),)
    return tuple(dict.fromkeys(ids))


def resolve_aux_layer_ids(ids, num_hidden_layers: int) -> tuple[int, int, int]:
    """The three layer ids an EAGLE-3 drafter reads: ``ids`` (empty/None = :func:`default_aux_layer_ids`).

    Raises:
        ValueError: ids that break :func:`aux_layer_ids_problem` (the message gives the default ids for this
            target). A target with fewer than 3 layers is let through with any 3 ids in [0, L - 1]: it
            trains, though nothing can be exported for it.
    """
    n = int(num_hidden_layers)
    if not ids:
        return default_aux_layer_ids(n)
    ids = tuple(int(i) for i in ids)
    if n < NUM_AUX:
        if len(ids) != NUM_AUX or any(i < 0 or i >= n for i in ids):
            raise ValueError(f"drafter.aux_layer_ids must be {NUM_AUX} layer ids in [0, {n - 1}], got {list(ids)}")
        return ids  # type: ignore[return-value]
    problem = aux_layer_ids_problem(ids, n)
    if problem:
        raise ValueError(f"drafter.aux_layer_ids {problem}; e.g. {suggested_aux_layer_ids(n)}")
    return ids  # type: ignore[return-value]


class Eagle3Drafter(FeatureLayerDrafter):
    """EAGLE-3: fc over three target layers + one decoder layer on cat(e, g) + own head; TTT training.

    Config keys: ``draft_depth`` (D, the greedy chain :meth:`propose` drafts, default 5), ``ttt_steps``
    (K unrolled training steps, 7), ``loss_decay`` (step weights decay**k, 0.8), ``aux_layer_ids`` (the
    three target layer ids; None or [] = ``(2, L // 2, L - 3)``), ``init_from_target_layer`` (start the layer's
    MLP / o_proj / the g-half of q/k/v from the target's last layer, ``norm`` from its final norm),
    ``draft_vocab_size`` (N; 0 = the full vocabulary).

    Trainable parameters: fc (3d x d), one decoder layer with 2d-wide q/k/v, ``hidden_norm``, ``norm``,
    ``lm_head`` (N x d).

    Inference: :meth:`propose` (greedy chain of D). Lower level, for the batched tree proposer
    (:class:`~drafttrain.verify.proposers.EagleProposer`): :meth:`items`, :meth:`decode`,
    :meth:`forward_inputs`, :meth:`draft_step` (the "predicted feature" they return is h, the next g).

    The fc-and-layer scaffolding of :class:`FeatureLayerDrafter` is reused for everything but the
    network itself: ``__init__`` builds its own fc (3d -> d, no bias) and layer instead.
    """

    name = "eagle3"
    serving_formats = {"speculators": "eagle3", "sglang": "eagle3"}
    # feature_layers here is a placeholder: the real ids depend on the config and the target (layers_for)
    spec = DrafterSpec(drafting="autoregressive", feature_layers=(LAST_LAYER,), step_input="items", batched=True)
    objectives = frozenset({"divergence", "cut_at_first_miss", "on_policy"})
    defaults = {
        "draft_depth": 5,
        "ttt_steps": 7,
        "loss_decay": 0.8,
        "aux_layer_ids": None,
        "init_from_target_layer": True,
        "draft_vocab_size": 0,
        "draft_layer": "llama",
        "fc_norm": False,
        "norm_output": False,
    }

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        Drafter.__init__(self, config, shared)  # not FeatureLayerDrafter's: another fc and layer
        for key in ("draft_depth", "ttt_steps"):  # (the parallel variant reads neither)
            if key in self.config and int(self.config[key]) < 1:
                raise ValueError(f"drafter.{key} must be >= 1, got {self.config[key]}")
        mcfg = copy.deepcopy(shared.model_config)
        if getattr(mcfg, "_attn_implementation", None) not in ("sdpa", "eager"):
            mcfg._attn_implementation = "sdpa"  # float 4D masks: sdpa or eager only (docs/design.md, "Platform notes")
        self.aux_layer_ids = resolve_aux_layer_ids(self.config["aux_layer_ids"], mcfg.num_hidden_layers)
        self.feature_layer_ids = feature_layer_ids(self.aux_layer_ids, mcfg.num_hidden_layers)
        slot = {layer: j for j, layer in enumerate(self.feature_layer_ids)}
        self._aux_slots = [slot[i] for i in self.aux_layer_ids]  # where low / mid / high sit in the features
        self._final_slot = slot[mcfg.num_hidden_layers]
        d = mcfg.hidden_size
        self.fc = nn.Linear(NUM_AUX * d, d, bias=False)
        style = self.config["draft_layer"]
        if style == "llama":  # the layer vLLM and SGLang build for every target family
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

            lcfg = families.llama_layer_config(mcfg, mcfg._attn_implementation)
            layer, self.rotary = LlamaDecoderLayer(lcfg, layer_idx=0), LlamaRotaryEmbedding(config=lcfg)
            eps = lcfg.rms_norm_eps
        elif style == "target":  # the target's own decoder-layer class (checkpoints written before "llama")
            layer, self.rotary = families.target_class_layer(shared, mcfg, "drafter.draft_layer=target")
            eps = mcfg.rms_norm_eps
        else:
            raise ValueError(f"drafter.draft_layer must be llama|target, got {style!r}")
        attn = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj"):  # the attention reads cat(e, g): 2d wide
            old = getattr(attn, proj)
            setattr(attn, proj, nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
        norm_cls = type(layer.input_layernorm)
        layer.hidden_norm = norm_cls(d, eps=eps)
        # EAGLE-3.1: one RMSNorm per target layer before fc (vLLM's fc_norm), None = EAGLE-3's raw states
        self.fc_norm = nn.ModuleList([norm_cls(d, eps=eps) for _ in range(NUM_AUX)]) if self.config.get("fc_norm") else None
        self.layers = nn.ModuleList([layer])
        self.norm = norm_cls(d, eps=eps)
        self._init_draft_vocab(self.config["draft_vocab_size"])
        self.lm_head = nn.Linear(d, self.d2t.numel(), bias=False)
        if init_weights:
            self.reset_parameters(from_target=bool(self.config["init_from_target_layer"]))
        self._finish()

    @classmethod
    def layers_for(cls, config: dict[str, Any], num_hidden_layers: int) -> tuple[int, ...]:
        """The declared target layers: the distinct ids of (low, mid, high, L) (:func:`feature_layer_ids`).

        Raises:
            ValueError: bad ``aux_layer_ids`` (:func:`resolve_aux_layer_ids`).
        """
        return feature_layer_ids(config.get("aux_layer_ids", cls.defaults["aux_layer_ids"]), num_hidden_layers)

    @property
    def layer(self) -> nn.Module:
        """The one decoder layer (``layers.0``; the ragged drafter cache is shaped from its attention)."""
        return self.layers[0]

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def draft_depth(self) -> int:
        """D: the chain :meth:`propose` drafts (D drafter forwards)."""
        return int(self.config["draft_depth"])

    @property
    def ttt_steps(self) -> int:
        return int(self.config["ttt_steps"])

    # -- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, from_target: bool) -> None:
        """fc = N(0, 0.02) + [0 | 0 | I] (g starts as the high layer); linears N(0, 0.02), norms 1; with
        ``from_target`` the target's last layer gives the MLP, o_proj, post-attention norm, the g half of
        q/k/v and ``hidden_norm`` (its input norm), and the target's final norm gives ``norm``. ``lm_head``
        = the target head's draft-vocabulary rows."""
        std = getattr(self.shared.model_config, "initializer_range", 0.02)
        d = self.hidden_size
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
        if self.config["draft_layer"] == "target":  # the target's class: also its non-Linear tensors (MoE, sinks)
            init_fresh_(self.layer, std)
        for m in (self.layer.input_layernorm, self.layer.hidden_norm, self.layer.post_attention_layernorm, self.norm,
                  *(self.fc_norm or ())):  # fmt: skip
            m.weight.fill_(1.0)
        self.fc.weight[:, (NUM_AUX - 1) * d :] += torch.eye(d, dtype=self.fc.weight.dtype)
        if from_target:
            self._copy_target_layer(self.shared.decoder_layer)
        self._copy_target_rows()

    @torch.no_grad()
    def _copy_target_layer(self, src: nn.Module) -> None:
        """Start from the target's last layer ``src`` where its computation carries over (:meth:`reset_parameters`).

        With the Llama-style layer (``draft_layer=llama``) the target's weights go in through
        :mod:`drafttrain.target.families`: fused projections unfused (Phi3), norms converted to Llama's ``x * w``
        (Gemma's ``x * (1 + w)``), biases and q/k norms left out (the engines' layer has none), the MLP copied
        only from a dense SiLU MLP (not from an MoE layer, nor from Gemma's GELU MLP). With ``target`` the
        layer is the target's own class and everything is copied as it is.
        """
        d = self.hidden_size
        layer = self.layer
        if self.config["draft_layer"] == "target":
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).weight[:, d:] = getattr(src.self_attn, name).weight
            layer.self_attn.o_proj.load_state_dict(src.self_attn.o_proj.state_dict())
            layer.mlp.load_state_dict(src.mlp.state_dict())
            layer.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
            layer.hidden_norm.load_state_dict(src.input_layernorm.state_dict())
            self.norm.load_state_dict(self.shared.final_norm.state_dict())
            return
        w = families.llama_init_weights(src, self.shared.model_config, d)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, name).weight[:, d:] = w[name]
        layer.self_attn.o_proj.weight.copy_(w["o_proj"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            if name in w:
                getattr(layer.mlp, name).weight.copy_(w[name])
        layer.post_attention_layernorm.weight.copy_(w["mlp_norm"])
        layer.hidden_norm.weight.copy_(w["input_norm"])
        self.norm.weight.copy_(families.effective_norm_weight(self.shared.final_norm, d))

    @torch.no_grad()
    def _copy_target_rows(self) -> None:
        w = self.shared.lm_head.weight
        self.lm_head.weight.copy_(w[self.draft_token_ids.to(w.device)].to(self.lm_head.weight))

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Set the draft vocabulary (:meth:`Drafter.set_draft_vocab`) and re-copy ``lm_head`` from the
        target's rows of the new ids: call it before training, never on a trained drafter."""
        super().set_draft_vocab(token_ids)
        self._copy_target_rows()

    # -- building blocks ------------------------------------------------------------------------
    def items(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer inputs cat(e(x_{i+1}), g_i): [b, q] ids + features -> [b, q, 2d].

        ``features`` are either the target's (width ``len(feature_layer_ids) * d``: g = fc of the low /
        middle / high states, :meth:`aux_features`) or the drafter's own output hidden states h (width d,
        g = h).

        Raises:
            ValueError: any other width.
        """
        d = self.hidden_size
        w = features.shape[-1]
        dtype = self.fc.weight.dtype
        if w == d:
            g = features.to(dtype)
        elif w == len(self.feature_layer_ids) * d:
            g = self.combine(self.aux_features(features).to(dtype))
        else:
            raise ValueError(f"EAGLE-3 features must be the target's layers {self.feature_layer_ids} "
                             f"[..., {len(self.feature_layer_ids) * d}] or the drafter's own [..., {d}], got width {w}")
        return torch.cat([self.embed(next_ids).to(dtype), g], dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """e(x): the target's embedding rows, [b, s] int64 -> [b, s, d]. With the Llama-style layer the raw
        rows (what the engines' draft model reads; Gemma's sqrt(d) scale is left out: ``input_layernorm``
        makes the two the same up to its epsilon), else the target's embedding module as it is."""
        if self.config["draft_layer"] == "llama":
            return families.raw_embedding(self.shared.embed_tokens, ids)
        return self.shared.embed_tokens(ids)

    def aux_features(self, features: torch.Tensor) -> torch.Tensor:
        """[low | mid | high] of the target features: [..., len(feature_layer_ids) * d] -> [..., 3d] (fc's input)."""
        d = self.hidden_size
        if self._aux_slots == list(range(NUM_AUX)):
            return features[..., : NUM_AUX * d]
        return torch.cat([features[..., j * d : (j + 1) * d] for j in self._aux_slots], dim=-1)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc([low; mid; high]) of fc's input [..., 3d] -> [..., d]; with ``fc_norm`` (EAGLE-3.1) each of the
        three d-wide states goes through its own RMSNorm first, as vLLM's ``combine_hidden_states``."""
        if self.fc_norm is not None:
            d = self.hidden_size
            aux = torch.cat([norm(aux[..., j * d : (j + 1) * d]) for j, norm in enumerate(self.fc_norm)], dim=-1)
        return self.fc(aux)

    def final_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final post-norm state f of the target features: [..., F] -> [..., d]."""
        d = self.hidden_size
        return features[..., self._final_slot * d : (self._final_slot + 1) * d]

    def decode(self, x, attention_mask, position_ids, cache=None, use_cache=False) -> torch.Tensor:
        """The EAGLE-3 decoder layer over inputs x = cat(e, g) [b, q, 2d], additive mask [b, 1, q, kv] (or a
        flex ``BlockMask``: :mod:`drafttrain.attention`), positions [b, q]; with a cache its q new keys/values
        are appended (kv = cached + q).

        Returns h [b, q, d] (before ``norm``): the next step's g.
        """
        d = self.hidden_size
        e, g = x[..., :d], x[..., d:]
        layer = self.layer
        pos_emb = families.rotary_embeddings(self.rotary, g, position_ids, layer)
        a = torch.cat([layer.input_layernorm(e), layer.hidden_norm(g)], dim=-1)  # [b, q, 2d]
        with implementation_for(layer.self_attn.config, attention_mask):
            attn, _ = layer.self_attn(hidden_states=a, position_embeddings=pos_emb, attention_mask=attention_mask,
                                      cache=cache)  # fmt: skip
        h = g + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @property
    def norm_output(self) -> bool:
        """EAGLE-3.1's ``norm_output``: the next drafting step reads norm(h), not h."""
        return bool(self.config.get("norm_output", False))

    def predict_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature f the next drafting step reads (and :meth:`vocab_logits` takes): h itself (EAGLE-3 feeds
        back the pre-norm output), or norm(h) with ``norm_output`` (EAGLE-3.1; vLLM's ``aux_output``)."""
        return self.norm(hidden) if self.norm_output else hidden

    # -- what the serving engines read (exporters serialise these, never a recipe's name) ---------
    def serving_flags(self) -> dict[str, bool]:
        """The network's variant flags in the speculators ``config.json`` keys vLLM's ``llama_eagle3`` reads:
        ``norm_before_residual`` and ``norm_before_fc`` (never computed here: False), ``fc_norm`` and
        ``norm_output`` (EAGLE-3.1's, from the drafter's config). An exporter writes them as they are; a
        format whose engine lacks a flag that is True refuses the drafter naming it."""
        return {"norm_before_residual": False, "norm_before_fc": False,
                "fc_norm": bool(self.config.get("fc_norm", False)), "norm_output": bool(self.config.get("norm_output", False))}  # fmt: skip

    def serving_tensor_names(self) -> list[str]:
        """The state-dict names outside the decoder layer that the engines load, in order: ``fc.weight``, one
        ``fc_norm.{i}.weight`` per target layer with ``fc_norm``, ``norm.weight``, ``lm_head.weight``
        (the layer's own names: :data:`drafttrain.export.eagle3_common.LAYER_WEIGHTS`)."""
        names = ["fc.weight"]
        names += [n for n in self.state_dict() if n.startswith("fc_norm.")]
        return names + ["norm.weight", "lm_head.weight"]

    def vocab_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The drafter's own head on a predicted feature f (:meth:`predict_features`): lm_head(norm(h)) either
        way (f = h: the norm here; f = norm(h) with ``norm_output``: already normed), [..., d] -> [..., N]
        float32 (draft vocabulary)."""
        x = features.to(self.lm_head.weight.dtype)
        return self.lm_head(x if self.norm_output else self.norm(x)).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab_logits(self.predict_features(hidden))

    def draft_inputs(self) -> torch.Tensor:
        """No extra inputs after the items in a drafting forward ([0, 2d]): EAGLE-3 drafts autoregressively."""
        return self.fc.weight.new_zeros((0, 2 * self.hidden_size))

    # -- training -------------------------------------------------------------------------------
    def ttt_hidden(self, input_ids: torch.Tensor, features: torch.Tensor, num_steps: int | None = None,
                   tokens_hook=None) -> list[torch.Tensor]:  # fmt: skip
        """The unrolled training-time-test pass (module docstring; mask :func:`drafttrain.layout.ttt_mask`).

        Args:
            input_ids: [b, L] int64 right-padded tokens x_0..x_{L-1}.
            features: [b, L-1, F] the target features of the items (f_0..f_{L-2}, layers :attr:`feature_layer_ids`).
            num_steps: K (default ``ttt_steps``).
            tokens_hook: on-policy training: ``tokens_hook(k, tokens [b, t], h_prev [b, t, d]) -> [b, t]``, the
                tokens step k >= 1 reads (default: the ground truth x_{j+k+1}); e.g. the drafter's own drafts.

        Returns:
            K tensors [b, t, d] (t = L - 1): the predicted feature f of step k at row j (h, or norm(h) with
            ``norm_output``: :meth:`predict_features`; row j = the chain from item j, depth k; its head
            :meth:`vocab_logits` guesses y_{j+k} = x_{j+k+2}). Rows past a sequence's end are padding.
        """
        from transformers import DynamicCache

        k_steps = self.ttt_steps if num_steps is None else int(num_steps)
        b, t = input_ids.shape[0], input_ids.shape[1] - 1
        device = input_ids.device
        cache = DynamicCache()
        x = self.items(input_ids[:, 1:], features[:, :t])  # step 0: (x_{j+1}, fc(target features of j))
        out: list[torch.Tensor] = []
        for k in range(k_steps):
            if k:  # step k, row j: ground-truth x_{j+k+1} with h of step k - 1 at row j
                tok = torch.cat([input_ids[:, 1 + k :], input_ids.new_zeros((b, k))], dim=1)[:, :t]
                if tokens_hook is not None:
                    tok = tokens_hook(k, tok, out[-1])
                x = self.items(tok, out[-1])
            pos, mask = L.ttt_step_layout(t, k, dtype=x.dtype, dense=self.attention == "dense", device=device)
            mask = mask.expand(b, -1, -1, -1) if mask is not None else ttt_block_mask(t, k, device)
            h = self.decode(x, mask, pos.expand(b, -1), cache=cache, use_cache=True)
            out.append(self.predict_features(h))  # what step k + 1 reads and the head takes (h, or norm(h))
        return out

    @torch.no_grad()
    def _target_side(self, final: torch.Tensor, labels: torch.Tensor, batch: dict[str, torch.Tensor] | None = None):
        """Per item position p with a label: the target's draft-vocabulary logits of y_p = LM head(f_{p+1})
        and whether its full-vocabulary argmax is a draft id (memoised per row across steps when ``batch``
        is given: :mod:`drafttrain.drafters.target_argmax`).

        Args:
            final: [b, t, d] the target's post-norm features f_0..f_{t-1}.
            labels: [b, t] item labels (-100 = none; a label at p implies p + 1 < t).
            batch: the training batch (``input_ids``, ``lengths``: the memo's row keys), or None.

        Returns:
            (keep [b, t] bool: labelled and argmax in the draft vocabulary, index [b, t] int64 row of
            ``tlogits`` for kept positions, tlogits [m, N] float32).
        """
        b, t, d = final.shape
        f_next = torch.cat([final[:, 1:], final.new_zeros((b, 1, d))], dim=1)  # [b, t, d] f_{p+1}
        valid = labels != L.IGNORE_INDEX
        fv = f_next[valid]  # [m0, d]
        in_vocab = torch.ones(fv.shape[0], dtype=torch.bool, device=fv.device)
        if self.restricted_vocab and fv.shape[0]:
            if batch is not None:  # argmax of LM head(f_p) per item, once per row; shifted to f_{p+1}
                top_p = memo_of(self)(self.shared.lm_head, batch["input_ids"], batch["lengths"], final)  # [b, t]
                top = torch.cat([top_p[:, 1:], top_p.new_zeros((b, 1))], dim=1)[valid]
            else:
                top = full_vocab_argmax(self.shared.lm_head, fv)
            in_vocab = self.t2d.to(top.device)[top]
        keep = valid.clone()
        keep[valid] = in_vocab
        index = torch.full((b, t), -1, dtype=torch.long, device=labels.device)
        index[keep] = torch.arange(int(keep.sum()), device=labels.device)
        return keep, index, self.target_logits(fv[in_vocab])

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None,
                      objective: Objective | None = None) -> LossOutput:  # fmt: skip
        """The TTT loss (module docstring) and the acceptance metrics of the same unrolled pass.

        Batch keys: ``input_ids`` [b, L] int64 (right-padded), ``loss_mask`` [b, L], ``lengths`` [b],
        ``features`` [b, L-1, F] (the layers :attr:`feature_layer_ids` of f_0..f_{L-2}, F = 4d on a real target).

        ``objective`` (None = offline, forward KL): ``loss.divergence``; Spec-AUF's cut (row j's steps after its
        chain's first predicted miss); on-policy (training mode): for up to ``groups_per_row`` rows j per
        sequence, step k >= 1 reads the drafter's own draft of step k - 1 instead of x_{j+k+1}, and its label
        is the target's distribution after x_0..x_{j+1}, d_0..d_{k-1} (``objective.labeller``, one target
        forward for the batch).
        """
        obj = objective or Objective()
        ids, feats = batch["input_ids"], batch["features"]
        k_steps = self.ttt_steps
        b, t = ids.shape[0], ids.shape[1] - 1
        labels = L.batch_item_labels(ids, batch["loss_mask"], batch["lengths"])  # [b, t]
        keep, index, tlogits = self._target_side(self.final_features(feats[:, :t]), labels, batch)
        group = L.shifted_labels(labels, k_steps).clone()  # [b, t, K]: step k row j -> y_{j+k} (own memory: relabelled)
        valid = group != L.IGNORE_INDEX
        scored = torch.zeros_like(valid)  # [b, t, K]: the label of step k at row j can be drafted
        for k in range(k_steps):
            scored[:, : t - k, k] = keep[:, k:]
        policy = obj.on_policy and self.training and k_steps > 1
        sums: dict[str, torch.Tensor] = {}
        hook, chosen = None, None
        if policy:
            cand = valid[..., 0] & valid[..., 1:].any(-1)  # rows whose chain has a label to replace
            rr, jj = torch.nonzero(cand, as_tuple=True)
            pick = choose_groups(rr, obj.groups_per_row, generator)
            chosen = (rr[pick], jj[pick])
            drafts = torch.zeros((int(pick.sum()), k_steps), dtype=torch.long, device=ids.device)

            def hook(k, tok, h_prev):  # step k reads the draft of step k - 1 on the chosen rows
                with torch.no_grad():
                    lg = self.vocab_logits(h_prev[chosen].detach())
                    drafts[:, k - 1] = self.draft_token_ids.to(ids.device)[pick_drafts(lg, obj.temperature, generator)]
                tok = tok.clone()
                tok[chosen] = drafts[:, k - 1]
                return tok

        hidden = self.ttt_hidden(ids, feats, tokens_hook=hook)
        on_feats = on_top = None
        if policy and drafts.shape[0]:
            with torch.no_grad():
                on_feats = obj.labeller(DraftGroups(row=chosen[0], anchor=chosen[1], drafts=drafts[:, : k_steps - 1]))
                g = drafts.shape[0]
                on_top = full_vocab_argmax(self.shared.lm_head, on_feats.reshape(-1, on_feats.shape[-1])).view(g, -1)
                old = group[chosen][:, 1:]  # [g, K-1] offline labels of steps 1..K-1
                v = valid[chosen][:, 1:]
                same = drafts[:, : k_steps - 1] == group[chosen][:, : k_steps - 1]
                prefix_ok = torch.cumprod(same.long(), dim=1).bool()
                sums.update({"policy_groups": torch.tensor(float(g), device=ids.device),
                             "policy_agree_den": (v & prefix_ok).float().sum(),
                             "policy_agree_num": (v & prefix_ok & (on_top == old)).float().sum()})  # fmt: skip
                group[chosen[0], chosen[1], 1:] = torch.where(v, on_top, old)
                sc = scored[chosen]
                sc[:, 1:] = torch.where(v, self.t2d.to(on_top.device)[on_top], sc[:, 1:])
                scored[chosen] = sc
        elif policy:
            z = torch.zeros((), device=ids.device)
            sums.update({"policy_groups": z, "policy_agree_den": z.clone(), "policy_agree_num": z.clone()})
        on_row = torch.full((b, t), -1, dtype=torch.long, device=ids.device)  # chosen rows -> their group index
        if on_feats is not None:
            on_row[chosen] = torch.arange(on_feats.shape[0], device=ids.device)
        correct = torch.zeros_like(group, dtype=torch.bool)
        miss_before = torch.zeros((b, t), dtype=torch.bool, device=ids.device)  # Spec-AUF: a miss at an earlier step
        terms, steps, slot_w = [], [], []
        for k, h in enumerate(hidden):
            rows = valid[..., k] & scored[..., k]  # row j scored at step k
            logits = self.vocab_logits(h[rows])  # [m_k, N]
            tl = torch.empty((logits.shape[0], tlogits.shape[-1]), dtype=torch.float32, device=logits.device)
            own = (on_row[rows] >= 0) & (k >= 1)  # on-policy rows of this step
            off_rows = rows.clone()
            off_rows[rows] = ~own
            tl[~own] = tlogits[index[:, k:][off_rows[:, : t - k]]]
            if own.any():
                tl[own] = self.target_logits(on_feats[on_row[rows][own], k - 1].to(h.dtype))
            terms.append(divergence(logits, tl, obj.divergence))
            steps.append(torch.full((logits.shape[0],), k, dtype=torch.long, device=logits.device))
            with torch.no_grad():
                draft = self.target_to_draft(group[..., k])
                correct[..., k][rows] = logits.argmax(-1) == draft[rows]
                if obj.cut_at_first_miss:
                    slot_w.append(torch.where(miss_before[rows], float(obj.cut_weight), 1.0).float())
                    miss_before |= valid[..., k] & ~(correct[..., k] & scored[..., k])
        weights = group_position_weights(k_steps - 1, float(self.config["loss_decay"]))
        loss, kl_sum, kl_count = weighted_position_mean(torch.cat(terms), torch.cat(steps), weights,
                                                        torch.cat(slot_w) if slot_w else None)  # fmt: skip
        sums.update({"kl_sum": kl_sum, "kl_count": kl_count})
        depth = min(self.draft_depth, k_steps)
        anchors = valid[..., 0]
        sums.update(group_acceptance_sums(correct[anchors][:, :depth], valid[anchors][:, :depth])
                    if anchors.any() else empty_group_sums(depth, device=valid.device))  # fmt: skip
        return LossOutput(loss=loss, sums=sums, num_tokens=int((batch["lengths"] - 1).clamp_min(0).sum()) * k_steps)

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """Greedy chain drafting: append the n new items, then D drafter forwards, step j + 1 reading
        (argmax of step j, h of step j); the D - 1 speculative items are cropped from the cache again.

        Args:
            next_ids: [1, n] int64 x_{i+1} of the new items (accepted tokens + bonus token).
            features: [1, n, F] their target features (layers :attr:`feature_layer_ids`).
            cache: a transformers ``DynamicCache`` of the drafter's real items (updated in place).

        Returns:
            [1, D, v] float32 logits over the target vocabulary (-inf outside the draft vocabulary).
        """
        past = cache.get_seq_length()
        dtype, device = self.fc.weight.dtype, next_ids.device
        pos, mask = L.inference_layout(next_ids.shape[1], 0, dtype=dtype, past=past, device=device)
        logits, h = self.draft_step(next_ids, features, pos, mask, cache)
        rows = [self.full_vocab_logits(logits[:, -1])]  # [1, v]
        h = h[:, -1:]
        for _ in range(1, self.draft_depth):
            token = rows[-1].argmax(-1, keepdim=True)  # [1, 1] target id
            pos, mask = L.inference_layout(1, 0, dtype=dtype, past=cache.get_seq_length(), device=device)
            logits, h = self.draft_step(token, h, pos, mask, cache)
            rows.append(self.full_vocab_logits(logits[:, -1]))
        cache.crop(-(self.draft_depth - 1))  # drop the speculative items (crop(0) is a no-op)
        return torch.stack(rows, dim=1)
