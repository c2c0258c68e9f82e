"""What every export format shares: the error type, where a drafter lives in a run folder, file writers,
and the check that every tensor written is one the engine's loader consumes.

A serving engine reads a drafter folder through its own weight-name mapping and (vLLM, SGLang) silently
skips names it does not know: a misspelt tensor would load as its random/zero initialisation and the
engine would run a different network without a word. Each format module therefore records the exact set
of names its engine's loader consumes (read from the engine's source, cited there) and
:func:`check_consumed` compares the written names against it, both ways, before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from drafttrain.cliconfig import ConfigError
from drafttrain.compose import drafter_dir  # noqa: F401  (one rule for where a drafter lives; re-exported)


class ExportError(ConfigError):
    """A drafter cannot be written in the asked format (wrong recipe, or no exact mapping exists).
    A :class:`ConfigError` (a ValueError): the scripts report it in one line, exit status 2."""


def run_config(drafter_folder: Path) -> dict[str, Any] | None:
    """The training run's resolved config (``config.json`` beside ``drafter/``), or None for a bare drafter folder."""
    for p in (drafter_folder.parent / "config.json", drafter_folder / "config.json"):
        if p.is_file():
            cfg = json.loads(p.read_text())
            if isinstance(cfg, dict) and "target" in cfg:
                return cfg
    return None


def check_consumed(written: set[str], consumed: set[str], engine: str) -> None:
    """Every written tensor name is one ``engine``'s loader consumes, and every name it needs is written.

    Raises:
        ExportError: names the engine would skip silently, or parameters it would leave uninitialised.
    """
    extra, missing = sorted(written - consumed), sorted(consumed - written)
    if extra or missing:
        raise ExportError(f"{engine}: tensors the loader would skip {extra}; parameters it would not find {missing}")


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous CPU copies) as one safetensors file."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def draft_token_ids(drafter) -> torch.Tensor:
    """[N] int64 target id of every draft id of ``drafter`` (``Drafter.draft_token_ids`` where the drafter
    stores the engines' offsets, else its absolute ``d2t`` from before that convention)."""
    ids = getattr(drafter, "draft_token_ids", None)
    return (ids if ids is not None else drafter.d2t).detach().long().cpu()


def offsets_from_absolute(d2t: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 engines' ``d2t``: target id = i + d2t[i]. From drafttrain's absolute ids d2t_abs[i] (int64 [N]).

    >>> offsets_from_absolute(torch.tensor([5, 1, 9]))
    tensor([5, 0, 7])
    """
    return d2t.long() - torch.arange(d2t.numel(), dtype=torch.long)


REEXPORT = "re-export with scripts.export"


def config_int(cfg: dict, key: str, where: str = "config.json") -> int:
    """``cfg[key]`` as an int.

    Raises:
        ExportError: no integer under ``key`` (the folder is not a complete export).
    """
    try:
        return int(cfg[key])
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{where} has no integer '{key}'; the folder is not a complete export; {REEXPORT}") from None


def fc_layout(cfg: dict, layer, aux_ids: list, shapes: dict, head_optional: bool = False,
              vocab_map: tuple[str, ...] = ("d2t", "t2d")) -> dict[str, Any]:  # fmt: skip
    """The sizes an EAGLE-3-style folder's ``config.json`` states (``layer``: the draft layer's config, with
    ``hidden_size`` and optionally ``vocab_size``; ``target_hidden_size``, ``draft_vocab_size``) and the shapes they
    imply: ``fc`` over ``len(aux_ids)`` target layers, ``norm``, ``lm_head`` (unless ``head_optional`` and absent).
    Returns the layout dict of :func:`drafttrain.export.verify.verify_export` (each format module's ``layout``).

    Raises:
        ExportError: ``layer`` is not a dict, or a size is missing.
    """
    if not isinstance(layer, dict):
        raise ExportError(f"config.json has no transformer_layer_config; the folder is not a complete export; {REEXPORT}")
    d, th, n = config_int(layer, "hidden_size"), config_int(cfg, "target_hidden_size"), config_int(cfg, "draft_vocab_size")
    v = int(layer["vocab_size"]) if layer.get("vocab_size") is not None else None
    expect = {"fc.weight": (d, len(aux_ids) * th), "norm.weight": (d,)}
    if not head_optional or "lm_head.weight" in shapes:
        expect["lm_head.weight"] = (n, d)
    return {"target_hidden": th, "target_vocab": v, "draft_vocab": n, "expect": expect, "vocab_map": vocab_map}

