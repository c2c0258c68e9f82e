"""The small interface every drafter implements, and the frozen target modules they share.

A drafter is a plain ``nn.Module``: no Accelerator, tokenizer, dataset or file I/O beyond its own
``save_pretrained``/``from_pretrained``. The training loop only needs:

- ``needs_features``: whether a batch must carry the target's last hidden states f;
- ``training_loss(batch, generator)``: loss + sums of metrics (reduced across ranks by the loop);
- ``save_pretrained(dir)`` / ``Drafter.from_pretrained(dir, target)``: weights as safetensors plus a
  json config, loadable without the training config.

The target's embedding, final norm and LM head are shared *by reference* and frozen; they are kept
out of the module tree (so they are neither optimised, nor wrapped by DDP, nor saved).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter_config.json"


@dataclass
class SharedTargetModules:
    """Frozen modules of the target that a drafter uses (never trained, never saved with the drafter)."""

    embed_tokens: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module
    model_config: Any  # the target's transformers config
    decoder_layer: nn.Module | None = None  # the target's last layer (class + optional init source)
    rotary_emb: nn.Module | None = None

    @classmethod
    def from_target(cls, target) -> "SharedTargetModules":
        return cls(
            embed_tokens=target.embed_tokens,
            final_norm=target.final_norm,
            lm_head=target.lm_head,
            model_config=target.config,
            decoder_layer=target.last_layer,
            rotary_emb=target.rotary_emb,
        )


@dataclass
class LossOutput:
    """loss: scalar to backpropagate; sums: float tensors to all-reduce (see :mod:`drafttrain.metrics`)."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0  # drafter input slots processed (for tokens/s)


class Drafter(nn.Module):
    """Base class: holds the shared target modules outside the module tree and does save/load."""

    name: ClassVar[str] = "base"
    needs_features: ClassVar[bool] = True

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules):
        super().__init__()
        self.config = dict(config)
        object.__setattr__(self, "_shared", shared)  # not a submodule: frozen, not saved

    @property
    def shared(self) -> SharedTargetModules:
        return self._shared

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        raise NotImplementedError

    def forward(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        """The training loss; called through ``forward`` so DDP/DeepSpeed wrappers see the call."""
        return self.training_loss(batch, generator)

    # -- checkpoint format ----------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``drafter.safetensors`` (trainable weights only) and ``drafter_config.json``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / DRAFTER_WEIGHTS))
        (directory / DRAFTER_CONFIG).write_text(json.dumps({"name": self.name, **self.config}, indent=1))

    @staticmethod
    def from_pretrained(directory: str | Path, target) -> "Drafter":
        """Load any drafter saved by :meth:`save_pretrained`, bound to ``target``'s shared modules.

        Raises:
            FileNotFoundError: no drafter checkpoint in ``directory``.
            ValueError: the checkpoint names an unknown drafter or does not fit the target.
        """
        from safetensors.torch import load_file

        from drafttrain.drafters import DRAFTERS

        directory = Path(directory)
        cfg_path = directory / DRAFTER_CONFIG
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no {DRAFTER_CONFIG} in {directory}")
        config = json.loads(cfg_path.read_text())
        name = config.pop("name")
        if name not in DRAFTERS:
            raise ValueError(f"unknown drafter '{name}' in {cfg_path}; known: {sorted(DRAFTERS)}")
        drafter = DRAFTERS[name](config, SharedTargetModules.from_target(target), init_weights=False)
        drafter.load_state_dict(load_file(str(directory / DRAFTER_WEIGHTS)))
        return drafter.to(target.device)
