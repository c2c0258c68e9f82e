"""The training run's own evaluation, run again on its saved drafter: ``python -m scripts.evaluate preset=training``.

A training run ends with :func:`drafttrain.eval.in_training.spec_eval` (``trainer.spec_eval.*`` of its config: the
prompts, the draft tree with SSSD's candidates from a datastore over its own training answers, the
lock-step batch-16 and batch-1 timings against plain decoding). :func:`training_eval` runs exactly that
evaluation, through the same function, on a finished run folder: the run's saved config (validated as it
was), its target, its saved drafter (packed for inference, as the run's final evaluation does) and, when
the trees take SSSD candidates from the data, the datastore over its training answers that the run saved
(``eval_datastore/``; a run older than that folder has its training data rebuilt instead). ``eval/tau`` (the full tree's acceptance length) and the outputs are reproduced exactly; the
speedups are timings of this host at this moment.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


def training_eval(run: str | Path, output_dir: str | Path | None = None, num_threads: int | None = None) -> dict[str, Any]:
    """The in-training evaluation of the run folder ``run`` (``config.json`` + ``drafter/``).

    Args:
        run: a finished training run folder.
        output_dir: where ``eval_outputs.jsonl`` and ``eval_metrics.json`` (the returned metrics, the planner's
            decisions per batch size among them, and the host's description) go (default ``<run>/eval_preset``).
        num_threads: torch threads (default the run's ``trainer.num_threads``, else torch's default).

    Returns:
        spec_eval's metrics (``eval/tau``, ``eval/greedy_equal``, ``eval/speedup_b16``, ``eval/speedup_b1``, ...).

    Raises:
        FileNotFoundError: ``run`` has no ``config.json`` or no ``drafter/``.
    """
    import torch

    from drafttrain.config import upgrade_saved
    from drafttrain.compose import build_run
    from drafttrain.eval.in_training import spec_eval
    from drafttrain.validation import validate

    run = Path(run)
    if not (run / "config.json").is_file() or not (run / "drafter").is_dir():
        raise FileNotFoundError(f"{run} is not a finished training run folder (config.json + drafter/)")
    c = validate(upgrade_saved(json.loads((run / "config.json").read_text())))
    threads = num_threads or c.trainer.num_threads
    if threads:
        torch.set_num_threads(int(threads))
    out = Path(output_dir) if output_dir else run / "eval_preset"
    out.mkdir(parents=True, exist_ok=True)
    c = dataclasses.replace(c, output_dir=str(out), trainer=dataclasses.replace(c.trainer, progress=False))
    built = build_run(c, drafter=run / "drafter")  # the saved drafter packed for inference, as the run's final eval
    target, drafter = built.target, built.drafter
    metrics = spec_eval(c, target, drafter, run_train_data(c, run, target, drafter), datastore=run_datastore(c, run))
    from drafttrain import host
    from drafttrain.atomic import atomic_write_text

    atomic_write_text(out / "eval_metrics.json", json.dumps({"run": str(run), "host": host.describe(), "metrics": metrics},
                                                            indent=1, default=str))  # fmt: skip
    return metrics


def run_datastore(c, run: Path):
    """The SSSD datastore the run's final evaluation used, as it saved it (``<run>/eval_datastore``,
    :func:`drafttrain.eval.in_training.training_datastore`); None when its evaluation uses none, or the run predates
    that folder (:func:`run_train_data` then rebuilds its training data)."""
    from drafttrain.eval.in_training import EVAL_DATASTORE, uses_datastore
    from drafttrain.verify.methods.sssd_datastore import Datastore

    if not uses_datastore(c) or not (run / EVAL_DATASTORE).is_dir():
        return None
    return Datastore.load(run / EVAL_DATASTORE)


def run_train_data(c, run: Path, target, drafter):
    """The training rows of a run that saved no ``eval_datastore`` (runs older than it): rebuilt by
    :func:`drafttrain.data.pipeline.prepare_data` (its self-distillation cache when still there, else generated
    again). None when the run saved its datastore or its evaluation uses none."""
    from drafttrain.eval.in_training import EVAL_DATASTORE, uses_datastore

    if not uses_datastore(c) or (run / EVAL_DATASTORE).is_dir():
        return None
    import logging

    from accelerate import Accelerator

    from drafttrain.data.pipeline import prepare_data

    logging.getLogger(__name__).warning("%s has no %s/ (a run older than it): rebuilding its training data for SSSD's "
                                        "datastore", run, EVAL_DATASTORE)  # fmt: skip
    return prepare_data(c, target, Accelerator(cpu=True), tuple(drafter.feature_layers))[0]
