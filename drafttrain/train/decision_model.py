"""The MCSD early-stop decision model's training job (``python -m scripts.train_decision_model``; MCSD-improved §3.3).

Reads the decision rows that MCSD runs log (``scripts.evaluate ... mcsd.decisions_out=FILE``: per reached
level, its features and whether the target accepted it), trains :class:`~drafttrain.verify.methods.mcsd_decision.DecisionModel`
with :func:`~drafttrain.verify.methods.mcsd_decision.decision_loss` on a held-out split, and reports held-out
accuracy, the base rate and, at the threshold beta, how many reached levels the model would have cut and how
many of those the target would in fact have rejected. No target and no drafter load: the model is a small MLP
on logged features, so it is trained here and not in the drafter loop (:mod:`drafttrain.train`).

Files: ``<output_dir>/decision_model/{model.safetensors,config.json}`` (what ``mcsd.decision_model`` loads),
``metrics.jsonl``, ``final_metrics.json``; a W&B offline run with ``decision/*`` scalars when ``logging.wandb``.
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

from drafttrain.verify.methods.mcsd_decision import DecisionModel, decision_loss, save_decision_model

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
