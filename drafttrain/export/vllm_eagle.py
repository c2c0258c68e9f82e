"""EAGLE(-1) -> vLLM's EAGLE-1 layout (``speculative_config={"model": DIR, "method": "eagle"}``), when exact.

What vLLM computes (vllm/model_executor/models/llama_eagle.py, 0.32; the network of EAGLE's released
cnets.py): u = fc([e(x); h]) with **no bias**; one Llama decoder layer whose **input norm is the
identity** (layer 0 is built with ``nn.Identity()`` in place of ``input_layernorm``); its output
(residual + MLP, **no final norm**) goes to the target's shared LM head for the draft logits and is fed
back as h of the next drafting step. h of the first step is the target's last hidden state after its
final norm (vLLM's Llama returns the normed states), as ours.

drafttrain's :class:`~drafttrain.drafters.eagle.EagleDrafter` computes a different function (a
deliberate deviation, documented in :mod:`drafttrain.drafters.feature_layer`):

1. fc has a bias (``fc_bias``, default true): vLLM builds fc without one and would drop it;
2. the decoder layer keeps its input RMSNorm (initialised from the target's last layer): vLLM's layer 0
   has none (0.32's AutoWeightsLoader rejects ``layers.0.input_layernorm.weight``; older releases
   skipped it without a word);
3. the layer output goes through the target's final norm before the head *and* before it is fed back
   (f^ = norm(h)); vLLM applies no norm on either path.

No weight rewrite turns one network into the other (RMSNorm is not linear), so an export without the
input norm would load and run, losslessly, but draft with a different network (difference 3 is silent): :func:`export` refuses and names each
difference. A drafter whose config says it computes vLLM's network (``fc_bias`` false, and config keys
``input_norm`` / ``output_norm`` false where the drafter has them) is exported exactly.

Shape letters: d hidden, v target vocab.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafttrain.export.common import ExportError, check_consumed, load_tensors, save_tensors, write_json, config_int, REEXPORT

WEIGHTS = "model.safetensors"
ENGINE = "vLLM EAGLE-1 loader (llama_eagle.py)"
MODEL_TYPE = "eagle"  # the drafter's declared type for this format (serving_formats)
_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight")  # fmt: skip


def vllm_consumed_names() -> set[str]:
    """Names vLLM's EAGLE-1 ``load_weights`` turns into parameters for a one-layer Llama drafter without
    its own LM head or embedding: ``fc.weight`` and layer 0's linears and post-attention norm
    (``embed_tokens`` is skipped: shared with the target; ``input_layernorm`` does not exist)."""
    return {"fc.weight"} | {f"layers.0.{n}" for n in _LAYER}


def differences(drafter) -> list[str]:
    """Where ``drafter``'s network differs from the one vLLM's EAGLE-1 runs (empty = an exact export)."""
    cfg = drafter.config
    diffs = []
    if drafter.fc.bias is not None and bool(torch.any(drafter.fc.bias != 0)):
        diffs.append("fc has a (non-zero) bias; vLLM's fc has none (train with drafter.fc_bias=false)")
    if cfg.get("input_norm", True) and not isinstance(drafter.layer.input_layernorm, torch.nn.Identity):
        diffs.append("the decoder layer applies its input RMSNorm; vLLM's layer 0 has none "
                     "(its loader would skip layers.0.input_layernorm.weight)")  # fmt: skip
    if cfg.get("output_norm", True):
        diffs.append("the layer output goes through the target's final norm before the LM head and before "
                     "it is fed back; vLLM uses the raw layer output for both")  # fmt: skip
    if getattr(drafter, "restricted_vocab", False):
        diffs.append("a restricted draft vocabulary: vLLM's EAGLE-1 drafts over the target's full LM head")
    return diffs


def export(drafter, out_dir: Path, *, target_config=None, **_) -> dict:
    """Write ``drafter`` in vLLM's EAGLE-1 layout if vLLM computes the same network.

    Raises:
        ExportError: not an EAGLE drafter, or the networks differ (the message lists every difference).
    """
    from drafttrain.export.formats import check_declares

    check_declares(drafter, "vllm_eagle")
    diffs = differences(drafter)
    if diffs:
        raise ExportError("vLLM's EAGLE-1 would run a different network than this drafter, so the export "
                          "would load silently wrong; refusing. Differences: " + "; ".join(diffs))  # fmt: skip
    tensors = {"fc.weight": drafter.fc.weight}
    sd = drafter.layer.state_dict()
    tensors.update({f"layers.0.{n}": sd[n] for n in _LAYER})
    check_consumed(set(tensors), vllm_consumed_names(), ENGINE)
    mc = (target_config or drafter.shared.model_config).to_dict()
    config = {**mc, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "tie_word_embeddings": False}
    save_tensors(out_dir / WEIGHTS, tensors, {"format": "pt"})
    write_json(out_dir / "config.json", config)
    return config


def load(directory: Path, target):
    """Read a vLLM EAGLE-1 folder back into an :class:`~drafttrain.drafters.eagle.EagleDrafter` computing vLLM's network.

    Raises:
        ExportError: the drafter class has no config keys for vLLM's network (input_norm / output_norm).
    """
    from drafttrain.data.shards import read_json
    from drafttrain.drafters import SharedTargetModules
    from drafttrain.export.formats import reader_class

    EagleDrafter = reader_class("vllm_eagle", MODEL_TYPE, directory)  # the class that declares vLLM's EAGLE-1 folder

    if "input_norm" not in EagleDrafter.defaults or "output_norm" not in EagleDrafter.defaults:
        raise ExportError("this EagleDrafter cannot compute vLLM's EAGLE-1 network (no input_norm/output_norm keys)")
    read_json(directory / "config.json", "export the drafter again")
    w = load_tensors(directory / WEIGHTS)
    drafter = EagleDrafter({"fc_bias": False, "input_norm": False, "output_norm": False},
                           SharedTargetModules.from_target(target), init_weights=False)  # fmt: skip
    with torch.no_grad():
        drafter.fc.weight.copy_(w["fc.weight"])
        drafter.layer.load_state_dict({n: w[f"layers.0.{n}"] for n in _LAYER}, strict=False)
    return drafter


def layout(cfg: dict, shapes: dict) -> dict:
    """The sizes ``config.json`` states and the tensor shapes they imply."""
    d = config_int(cfg, "hidden_size")
    return {"target_hidden": d, "target_vocab": int(cfg["vocab_size"]) if cfg.get("vocab_size") else None,
            "draft_vocab": None, "expect": {"fc.weight": (d, 2 * d)}, "vocab_map": ()}  # fmt: skip
