"""Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM inference acceleration framework with multiple
decoding heads", section 2.1.1 and 2.3.1; ParallelSpec paper Eq. 2).

K heads read the frozen target's last hidden state f_t (post final norm, the input of its LM head).
Head k (k = 1..K) is a residual SiLU block followed by its own LM head,

    p_t^(k) = softmax(W_k (f_t + SiLU(A_k f_t + c_k))),

and predicts x_{t+k+1}: the target's own head on f_t gives x_{t+1} (at inference: the bonus token of a
verification step), head 1 the token after it, and so on. As in Medusa, A_k starts at zero (the block is
the identity) and W_k starts as a copy of the target's LM head, so every head starts by predicting the
target's next token. Training loss (Eq. 2): sum_k lambda_k CE(p_t^(k), x_{t+k+1}), lambda_k = decay**k
(Medusa's 0.8**k by default), each term averaged over its labelled positions.

Draft vocabulary (``draft_vocab_size`` = N > 0): W_k holds only the target head's rows of the N draft
token ids (``draft_token_ids``), copied from the target's rows, instead of all v rows. K full copies of
SmolLM2-135M's 49152 x 576 head would be 4 x 28.3M trainable parameters whose matmuls dominate a CPU step;
with N = 8192 a head is 4.7M. Labels outside the draft vocabulary are left out of the loss and count as
misses in the metrics, as for the other drafters. N = 0 keeps Medusa's full-vocabulary heads.

Shape letters: b batch, t items (positions with a feature), K heads, d hidden, v vocab, N draft vocab.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain import layout as L
from drafttrain.drafters.base import LAST_LAYER, Drafter, DrafterSpec, LossOutput, SharedTargetModules
from drafttrain.losses import group_position_weights, parallel_group_loss
from drafttrain.metrics import empty_group_sums, group_acceptance_sums


class MedusaHead(nn.Module):
    """One Medusa-1 head: ResBlock h = f + SiLU(A f + c), then its own LM head W (no bias): [..., d] -> [..., N]."""

    def __init__(self, hidden_size: int, vocab_rows: int):
        super().__init__()
        self.res = nn.Linear(hidden_size, hidden_size)  # A, c
        self.out = nn.Linear(hidden_size, vocab_rows, bias=False)  # W

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(features + F.silu(self.res(features)))


class MedusaDrafter(Drafter):
    """Medusa-1 heads on the frozen target's last hidden state.

    Config keys: ``num_heads`` (K, default 4), ``loss_decay`` (lambda_k = decay**k for head k = 1..K,
    default 0.8), ``draft_vocab_size`` (see the module docstring), ``kd_weight`` (mix of the target's soft
    distribution into each CE term; the target's logits for x_{t+k+1} are LM head(f_{t+k}), read from
    the batch's features).

    Trainable parameters: K x (d x d + d + N x d).

    Inference: :meth:`propose` for chains (K rows); :meth:`head_logits` gives every head's draft-vocabulary
    logits from any feature, for tree proposers (Medusa's top-k per head, Cartesian tree).
    """

    name = "medusa"
    serving_formats = {"vllm_medusa": "medusa"}
    objective_refusal = ("Medusa heads read only the target's last state f_t: no draft ever enters their inputs and "
                         "they have no group layout for the target to label; train Medusa offline")
    spec = DrafterSpec(drafting="parallel", feature_layers=(LAST_LAYER,), step_input="last", batched=False)
    defaults = {"num_heads": 4, "loss_decay": 0.8, "draft_vocab_size": 0, "kd_weight": 0.0}

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        super().__init__(config, shared)
        self.num_heads = int(self.config["num_heads"])
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        self._init_draft_vocab(self.config["draft_vocab_size"])
        d = shared.model_config.hidden_size
        self.heads = nn.ModuleList(MedusaHead(d, self.d2t.numel()) for _ in range(self.num_heads))
        self.weights = group_position_weights(self.num_heads, float(self.config["loss_decay"]))[1:]  # lambda_1..K
        if init_weights:
            self.reset_parameters()
        self.to(dtype=shared.embed_tokens.weight.dtype, device=shared.embed_tokens.weight.device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A_k = 0, c_k ~ U(+-1/sqrt(d)) (nn.Linear's bias init, as in Medusa), W_k = the target head's draft rows."""
        d = self.heads[0].res.in_features
        for head in self.heads:
            head.res.weight.zero_()
            head.res.bias.uniform_(-1 / math.sqrt(d), 1 / math.sqrt(d))
        self._copy_target_rows()

    @torch.no_grad()
    def _copy_target_rows(self) -> None:
        rows = self.shared.lm_head.weight[self.draft_token_ids.to(self.shared.lm_head.weight.device)]  # [N, d]
        for head in self.heads:
            head.out.weight.copy_(rows.to(head.out.weight))

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Set the draft vocabulary (see :meth:`Drafter.set_draft_vocab`) and re-initialise every head's W_k
        from the target's rows of the new ids: call it before training, never on a trained drafter."""
        super().set_draft_vocab(token_ids)
        self._copy_target_rows()

    @property
    def draft_depth(self) -> int:
        """K: head k drafts depth k (the bonus token itself comes from the target's head)."""
        return self.num_heads

    # -- building blocks ------------------------------------------------------------------------
    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Every head's logits from target features: [..., d] -> [..., K, N] float32 (draft vocabulary).

        Row k - 1 is head k, which guesses the k-th token after the token the target's head produces
        from the same feature. Map draft ids to target ids with ``draft_token_ids`` or :meth:`full_vocab_logits`.
        """
        f = features.to(self.heads[0].out.weight.dtype)
        return torch.stack([head(f) for head in self.heads], dim=-2).float()

    # -- training -------------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        """Eq. 2 over every position of a batch (all positions are used in train and eval mode alike).

        Batch keys: ``input_ids`` [b, L] int64 (right-padded), ``loss_mask`` [b, L], ``lengths`` [b],
        ``features`` [b, L-1, d] (f_0..f_{L-2}). Position i (feature f_i) trains head k on x_{i+k+1}
        = y_{i+k-1} (:func:`drafttrain.layout.shifted_labels`). The group of position i for acc_k /
        tau_sim is heads 1..K (group position k - 1 = head k): the chain a verification step checks.
        """
        ids, feats = batch["input_ids"], batch["features"]
        t = ids.shape[1] - 1
        k = self.num_heads
        labels = L.batch_item_labels(ids, batch["loss_mask"], batch["lengths"])  # [b, t]
        group = L.shifted_labels(labels, k)  # [b, t, K]: head k+1's label at each position
        valid = group != L.IGNORE_INDEX
        draft = self.target_to_draft(group)
        sel = valid & (draft >= 0)  # [b, t, K]
        f = feats[:, :t]
        kd = float(self.config["kd_weight"])
        logits, lab, pos, t_logits = [], [], [], []
        for j, head in enumerate(self.heads):
            s = sel[..., j]  # [b, t]
            logits.append(head(f[s].to(head.out.weight.dtype)).float())  # [m_j, N]
            lab.append(draft[..., j][s])
            pos.append(torch.full_like(lab[-1], j))
            if kd > 0:  # the target's distribution of x_{i+j+2} is LM head(f_{i+j+1}) (valid labels: i+j+1 < t)
                t_logits.append(self.target_logits(_shift_rows(feats, j + 1, t)[s]))
        loss, ce_sum, ce_count = parallel_group_loss(torch.cat(logits), torch.cat(lab), torch.cat(pos), self.weights,
                                                     torch.cat(t_logits) if kd > 0 else None, kd)  # fmt: skip
        # out-of-vocabulary labels stay valid for the metrics: the heads can never propose them
        correct = torch.zeros_like(valid)
        for j, lg in enumerate(logits):
            correct[..., j][sel[..., j]] = lg.argmax(-1) == lab[j]
        rows = valid.any(-1)  # [b, t] positions with at least one labelled head
        sums = {"ce_sum": ce_sum, "ce_count": ce_count}
        if rows.any():
            sums.update(group_acceptance_sums(correct[rows], valid[rows]))
        else:
            sums.update(empty_group_sums(k, device=valid.device))
        return LossOutput(loss=loss, sums=sums, num_tokens=int((batch["lengths"] - 1).clamp_min(0).sum()))

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache=None) -> torch.Tensor:
        """Chain drafting: the K heads on the last item's feature (Medusa has no drafter cache).

        Args:
            next_ids: [1, n] int64 x_{i+1} of the new items (unused: heads read the feature only).
            features: [1, n, d] target features f_i; only the last one is read.
            cache: ignored (accepted for the common interface).

        Returns:
            [1, K, v] float32 logits over the target vocabulary (-inf outside a restricted draft
            vocabulary): row j guesses the (j + 1)-th token after the last item's x_{i+1}.
        """
        return self.full_vocab_logits(self.head_logits(features[:, -1]))  # [1, K, v]


def _shift_rows(feats: torch.Tensor, shift: int, t: int) -> torch.Tensor:
    """feats[:, i + shift] for i in 0..t-1 (zeros past the end): [b, T, d] -> [b, t, d]."""
    b, T, d = feats.shape
    out = feats.new_zeros((b, t, d))
    n = max(min(t, T - shift), 0)
    out[:, :n] = feats[:, shift : shift + n]
    return out
