"""EAGLE-3 -> SGLang's EAGLE-3 draft folder:
``python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR``.

What SGLang reads (``srt/models/llama_eagle3.py``, ``LlamaForCausalLMEagle3``; ``model_runner`` for the
layer ids):

- ``config.json``: a one-layer Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``draft_vocab_size``, ``target_hidden_size`` and **``tie_word_embeddings: false``** (with true, SGLang
  makes ``lm_head`` the embedding and never loads ours; SmolLM2's own config says true);
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention (it adds 1). The top-level
  ``eagle_aux_hidden_state_layer_ids`` holds vLLM's ids for the same tensors, so vLLM reads this folder
  right too (:mod:`drafttrain.export.eagle3_common`).
- ``model.safetensors``: ``midlayer.*`` (SGLang prefixes ``model.`` to names it does not find: a
  ``layers.0.*`` name would be skipped without a word), ``fc.weight`` (SGLang's fc has no bias unless
  config ``bias``), ``norm.weight``, ``lm_head.weight``, ``d2t`` (offsets: ``hot_token_id = d2t + arange``)
  and ``t2d`` (skipped). The embedding is the target's (SGLang's EAGLE worker shares it).

SGLang's layer keeps the raw g as the residual (no ``norm_before_residual`` option), as ours does.
SGLang drafts autoregressively: a parallelspec_eagle3 drafter exported here runs as a plain EAGLE-3
drafter (its mask state unused), so its acceptance there is not the parallel drafter's.
"""

from __future__ import annotations

from pathlib import Path

from drafttrain.export.common import ExportError, check_consumed, load_tensors, save_tensors, write_json, fc_layout
from drafttrain.export.eagle3_common import (LAYER_WEIGHTS, build_drafter, check_drafter, drafter_tensors,
                                             layer_config, sglang_layer_ids)  # fmt: skip

WEIGHTS = "model.safetensors"
ENGINE = "SGLang EAGLE-3 loader (LlamaForCausalLMEagle3)"
MODEL_TYPE = "eagle3"  # the one model type an SGLang EAGLE-3 folder holds
#: The drafter variant flags (``serving_flags``) SGLang's layer computes when True: none (its layer has no
#: norm before fc and feeds back the pre-norm state), so a drafter with any flag set is refused by name.
SGLANG_FLAGS: tuple[str, ...] = ()


def sglang_consumed_names(restricted: bool) -> set[str]:
    """Names SGLang's ``LlamaForCausalLMEagle3.load_weights`` uses: its parameters under ``model.`` (fc,
    midlayer.* with q/k/v and gate/up stacked, norm) and ``lm_head``, plus d2t (-> hot_token_id) and t2d
    (skipped); any other name is dropped silently."""
    names = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"midlayer.{n}" for n in LAYER_WEIGHTS}
    return names | ({"d2t", "t2d"} if restricted else set())


def export(drafter, out_dir: Path, *, num_speculative_tokens: int | None = None, target_config=None, **_) -> dict:
    """Write ``drafter`` as an SGLang EAGLE-3 draft folder. Returns the config written.

    Raises:
        ExportError: see :func:`drafttrain.export.eagle3_common.check_drafter`.
    """
    check_drafter(drafter, "sglang")
    missing = [k for k, on in drafter.serving_flags().items() if on and k not in SGLANG_FLAGS]
    if missing:
        raise ExportError(f"SGLang's EAGLE-3 layer (LlamaForCausalLMEagle3) computes no {' / '.join(missing)} "
                          f"(this drafter's variant); export it with format speculators for vLLM, or train with "
                          + " ".join(f"drafter.{k}=false" for k in missing))  # fmt: skip
    tensors = drafter_tensors(drafter, "midlayer")
    tensors.pop("mask_hidden", None)  # SGLang drafts autoregressively (module docstring)
    check_consumed(set(tensors), sglang_consumed_names(drafter.restricted_vocab), ENGINE)
    tcfg = target_config or drafter.shared.model_config
    ids = [int(i) for i in drafter.aux_layer_ids]
    cfg = {
        **layer_config(tcfg),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": int(drafter.d2t.numel()),
        "target_hidden_size": int(tcfg.hidden_size),
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM's convention (read first by vLLM, ignored by SGLang)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(ids), "use_aux_hidden_state": True},
        "num_speculative_tokens": int(num_speculative_tokens or drafter.draft_depth),
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
    }
    save_tensors(out_dir / WEIGHTS, tensors, {"format": "pt"})
    write_json(out_dir / "config.json", cfg)
    return cfg


def load(directory: Path, target):
    """Read an SGLang EAGLE-3 folder back into the drafter class that declares it (the most general: SGLang runs
    the network as an EAGLE-3 chain; :func:`drafttrain.export.formats.reader_class`). SGLang's ids + 1 = ours."""
    from drafttrain.data.shards import read_json
    from drafttrain.export.formats import reader_class

    cfg = read_json(directory / "config.json", "export the drafter again")
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"] or cfg.get("tie_word_embeddings", True):
        raise ExportError(f"{directory} is not an untied SGLang EAGLE-3 folder")
    w = load_tensors(directory / WEIGHTS)
    ids = [int(i) + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return build_drafter(directory, target, cls=reader_class("sglang", MODEL_TYPE, directory), aux_ids=ids, draft_vocab_size=int(cfg["draft_vocab_size"]),
                         depth=int(cfg.get("num_speculative_tokens", 5)), layer_prefix="midlayer", weights=w)  # fmt: skip


def layout(cfg: dict, shapes: dict) -> dict:
    """The sizes ``config.json`` states (the draft layer's keys at its top level) and the tensor shapes they imply."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or [0, 1, 2]  # fmt: skip
    return fc_layout(cfg, cfg, ids, shapes)


def serve_commands(out: Path, verifier: str, n_spec: int) -> list[str]:
    """SGLang's ``launch_server`` line for an exported folder (``--speculative-algorithm EAGLE3``, a chain of
    ``n_spec`` drafts: SGLang drafts step by step, top-1)."""
    return [f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {Path(out).resolve()} --speculative-num-steps {n_spec} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {n_spec + 1}"]  # fmt: skip
