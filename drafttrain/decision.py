"""The MCSD early-stop decision model as a training recipe (MCSD-improved §3.3).

    # 1. labels from verifier runs: MCSD (W_t = 1) with the trained drafter logs, for every drafted level
    #    that was reached, the level's features and whether the target accepted it
    python -m scripts.evaluate checkpoint=RUN methods=[mcsd] mcsd.target_roots=[1] \
        mcsd.decisions_out=outputs/decisions/mt_bench.jsonl prompts=mt_bench prompt_offset=16 num_prompts=40
    # 2. train the MLP
    accelerate launch --config_file conf/accelerate/cpu.yaml train.py +recipe=decision_model \
        decision.data=[outputs/decisions/mt_bench.jsonl]
    # 3. use it: MCSD stops growing the tree when the predicted acceptance of every path is below beta
    python -m scripts.evaluate checkpoint=RUN methods=[mcsd] mcsd.decision_model=outputs/decision_model/decision_model

Model: :class:`~drafttrain.verify.mcsd.DecisionModel`, type 2 (two linear layers on the top-k
probabilities and entropy of the drafter distribution, plus the level's depth: the parallel drafter
has one distribution per level, :func:`~drafttrain.verify.methods.level_features`), trained with
binary cross-entropy (:func:`~drafttrain.verify.mcsd.decision_loss`) on hard accepted/rejected labels.
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

log = logging.getLogger(__name__)

MODEL_DIR = "decision_model"


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
    """The :class:`~drafttrain.verify.mcsd.DecisionModel` saved by :func:`save_decision_model`, in eval
    mode, with ``.topk`` (the feature size it expects is topk + 2).

    Raises:
        FileNotFoundError: no ``config.json`` / ``model.safetensors`` in ``path``.
    """
    from safetensors.torch import load_file

    from drafttrain.verify.mcsd import DecisionModel

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no decision model in {path} (train one: train.py +recipe=decision_model)")
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
    """Train the decision model described by ``c.decision`` (a validated :class:`~drafttrain.config.TrainConfig`).

    Returns:
        The final metrics (also in ``<output_dir>/final_metrics.json``).

    Raises:
        FileNotFoundError / ValueError: see :func:`read_decisions`.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from drafttrain.verify.mcsd import DecisionModel, decision_loss

    d = c.decision
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
            acc.init_trackers(c.logging.wandb_project, config={"decision": dict(vars(d)), "seed": c.seed},
                              init_kwargs={"wandb": {"name": c.run_name, "dir": str(out)}})  # fmt: skip
    t0 = time.time()
    metrics_f = (out / "metrics.jsonl").open("w") if acc.is_main_process else None
    step = 0
    for epoch in tqdm(range(d.epochs), desc="decision model", disable=not c.trainer.progress):
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


__all__ = ["read_decisions", "train_decision_model", "save_decision_model", "load_decision_model"]
