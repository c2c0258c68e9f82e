"""The part EAGLE and both ParallelSpec drafters share: items fc([e(x_{i+1}); f_i]) -> one decoder layer.

docs/design.md, "Definitions": drafter item i combines the target's last hidden state f_i and the embedding of
the token x_{i+1} it produced, u_i = fc([e(x_{i+1}); f_i]) (EAGLE, Li et al. 2024, section 4.1; ParallelSpec
Eq. 4's pi(f~_t | f_<t, e_<t)). One decoder layer of the target's own class and hyper-parameters runs
over the items with explicit position ids and an additive 4D mask; the target's final norm and LM head,
shared and frozen, turn its outputs into predicted features f^ = norm(h) and logits = head(f^).

Deviation from EAGLE's released code, on purpose: there the layer's raw output is the predicted
feature. Here it goes through the target's frozen final norm first. The target's own last layer is
followed by that norm, so a drafter layer initialised as a copy of it (``init_from_target_layer``)
starts from the target's computation, and f^ lives in the same (post-norm) space as the f it regresses
and as the features the items read. The head then sees exactly what the target's head sees.

Shape letters: b batch, q new inputs, kv keys, t items, d hidden, N draft vocab.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from drafttrain.target import families
from drafttrain.attention import implementation_for
from drafttrain.drafters.base import Drafter, SharedTargetModules


@torch.no_grad()
def init_fresh_(module: nn.Module, std: float) -> None:
    """A fresh init of a decoder layer built outside ``from_pretrained`` (whose ``torch.empty`` parameters,
    such as gpt-oss's attention sinks or an MoE layer's expert tensors, would otherwise hold whatever memory
    held): every tensor of 2+ dims ~ N(0, std), other non-norm parameters (biases, sinks) 0; norms keep
    the values their class starts from (ones, or zeros for Gemma's ``x * (1 + w)``)."""
    norms = {id(p) for m in module.modules() if "norm" in type(m).__name__.lower() for p in m.parameters(recurse=False)}
    for p in module.parameters():
        if id(p) in norms:
            continue
        if p.dim() >= 2:
            p.normal_(0.0, std)
        else:
            p.zero_()


class FeatureLayerDrafter(Drafter):
    """fc (d + feature width -> d; 2d -> d for one feature layer) + one decoder layer (+ its rotary embedding) over drafter items; no loss of its own.

    Subclasses build their extra parameters, then call ``_init_draft_vocab``, ``reset_parameters`` (when
    ``init_weights``) and ``_finish``. Reads config keys ``fc_bias`` and ``feature_noise`` (when declared).
    """

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules):
        super().__init__(config, shared)
        mcfg = copy.deepcopy(shared.model_config)
        if getattr(mcfg, "_attn_implementation", None) not in ("sdpa", "eager"):
            mcfg._attn_implementation = "sdpa"  # float 4D masks: sdpa or eager only (docs/design.md, "Platform notes")
        d = mcfg.hidden_size
        # items read [e(x_{i+1}); f_i]: d + the declared features' width (len(feature_layers) * d)
        self.fc = nn.Linear(d + self.feature_dim, d, bias=bool(self.config["fc_bias"]))
        self.layer, self.rotary = families.target_class_layer(shared, mcfg, f"drafter {type(self).__name__}")

    def _finish(self) -> None:
        """Move to the target's dtype and device (last step of a subclass ``__init__``)."""
        self.to(dtype=self.shared.embed_tokens.weight.dtype, device=self.shared.embed_tokens.weight.device)

    # -- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def _reset_fc(self) -> None:
        """fc starts as [noise | I] (u_i ~ f_i: the identity on the feature; with several feature layers, on
        the last declared one) with N(0, 0.02) noise."""
        std = getattr(self.shared.model_config, "initializer_range", 0.02)
        d = self.fc.out_features
        self.fc.weight.normal_(0.0, std)
        self.fc.weight[:, -d:] += torch.eye(d, dtype=self.fc.weight.dtype)
        if self.fc.bias is not None:
            self.fc.bias.zero_()

    @torch.no_grad()
    def _reset_layer(self, from_target: bool) -> None:
        """The layer is a copy of the target's last decoder layer, or a fresh N(0, 0.02) init of its linears."""
        std = getattr(self.shared.model_config, "initializer_range", 0.02)
        if from_target:
            self.layer.load_state_dict(self.shared.decoder_layer.state_dict())
        else:
            init_fresh_(self.layer, std)

    # -- building blocks ------------------------------------------------------------------------
    def items(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """u = fc([e(x_{i+1}); f_i]).

        Args:
            next_ids: [b, t] int64 target token ids x_{i+1} of each item.
            features: [b, t, d] the target's last hidden states f_i (or predicted features f^).

        Returns:
            [b, t, d] items in the drafter's dtype.
        """
        e = self.shared.embed_tokens(next_ids).to(self.fc.weight.dtype)
        return self.fc(torch.cat([e, features.to(self.fc.weight.dtype)], dim=-1))

    def noisy(self, features: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training inputs: f + U(-a, a) noise, a = ``feature_noise`` (EAGLE section 4.2), only in train mode.

        EAGLE's released code draws U(-0.1, 0.1) * 512 / sequence length; the paper's U(-0.1, 0.1) is used
        here (a = 0.1 by default), for every sequence length. The regression targets stay clean.

        Args:
            features: [b, t, d]; generator: CPU RNG (deterministic noise), None = torch's global RNG.

        Returns:
            [b, t, d] (the input itself when a = 0 or in eval mode).
        """
        a = float(self.config.get("feature_noise", 0.0))
        if not self.training or a <= 0:
            return features
        # drawn on the CPU on purpose: the same noise for a seed on every device, then moved
        u = torch.rand(features.shape, generator=generator, dtype=torch.float32, device="cpu")
        return features + ((u * 2 - 1) * a).to(device=features.device, dtype=features.dtype)

    def decode(self, x, attention_mask, position_ids, cache=None, use_cache=False) -> torch.Tensor:
        """The decoder layer over inputs x [b, q, d] with an additive mask [b, 1, q, kv] (or a flex ``BlockMask``
        of that shape: :mod:`drafttrain.attention`) and positions [b, q].

        With a transformers ``Cache`` in ``cache`` and ``use_cache``, the q new keys/values are
        appended to it (kv = cached + q). Returns the layer's hidden states [b, q, d] (pre-norm).
        """
        pos_emb = families.rotary_embeddings(self.rotary, x, position_ids, self.layer)
        with implementation_for(self.layer.self_attn.config, attention_mask):
            return self.layer(
                x,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=pos_emb,
            )

    def predict_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features f^ = the target's frozen final norm of the layer output: [..., d] -> [..., d]."""
        return self.shared.final_norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shared frozen final norm + LM head rows of the draft vocabulary: [..., d] -> [..., N] float32."""
        return self.vocab_logits(self.predict_features(hidden))

    # -- lower-level inference (tree / batched proposers) ----------------------------------------
    def forward_inputs(self, x, position_ids, attention_mask, cache=None):
        """One drafter forward over arbitrary input vectors with explicit positions, mask and cache.

        Args:
            x: [b, q, d] drafter inputs: items from :meth:`items` and/or learned vectors (e.g. ParallelSpec's
                ``mask_embed[j - 1]`` for mask slot j).
            position_ids: [b, q] int64.
            attention_mask: [b, 1, q, kv] additive float mask (0 / finfo.min) in the drafter's dtype,
                kv = cached entries + q (build with :func:`drafttrain.layout.additive_mask`).
            cache: a transformers ``Cache`` holding the drafter's past keys/values, appended to in place
                (remove speculative entries afterwards with ``cache.crop(-count)``), or None.

        Returns:
            (logits [b, q, N] float32 over the draft vocabulary (map ids with ``draft_token_ids`` or
            :meth:`full_vocab_logits`), predicted features f^ [b, q, d]).
        """
        h = self.decode(x, attention_mask, position_ids, cache=cache, use_cache=cache is not None)
        f = self.predict_features(h)
        return self.vocab_logits(f), f

    def draft_inputs(self) -> torch.Tensor:
        """Learned input vectors that follow the new items in one parallel drafting forward (ParallelSpec:
        its K [MASK] inputs), [k, d]; none here ([0, d]: an autoregressive drafter drafts from its items)."""
        return self.fc.weight.new_zeros((0, self.fc.out_features))

    def kv_cache_shape(self) -> tuple[int, int]:
        """(key/value heads, head dim) of this drafter's one decoder layer: what a KV cache for its batched
        drafting needs (the verifier's proposers build it, :func:`drafttrain.verify.proposers.drafter_kv_cache`)."""
        attn = self.layer.self_attn
        return int(attn.config.num_key_value_heads), int(attn.head_dim)

    def draft_step(self, next_ids, features, position_ids, attention_mask, cache=None):
        """:meth:`forward_inputs` over the items (next_ids [b, q] int64, features [b, q, d]): the EAGLE step.

        Returns (logits [b, q, N] float32, predicted features [b, q, d]); see :meth:`forward_inputs`.
        """
        return self.forward_inputs(self.items(next_ids, features), position_ids, attention_mask, cache)
