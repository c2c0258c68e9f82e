"""The MCSD early-stop decision model and its training job (MCSD-improved §3.3).

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
binary cross-entropy (:func:`decision_loss`) on hard accepted/rejected labels.
The run reports held-out accuracy, the base rate, and, at the threshold beta, how many reached levels
the model would have cut and how many of those the target would in fact have rejected.

Files: ``<output_dir>/decision_model/{model.safetensors,config.json}``, ``metrics.jsonl``,
``final_metrics.json``; W&B offline run with ``decision/*`` scalars when ``logging.wandb``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MODEL_DIR = "decision_model"


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
# data, files, training (the scripts.train_decision_model job)
# ---------------------------------------------------------------------------------------------


def read_decisions(paths: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Rows ``{"features": [...], "label": 0|1}`` from jsonl files; malformed rows are counted and skipped.

    Returns:
        (features float32 [N, F], labels float32 [N], counts {"read", "kept", "skipped"}).

    Raises:
        FileNotFoundError: a path does not exist. ValueError: no usable row, or feature sizes differ.
    """
    feats, labels, read, skipped, width = [], [], 0, 0, None
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no decision log at {path} (write one with scripts.evaluate mcsd.decisions_out=...)")
        with path.open() as f:
            for line in f:
                if not line.strip():
                    continue
                read += 1
                try:
                    row = json.loads(line)
                    x = [float(v) for v in row["features"]]
                    y = int(row["label"])
                    if y not in (0, 1) or not all(math.isfinite(v) for v in x):
                        raise ValueError("bad label or feature")
                except (ValueError, KeyError, TypeError):
                    skipped += 1
                    continue
                if width is None:
                    width = len(x)
                if len(x) != width:
                    raise ValueError(f"{path}: rows have {len(x)} features, earlier rows {width}")
                feats.append(x)
                labels.append(float(y))
    if not feats:
        raise ValueError(f"no usable decision rows in {paths} ({read} read, {skipped} malformed)")
    if skipped:
        log.warning("skipped %d malformed decision rows of %d", skipped, read)
    return torch.tensor(feats), torch.tensor(labels), {"read": read, "kept": len(feats), "skipped": skipped}


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


def _stop_stats(prob: torch.Tensor, labels: torch.Tensor, beta: float) -> dict[str, float]:
    cut = prob < beta
    n_cut = int(cut.sum())
    return {
        "cut_fraction": n_cut / max(labels.numel(), 1),  # reached levels the model would not have grown
        "cut_precision": float((labels[cut] == 0).float().mean()) if n_cut else float("nan"),  # of those, rejected anyway
        "accepted_lost_fraction": float((cut & (labels == 1)).sum()) / max(int((labels == 1).sum()), 1),
    }


def train_decision_model(c) -> dict[str, Any]:
    """Train the decision model described by ``c`` (a validated :class:`~drafttrain.config.DecisionModelConfig`).

    Returns:
        The final metrics (also in ``<output_dir>/final_metrics.json``).

    Raises:
        FileNotFoundError / ValueError: see :func:`read_decisions`.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from drafttrain.config import to_dict

    d = c
    os.environ.setdefault("WANDB_MODE", c.logging.wandb_mode)
    out = Path(c.output_dir)
    acc = Accelerator(cpu=True, log_with="wandb" if c.logging.wandb else None, project_dir=str(out))
    set_seed(c.seed)
    x, y, counts = read_decisions(list(d.data))
    topk = x.shape[1] - 2
    if topk < 1:
        raise ValueError(f"decision features must be top-k + entropy + depth (>= 3 values), got {x.shape[1]}")
    g = torch.Generator().manual_seed(c.seed)
    perm = torch.randperm(len(y), generator=g)
    n_held = max(1, int(round(d.heldout_fraction * len(y)))) if len(y) > 1 else 0
    held, train = perm[:n_held], perm[n_held:]
    model = DecisionModel(x.shape[1], hidden=d.hidden, num_layers=d.num_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=d.lr, weight_decay=0.0)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if c.logging.wandb:
            acc.init_trackers(c.logging.wandb_project, config={"decision": to_dict(c), "seed": c.seed},
                              init_kwargs={"wandb": {"name": c.run_name, "dir": str(out)}})  # fmt: skip
    t0 = time.time()
    metrics_f = (out / "metrics.jsonl").open("w") if acc.is_main_process else None
    step = 0
    for epoch in tqdm(range(d.epochs), desc="decision model", disable=not c.progress):
        model.train()
        order = train[torch.randperm(len(train), generator=g)]
        total = 0.0
        for i in range(0, len(order), d.batch_size):
            idx = order[i : i + d.batch_size]
            loss = decision_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            step += 1
        model.eval()
        with torch.no_grad():
            p = torch.sigmoid(model(x[held])) if n_held else torch.zeros(0)
            held_loss = float(decision_loss(model(x[held]), y[held])) if n_held else float("nan")
        row = {"epoch": epoch + 1, "step": step, "decision/train_loss": total / max(len(train), 1),
               "decision/heldout_loss": held_loss,
               "decision/heldout_accuracy": float(((p >= 0.5).float() == y[held]).float().mean()) if n_held else float("nan")}  # fmt: skip
        if metrics_f:
            metrics_f.write(json.dumps(row) + "\n")
        acc.log({k: v for k, v in row.items() if k.startswith("decision/")}, step=epoch + 1)
    base = float(y[held].mean()) if n_held else float("nan")
    final = {**row, **counts, "heldout_rows": n_held, "heldout_accept_rate": base,
             "heldout_majority_accuracy": max(base, 1 - base) if n_held else float("nan"), "beta": d.beta,
             **{f"heldout_{k}": v for k, v in _stop_stats(p, y[held], d.beta).items()},
             "features": x.shape[1], "topk": topk, "seconds": round(time.time() - t0, 2)}  # fmt: skip
    if acc.is_main_process:
        metrics_f.close()
        save_decision_model(model, out / MODEL_DIR, topk)
        (out / "final_metrics.json").write_text(json.dumps(final, indent=1))
        print(f"[drafttrain] decision model: held-out accuracy {final['decision/heldout_accuracy']:.3f} "
              f"(majority {final['heldout_majority_accuracy']:.3f}); saved {out / MODEL_DIR}", flush=True)  # fmt: skip
    acc.end_training()
    return final


__all__ = ["DecisionModel", "decision_features_topk", "decision_loss", "level_features", "should_stop", "soft_accept_label",
           "read_decisions", "train_decision_model", "save_decision_model", "load_decision_model"]
