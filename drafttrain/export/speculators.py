"""EAGLE-3 (and ParallelSpec-EAGLE-3) -> vLLM's speculators format: ``vllm serve DIR`` or
``speculative_config={"model": DIR, "method": "eagle3", ...}``.

What vLLM 0.32 reads (``transformers_utils/configs/speculators/{base,algos}.py``, ``models/llama_eagle3.py``):

- ``config.json``: ``speculators_model_type`` ``eagle3`` (``peagle`` for parallel drafting: vLLM then sets
  ``parallel_drafting`` itself and reads ``mask_token_id``), ``transformer_layer_config`` (the draft
  layer's Llama config; vLLM builds the draft config from it), ``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` (absent = **true** in vLLM but false in the
  speculators package: always written, false, as our network computes), ``norm_before_fc`` (false),
  ``fc_norm`` / ``norm_output`` (the drafter's own flags, EAGLE-3.1: ``Eagle3Drafter.serving_flags``),
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention, see
  :mod:`drafttrain.export.eagle3_common`), ``speculators_config`` (proposal method ``greedy`` with
  ``speculative_tokens`` = the default chain length; ``verifier.name_or_path`` = the target ``vllm serve
  DIR`` serves).
- ``model.safetensors``: ``fc.weight``, ``fc_norm.{i}.weight`` (with ``fc_norm``), ``layers.0.*`` (q/k/v 2d wide; ``hidden_norm``), ``norm.weight``,
  ``lm_head.weight`` [N, d], ``d2t`` (offsets; renamed ``draft_id_to_target_id``) and ``t2d`` (dropped)
  when N < v, ``mask_hidden`` [3d] for parallel drafting (the fc *input* of a mask slot: vLLM passes it
  through fc). No ``embed_tokens``: vLLM shares the target's, as we do. vLLM's EAGLE-3 loader raises on
  names it does not know, except ``mask_hidden`` without parallel drafting, which it skips with a warning.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from drafttrain.export.common import ExportError, check_consumed, load_tensors, save_tensors, write_json, fc_layout
from drafttrain.export.eagle3_common import (LAYER_WEIGHTS, build_drafter, check_drafter, drafter_tensors,
                                             layer_config)  # fmt: skip

WEIGHTS = "model.safetensors"
ENGINE = "vLLM EAGLE-3 loader (llama_eagle3.py, speculators format)"
SPECULATORS_VERSION = "0.9.0"  # the release whose config classes the tests validate against


#: The variant flags vLLM 0.32's ``llama_eagle3`` computes when set (``fc_norm``: one RMSNorm per target layer
#: before fc, weights ``fc_norm.{i}.weight``; ``norm_output``: the post-norm state fed back), and those it
#: computes but drafttrain's network does not (refused on load).
VLLM_FLAGS = ("fc_norm", "norm_output")
UNCOMPUTED_FLAGS = ("norm_before_fc",)


def vllm_consumed_names(restricted: bool, parallel: bool, fc_norm: int = 0) -> set[str]:
    """Tensor names vLLM's ``Eagle3LlamaForCausalLM.load_weights`` maps onto a parameter (or buffer) of a
    one-layer drafter without its own embedding: fc, layers.0.* (q/k/v and gate/up stacked into
    qkv_proj / gate_up_proj), norm, lm_head; ``fc_norm.{i}.weight`` for i < ``fc_norm`` (config ``fc_norm``
    true: one per target layer); d2t (-> draft_id_to_target_id) and t2d (dropped) when the draft vocabulary
    is restricted; mask_hidden with parallel drafting."""
    names = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.{n}" for n in LAYER_WEIGHTS}
    names |= {f"fc_norm.{i}.weight" for i in range(fc_norm)}
    if restricted:
        names |= {"d2t", "t2d"}
    if parallel:
        names.add("mask_hidden")
    return names


#: the model types this format writes (a drafter's :attr:`~drafttrain.drafters.base.Drafter.serving_formats`), with
#: speculators' architecture name for each; ``peagle`` drafts in parallel (mask slots)
ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}


def config_dict(drafter, *, verifier: str, num_speculative_tokens: int, target_config) -> dict:
    """The speculators ``config.json`` of ``drafter`` (see the module docstring): its declared model type, its
    own variant flags, its mask token where it drafts in parallel."""
    kind = drafter.serving_formats["speculators"]
    if kind not in ARCHITECTURES:
        raise ExportError(f"'{drafter.name}' declares speculators model type {kind!r}; this exporter writes "
                          f"{sorted(ARCHITECTURES)}")  # fmt: skip
    parallel = drafter.spec.drafting == "parallel"
    tcfg = target_config or drafter.shared.model_config
    cfg = {
        "architectures": [ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        "speculators_version": _speculators_version(),
        "transformer_layer_config": layer_config(tcfg),
        "draft_vocab_size": int(drafter.d2t.numel()),
        "target_hidden_size": int(tcfg.hidden_size),
        **drafter.serving_flags(),  # the network's own variant flags (norm_before_residual always written)
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in drafter.aux_layer_ids],
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],  # fmt: skip
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(tcfg, "architectures", None)
                                                                       or ["LlamaForCausalLM"])},  # fmt: skip
        },
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
    }
    if parallel:
        cfg["mask_token_id"] = int(drafter.mask_token_id)
    return cfg


def _speculators_version() -> str:
    try:
        return version("speculators")
    except PackageNotFoundError:
        return SPECULATORS_VERSION


def export(drafter, out_dir: Path, *, verifier: str | None = None, num_speculative_tokens: int | None = None,
           target_config=None, **_) -> dict:  # fmt: skip
    """Write ``drafter`` in the speculators format. Returns the config written.

    Raises:
        ExportError: see :func:`drafttrain.export.eagle3_common.check_drafter`.
    """
    check_drafter(drafter, "speculators")
    parallel = drafter.spec.drafting == "parallel"
    tensors = drafter_tensors(drafter, "layers.0")
    fc_norm = len(drafter.aux_layer_ids) if drafter.serving_flags()["fc_norm"] else 0
    check_consumed(set(tensors), vllm_consumed_names(drafter.restricted_vocab, parallel, fc_norm), ENGINE)
    n = int(num_speculative_tokens or drafter.draft_depth)
    cfg = config_dict(drafter, verifier=verifier or "", num_speculative_tokens=n, target_config=target_config)
    save_tensors(out_dir / WEIGHTS, tensors, {"format": "pt"})
    write_json(out_dir / "config.json", cfg)
    return cfg


def load(directory: Path, target):
    """Read a speculators folder back into the drafter class that declares its model type
    (:func:`drafttrain.export.formats.reader_class`: EAGLE-3's for ``eagle3``, parallel drafting's for ``peagle``)."""
    from drafttrain.data.shards import read_json
    from drafttrain.export.formats import reader_class

    cfg = read_json(directory / "config.json", "export the drafter again")
    kind = cfg.get("speculators_model_type")
    if kind not in ARCHITECTURES:
        raise ExportError(f"{directory}: speculators_model_type {kind!r}, expected one of {sorted(ARCHITECTURES)}")
    cls = reader_class("speculators", kind, directory)
    if cfg.get("norm_before_residual", True) or any(cfg.get(k) for k in UNCOMPUTED_FLAGS):
        raise ExportError(f"{directory}: a norm variant drafttrain's EAGLE-3 network does not compute "
                          f"(norm_before_residual {cfg.get('norm_before_residual', True)}, "
                          + ", ".join(f"{k} {bool(cfg.get(k))}" for k in UNCOMPUTED_FLAGS) + ")")  # fmt: skip
    w = load_tensors(directory / WEIGHTS)
    depth = int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    # peagle: one pass drafts the last item's guess + K mask slots, so K = speculative tokens - 1 (K is a
    # decoding choice there: every mask slot shares one mask_hidden)
    parallel = cls.spec.drafting == "parallel"
    extra = {"mask_token_id": int(cfg["mask_token_id"]), "num_mask_tokens": depth - 1} if parallel else {}
    extra.update({k: bool(cfg.get(k, False)) for k in VLLM_FLAGS})  # the variant the folder's network computes
    return build_drafter(directory, target, cls=cls, aux_ids=cfg["eagle_aux_hidden_state_layer_ids"],
                         draft_vocab_size=int(cfg["draft_vocab_size"]), depth=depth, layer_prefix="layers.0",
                         weights=w, extra=extra)  # fmt: skip


def layout(cfg: dict, shapes: dict) -> dict:
    """The sizes ``config.json`` states and the tensor shapes they imply (:func:`drafttrain.export.verify.verify_export`)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 1, 2]
    return fc_layout(cfg, cfg.get("transformer_layer_config"), ids, shapes)
