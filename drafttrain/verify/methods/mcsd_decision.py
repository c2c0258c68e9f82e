"""The MCSD early-stop decision model: its features, loss, stop rule and files (MCSD-improved §3.3).

    # 1. labels from verifier runs: MCSD (W_t = 1) with the trained drafter logs, for every drafted level
    #    that was reached, the level's features and whether the target accepted it
    python -m scripts.evaluate checkpoint=RUN methods=[mcsd] mcsd.target_roots=[1] \
        mcsd.decisions_out=outputs/decisions/mt_bench.jsonl prompts=mt_bench prompt_offset=16 num_prompts=40
    # 2. train the MLP (its own entry point: no target, no drafter; config drafttrain.config.DecisionModelConfig)
    python -m scripts.train_decision_model 'data=[outputs/decisions/mt_bench.jsonl]'
    # 3. use it: MCSD stops growing the tree when the predicted acceptance of every path is below beta
    python -m scripts.evaluate checkpoint=RUN methods=[mcsd] mcsd.decision_model=outputs/decision_model/decision_model

Model: :class:`DecisionModel`, type 2 (two linear layers on the top-k
probabilities and entropy of the drafter distribution, plus the level's depth: the parallel drafter
has one distribution per level, :func:`level_features`), trained with
binary cross-entropy (:func:`decision_loss`) on hard accepted/rejected labels. The training job (step 2)
is :mod:`drafttrain.train.decision_model`; what the verifier needs (features, the stop rule, loading) is here.

Files: ``<folder>/{model.safetensors,config.json}`` (:func:`save_decision_model`, :func:`load_decision_model`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------------------------
# the model, its features and loss (§3.3)
# ---------------------------------------------------------------------------------------------
def decision_features_topk(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Type-2 decision-model input: ``ConCat(Topk(y), Ent(y))`` of a drafter distribution (§3.3).

    Args:
        probs: float [..., v], a probability distribution over the last axis.
        k: number of top probabilities.

    Returns:
        float [..., k + 1]: the k largest probabilities (descending) and the entropy in nats.
    """
    top = torch.topk(probs, k, dim=-1).values
    ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1, keepdim=True)
    return torch.cat([top, ent], dim=-1)


def soft_accept_label(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Type-1 training label ``min(1, p(x|I) / q(x|I))``: the probability that speculative sampling
    accepts x. (The paper prints ``max``; a label in [0, 1] for BCE needs ``min``.)"""
    return torch.clamp(p_target / q_draft.clamp_min(1e-30), max=1.0)


class DecisionModel(nn.Module):
    """MLP predicting whether the target accepts a drafted token (MCSD-improved §3.3).

    Type 1: drafter hidden state (``in_features = d``), three layers; type 2: top-k probabilities +
    entropy (``in_features = k + 1``, :func:`decision_features_topk`), two layers.

    Args:
        in_features: input size; hidden: hidden width; num_layers: linear layers (>= 1), ReLU between.

    Shapes: forward ``features [..., in_features] -> logits [...]`` (float).
    """

    def __init__(self, in_features: int, hidden: int = 64, num_layers: int = 2):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        dims = [in_features] + [hidden] * (num_layers - 1) + [1]
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < num_layers - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)

    @torch.no_grad()
    def accept_prob(self, features: torch.Tensor) -> torch.Tensor:
        """Predicted acceptance probability [...] = sigmoid(logits)."""
        return torch.sigmoid(self(features))


def decision_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy on accepted (1) / rejected (0) labels, or soft labels in [0, 1]
    (:func:`soft_accept_label`); mean over ``mask`` (bool, same shape) when given.

    Raises:
        ValueError: shapes differ or the mask selects nothing.
    """
    if logits.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    if mask is None:
        return loss.mean()
    if not bool(mask.any()):
        raise ValueError("mask selects no element")
    return loss[mask].mean()


def should_stop(accept_probs: torch.Tensor, beta: float = 0.4) -> bool:
    """Early stop (§3.3): True when the predicted acceptance of *every* candidate sequence is below
    beta ("if the probabilities for all sequences are lower than the threshold, draft generation will
    stop early"). An empty input stops."""
    return bool((accept_probs < beta).all())


def level_features(level_probs: torch.Tensor, k: int) -> torch.Tensor:
    """Decision-model input of each drafted level (MCSD-improved §3.3 type 2, plus the depth).

    A parallel drafter's level l has one distribution q_l for all its nodes, so the early-stop
    decision is per level: ``[top-k probabilities of q_l, entropy of q_l (nats), l]``.

    Args:
        level_probs: float [L, v], q_1..q_L. k: top-k size.

    Returns:
        float [L, k + 2].
    """
    depth = torch.arange(1, level_probs.shape[0] + 1, dtype=torch.float32, device=level_probs.device)[:, None]
    return torch.cat([decision_features_topk(level_probs.float(), k), depth], dim=-1)


# ---------------------------------------------------------------------------------------------
# files: the saved model (scripts.train_decision_model writes it, MCSD loads it)
# ---------------------------------------------------------------------------------------------
def save_decision_model(model, path: str | Path, topk: int) -> Path:
    """``model.safetensors`` + ``config.json`` (in_features, hidden, num_layers, topk) in ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    lin = [m for m in model.net if isinstance(m, torch.nn.Linear)]
    cfg = {"in_features": lin[0].in_features, "hidden": lin[0].out_features if len(lin) > 1 else 0,
           "num_layers": len(lin), "topk": int(topk)}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def load_decision_model(path: str | Path):
    """The :class:`DecisionModel` saved by :func:`save_decision_model`, in eval
    mode, with ``.topk`` (the feature size it expects is topk + 2).

    Raises:
        FileNotFoundError: no ``config.json`` / ``model.safetensors`` in ``path``.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no decision model in {path} (train one: python -m scripts.train_decision_model)")
    cfg = json.loads((path / "config.json").read_text())
    model = DecisionModel(cfg["in_features"], hidden=max(cfg["hidden"], 1), num_layers=cfg["num_layers"])
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    model.topk = int(cfg["topk"])
    return model.eval()


__all__ = ["DecisionModel", "decision_features_topk", "decision_loss", "level_features", "should_stop", "soft_accept_label",
           "save_decision_model", "load_decision_model"]
