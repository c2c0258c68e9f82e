"""Composition: the target, the drafter and the engine of a run, built from its config in one place.

Training, evaluation, export and every script build what they run through :func:`build_run`, so the
choices that decide speed and numerics (the target's dtype, device, ``fast_linear`` packing, a drafter
packed like its target) are made here once, not once per caller. A caller that deliberately measures
something else (a benchmark's fp32 target, or one with ``fast_linear`` off) says so with an argument.

- :func:`build_run`: a :class:`Run` (target; drafter when asked; :meth:`Run.engine` builds engines on it).
- :func:`drafter_dir`: the drafter folder of a checkpoint (a training run folder or the drafter folder).
- :func:`inference_drafter`: a drafter ready to draft (loaded or fresh, in eval mode, packed like the target).

Layer: above the target, the drafters, the verifier and generation; below export, eval and train.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafttrain.config import TargetConfig

__all__ = ["Run", "build_run", "drafter_dir", "inference_drafter", "target_config"]


def drafter_dir(checkpoint: str | Path) -> Path:
    """The drafter folder of ``checkpoint``: the folder itself when it holds ``drafter_config.json``, else its
    ``drafter/`` (a training run folder).

    Raises:
        FileNotFoundError: neither ``checkpoint/drafter_config.json`` nor ``checkpoint/drafter/drafter_config.json``.
    """
    from drafttrain.drafters.base import DRAFTER_CONFIG

    ckpt = Path(checkpoint).expanduser()
    for d in (ckpt, ckpt / "drafter"):
        if (d / DRAFTER_CONFIG).is_file():
            return d
    raise FileNotFoundError(f"no drafter checkpoint in {ckpt} (expected drafter/{DRAFTER_CONFIG} or {DRAFTER_CONFIG})")


def inference_drafter(target, ddir: str | Path | None, untrained_config: dict | None = None, seed: int = 0,
                      pack: bool = True):  # fmt: skip
    """A drafter ready to draft: ``Drafter.from_pretrained(ddir)`` in eval mode, or (``ddir`` None) a fresh
    ParallelSpec drafter built from ``untrained_config`` (``{}``: the class defaults) under ``torch.manual_seed(seed)``;
    with ``pack``, on prepacked weights when the target is (:meth:`~drafttrain.drafters.base.Drafter.pack_for_inference`).

    Raises:
        FileNotFoundError: ``ddir`` holds no drafter.
    """
    from drafttrain.drafters import Drafter, build_drafter

    if ddir is not None:
        drafter = Drafter.from_pretrained(Path(ddir), target).eval()
    else:
        torch.manual_seed(seed)
        drafter = build_drafter("parallelspec", dict(untrained_config or {}), target).eval()
    if pack:
        drafter.pack_for_inference()  # inference only: prepacked like the target (target.fast_linear)
    return drafter


def target_config(config: Any, dtype: str | None = None, fast_linear: str | None = None) -> TargetConfig:
    """The :class:`TargetConfig` of ``config`` (a TargetConfig, or any config with a ``target`` section: a
    training, evaluation or script config), with ``dtype`` / ``fast_linear`` replaced where given.

    Raises:
        TypeError: ``config`` is neither a TargetConfig nor has a TargetConfig ``target``.
    """
    tcfg = config if isinstance(config, TargetConfig) else getattr(config, "target", None)
    if not isinstance(tcfg, TargetConfig):
        raise TypeError(f"build_run needs a TargetConfig or a config with a TargetConfig `target`, got "
                        f"{type(config).__name__}")  # fmt: skip
    changes = {k: v for k, v in (("dtype", dtype), ("fast_linear", fast_linear)) if v is not None}
    return dataclasses.replace(tcfg, **changes) if changes else tcfg


@dataclass
class Run:
    """What :func:`build_run` built: the frozen ``target`` (:class:`~drafttrain.target.Target`) and the
    ``drafter`` (None unless one was asked for)."""

    target: Any
    drafter: Any = None

    def engine(self, proposer=None, **kwargs):
        """A :class:`~drafttrain.verify.engine.SpecEngine` on the run's target. ``proposer`` None: the
        drafter's default proposer (:func:`~drafttrain.verify.proposers.proposer_for`), or plain decoding
        where the run has no drafter. ``kwargs``: SpecEngine's (batch_size, max_new_tokens, mode, ...)."""
        from drafttrain.verify.engine import SpecEngine
        from drafttrain.verify.proposers import PlainProposer, proposer_for

        if proposer is None:
            proposer = proposer_for(self.drafter) if self.drafter is not None else PlainProposer()
        return SpecEngine(self.target, proposer, **kwargs)


def build_run(config: Any, *, device: torch.device | str = "cpu", dtype: str | None = None,
              fast_linear: str | None = None, target=None, drafter: str | Path | None = None,
              untrained_drafter: dict | None = None, seed: int = 0, pack: bool = True) -> Run:  # fmt: skip
    """Build the target (and the drafter when asked) of a run from its config.

    Args:
        config: a :class:`TargetConfig`, or a config with one as ``target`` (TrainConfig, EvalConfig, a
            script's); unused (may be None) where ``target`` is given.
        device: where the target goes; ``"auto"``: CUDA when torch sees a device, else the CPU.
        dtype / fast_linear: replace the config's (``"float32"``; ``"off"``): a benchmark that measures
            the target unpacked or in fp32 says so here.
        target: an already loaded target to reuse (``config``, ``device``, ``dtype``, ``fast_linear`` unused).
        drafter: a checkpoint (training run folder or drafter folder): its drafter, in eval mode
            (:func:`inference_drafter`).
        untrained_drafter: with no ``drafter``, the config of a fresh ParallelSpec drafter (``{}``: the class
            defaults), initialised under ``seed``. Neither: no drafter.
        pack: the drafter on prepacked weights when the target is (inference only).

    Returns:
        A :class:`Run`: ``target``, ``drafter`` (or None); ``run.engine(proposer, **kw)`` builds engines.

    Raises:
        TypeError: ``config`` has no TargetConfig. FileNotFoundError: no drafter in ``drafter``; a
        ``target.path`` that is not a model folder. MissingAssetError: the packaged model is not installed.
        ValueError: an unknown ``fast_linear`` / ``dtype``, or ``fast_linear=on`` where it cannot apply.
    """
    from drafttrain.target import load_target

    if target is None:
        tcfg = target_config(config, dtype, fast_linear)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        target = load_target(tcfg, device=device)
    d = None
    if drafter is not None:
        d = inference_drafter(target, drafter_dir(drafter), pack=pack)
    elif untrained_drafter is not None:
        d = inference_drafter(target, None, untrained_config=untrained_drafter, seed=seed, pack=pack)
    return Run(target, d)
