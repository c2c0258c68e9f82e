"""Medusa heads -> vLLM's Medusa layout (``speculative_config={"model": DIR, "method": "medusa"}``).

What vLLM reads (vllm/model_executor/models/medusa.py and transformers_utils/configs/medusa.py, 0.32):

- ``config.json``: ``model_type: "medusa"``, ``architectures: ["MedusaModel"]``, ``hidden_size``,
  ``vocab_size`` (the target's v), ``num_heads`` (K), ``num_hidden_layers`` (ResBlocks per head: 1),
  ``truncated_vocab_size`` (N, the rows of each head) and ``medusa_fc_bias`` (the ResBlock's bias; vLLM
  builds it without a bias unless this is true, so leaving it out would drop c_k silently).
- ``model.safetensors``: ``blocks.{k}.layers.0.weight`` / ``.bias`` (A_k, c_k), ``lm_heads.{k}.weight``
  (W_k, [N, d]) and ``token_map`` (int64 [N], the *absolute* target id of each head row: vLLM scatters
  the N logits into a -inf row of v with ``logits[..., token_map] = head_logits``), i.e. drafttrain's
  ``Drafter.draft_token_ids``. Head k = ``heads[k]`` here: vLLM's block k drafts the k-th token after the
  target's own next token, like ours.

**vLLM 0.32 loads only full-vocabulary Medusa heads.** Its ``Medusa.__init__`` builds every
``lm_heads[k]`` over ``vocab_size`` rows, while ``load_weights`` cuts the rows to ``token_map``, so a
truncated checkpoint stops at ``assert loaded_weight.shape[output_dim] == self.org_vocab_size``
(``vocab_parallel_embedding.py``), whichever row count the file holds (older releases built the
heads over ``truncated_vocab_size`` and loaded this layout). A full-vocabulary drafter
(``drafter.draft_vocab_size=0``) is written without ``token_map`` and loads. Padding a truncated
head to v rows would not be exact (a zero row scores 0, above negative draft logits), so it is not
done: the layout stays the documented one and :func:`export` logs a warning.

The network is the same function: vLLM's ResidualBlock is x + SiLU(A x + c), then ``lm_heads[k]`` on the
target's post-norm last hidden state (vLLM's Llama returns hidden states after the final norm), as in
:class:`drafttrain.drafters.medusa.MedusaHead`. The export is exact.

Shape letters: K heads, d hidden, v target vocab, N draft vocab.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from drafttrain.export.common import ExportError, draft_token_ids, check_consumed, load_tensors, save_tensors, write_json, config_int, REEXPORT

log = logging.getLogger(__name__)
WEIGHTS = "model.safetensors"
ENGINE = "vLLM Medusa loader"
MODEL_TYPE = "medusa"  # vLLM's model type of the folder (the drafter declares it: serving_formats)


def vllm_consumed_names(num_heads: int, num_layers: int = 1, fc_bias: bool = True, truncated: bool = True) -> set[str]:
    """Tensor names vLLM's ``Medusa.load_weights`` consumes for this config: its ``named_parameters()``
    (``blocks.{k}.layers.{l}.weight`` [+ ``.bias`` when ``medusa_fc_bias``], ``lm_heads.{k}.weight``) plus
    ``token_map`` (read only when ``truncated_vocab_size < vocab_size``; any other name is skipped)."""
    names = {f"lm_heads.{k}.weight" for k in range(num_heads)}
    for k in range(num_heads):
        for j in range(num_layers):
            names.add(f"blocks.{k}.layers.{j}.weight")
            if fc_bias:
                names.add(f"blocks.{k}.layers.{j}.bias")
    if truncated:
        names.add("token_map")
    return names


def export(drafter, out_dir: Path, **_) -> dict:
    """Write ``drafter`` (a :class:`~drafttrain.drafters.medusa.MedusaDrafter`) in vLLM's Medusa layout.

    Returns:
        the engine config written (``config.json``).

    Raises:
        ExportError: ``drafter`` is not a Medusa drafter.
    """
    from drafttrain.export.formats import check_declares

    check_declares(drafter, "vllm_medusa")
    v = drafter.vocab_size
    n = drafter.d2t.numel()
    k = drafter.num_heads
    d = drafter.heads[0].res.in_features
    tensors: dict[str, torch.Tensor] = {}
    for j, head in enumerate(drafter.heads):
        tensors[f"blocks.{j}.layers.0.weight"] = head.res.weight
        tensors[f"blocks.{j}.layers.0.bias"] = head.res.bias
        tensors[f"lm_heads.{j}.weight"] = head.out.weight
    truncated = n < v
    if truncated:
        tensors["token_map"] = draft_token_ids(drafter)
    check_consumed(set(tensors), vllm_consumed_names(k, 1, True, truncated), ENGINE)
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["MedusaModel"],
        "hidden_size": d,
        "vocab_size": v,
        "num_heads": k,
        "num_hidden_layers": 1,
        "truncated_vocab_size": n,
        "medusa_fc_bias": True,
        "torch_dtype": str(drafter.heads[0].out.weight.dtype).removeprefix("torch."),
    }
    save_tensors(out_dir / WEIGHTS, tensors, {"format": "pt"})
    write_json(out_dir / "config.json", config)
    if truncated:
        log.warning("vLLM 0.32 cannot load a truncated-vocabulary Medusa (its heads are built over the full "
                    "vocabulary: an assertion in ParallelLMHead.weight_loader); train with "
                    "drafter.draft_vocab_size=0 to serve with it (module docstring)")  # fmt: skip
    return config


def load(directory: Path, target):
    """Read a vLLM Medusa folder back into a :class:`~drafttrain.drafters.medusa.MedusaDrafter` bound to ``target``.

    Raises:
        ExportError: the folder is not a one-layer Medusa with a bias, or does not fit ``target``.
    """
    from drafttrain.data.shards import read_json
    from drafttrain.drafters import SharedTargetModules
    from drafttrain.export.formats import reader_class

    cfg = read_json(directory / "config.json", "export the drafter again")
    if cfg.get("model_type") != MODEL_TYPE or int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ExportError(f"{directory} is not a one-ResBlock Medusa folder (model_type={cfg.get('model_type')})")
    if int(cfg["vocab_size"]) != target.lm_head.weight.shape[0]:
        raise ExportError(f"{directory} is for a vocabulary of {cfg['vocab_size']}, the target has {target.lm_head.weight.shape[0]}")
    w = load_tensors(directory / WEIGHTS)
    n, v = int(cfg["truncated_vocab_size"]), int(cfg["vocab_size"])
    drafter = reader_class("vllm_medusa", MODEL_TYPE, directory)({"num_heads": int(cfg["num_heads"]), "draft_vocab_size": 0 if n == v else n},
                            SharedTargetModules.from_target(target), init_weights=False)  # fmt: skip
    with torch.no_grad():
        if n < v:
            drafter.set_draft_vocab(w["token_map"])  # before the heads: it re-seeds them from the target rows
        for j, head in enumerate(drafter.heads):
            head.res.weight.copy_(w[f"blocks.{j}.layers.0.weight"])
            head.res.bias.copy_(w.get(f"blocks.{j}.layers.0.bias", torch.zeros_like(head.res.bias)))
            head.out.weight.copy_(w[f"lm_heads.{j}.weight"])
    return drafter


def layout(cfg: dict, shapes: dict) -> dict:
    """The sizes ``config.json`` states and the tensor shapes they imply.

    Raises:
        ExportError: ``num_heads`` disagrees with the heads the weight file holds.
    """
    d, v, n, k = (config_int(cfg, x) for x in ("hidden_size", "vocab_size", "truncated_vocab_size", "num_heads"))
    heads = sum(1 for name in shapes if name.startswith("lm_heads.") and name.endswith(".weight"))
    if heads != k:
        raise ExportError(f"config.json is inconsistent with model.safetensors: num_heads {k}, the file holds {heads} "
                          f"heads (lm_heads.*); config.json was edited after export or belongs to another folder; {REEXPORT}")  # fmt: skip
    expect = {f"blocks.{j}.layers.0.weight": (d, d) for j in range(k)}
    expect.update({f"lm_heads.{j}.weight": (n, d) for j in range(k)})
    if "token_map" in shapes:
        expect["token_map"] = (n,)
    return {"target_hidden": d, "target_vocab": v, "draft_vocab": n, "expect": expect, "vocab_map": ("token_map",)}
