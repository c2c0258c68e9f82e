"""The sweep over every decoder-only text causal LM transformers exports: which ones drafttrain trains and decodes.

Every class of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is either excluded with its reason (:func:`excluded`:
an encoder-decoder's decoder, a BERT-style encoder given a causal head, a model of images or audio) or swept
(``tests/target/test_sweep.py``, ``python -m scripts.sweep_targets``): a tiny random target of the class
(:func:`drafttrain.target.tiny.build`) is either

- ``trains``: the pre-flight check passes (:func:`drafttrain.preflight.check_target`), the main job's drafter and
  EAGLE-3's train a few steps on it and decode through the engine greedy-equal to the model's own forward; or
- ``refused``: the pre-flight check refuses it in one line naming the class, the part that failed and what still
  works; or
- ``cannot build``: the class's tiny config does not build a model (the reason: a size the shrinking rules do not
  know, or a default the class itself rejects), or builds one whose own forward fails
  (:class:`~drafttrain.target.families.BrokenModel`: e.g. a layer index past the shrunk layer count). This is a
  limit of the sweep's tiny configs, not a verdict on the class.

A crash (any other exception) is a bug: the sweep's test fails on it.

Shape letters: b batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

#: the recipes every swept class trains: the main job's (parallelspec: its drafter is parallelspec_eagle3) and EAGLE-3
SWEEP_DRAFTERS: dict[str, dict[str, Any]] = {
    "parallelspec_eagle3": {"num_mask_tokens": 3, "anchor_ratio": 1.0, "draft_vocab_size": 0},
    "eagle3": {"draft_depth": 3, "ttt_steps": 2, "draft_vocab_size": 0},
}

#: classes excluded by name where no structural rule of :func:`excluded` tells (each with its reason)
EXCLUDED_BY_NAME: dict[str, str] = {
    "BertGenerationDecoder": "BERT-style encoder used as a decoder (bidirectional pre-training, no causal LM checkpoint)",
    "TrOCRForCausalLM": "the text decoder of an image-to-text encoder-decoder (reads the image encoder's states)",
    "FuyuForCausalLM": "image model: its text is interleaved with image patches",
    "GitForCausalLM": "image-to-text model (its decoder reads image features)",
    "Emu3ForCausalLM": "image model: its vocabulary is text plus image tokens of a visual tokenizer",
    "MllamaForCausalLM": "the text part of an image model, with cross-attention layers to image features",
    "Phi4MultimodalForCausalLM": "image and audio model",
    "MoshiForCausalLM": "the text stream of a speech model",
    "Gemma4AssistantForCausalLM": "an assistant (drafter) model that reads its target's hidden states, not a target",
    "Gemma4UnifiedAssistantForCausalLM": "an assistant (drafter) model that reads its target's hidden states, not a target",
    "XLNetLMHeadModel": "permutation language model (two-stream attention, no causal decoder)",
    "CpmAntForCausalLM": "prompt-segment encoder model whose forward prepends its own prompt tokens",
}


def causal_lm_classes() -> list[str]:
    """Every class name in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, sorted, once each."""
    from transformers.models.auto import modeling_auto

    names = set()
    for v in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(v if isinstance(v, (tuple, list)) else (v,))
    return sorted(names)


def excluded(name: str) -> str | None:
    """Why class ``name`` is not a decoder-only text causal LM (None: it is swept). Rules, in order: listed in
    :data:`EXCLUDED_BY_NAME`; not a ``*ForCausalLM`` / ``*LMHeadModel`` / ``*WithLMHead`` class (a multimodal wrapper:
    its text model is swept under its own name); its config is an encoder-decoder's (``is_encoder_decoder``); its
    model type also has a masked-LM head in transformers (a BERT-style encoder)."""
    import transformers
    from transformers.models.auto import modeling_auto

    if name in EXCLUDED_BY_NAME:
        return EXCLUDED_BY_NAME[name]
    if not name.endswith(("ForCausalLM", "LMHeadModel", "WithLMHead")):
        return "multimodal wrapper (ForConditionalGeneration): its text model is swept under its own class"
    cls = getattr(transformers, name, None)
    cfg_cls = getattr(cls, "config_class", None)
    try:
        cfg = cfg_cls() if cfg_cls is not None else None
    except Exception:  # noqa: BLE001 - a config that does not build from defaults is swept (and reported)
        cfg = None
    if cfg is not None and bool(getattr(cfg, "is_encoder_decoder", False)):
        return "encoder-decoder: the decoder of a sequence-to-sequence model"
    types = [k for k, v in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if v == name]
    if any(t in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES for t in types):
        return "BERT-style encoder (a masked-LM model given a causal head)"
    return None


@dataclass
class SweepRow:
    """One class's outcome: ``status`` trains | refused | cannot build | excluded | crash; ``reason`` (one line);
    ``layer_kinds`` (the cache kind per layer, where read); ``greedy_equal`` per drafter; ``seconds``."""

    name: str
    status: str
    reason: str = ""
    layer_kinds: list[str] = field(default_factory=list)
    greedy_equal: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def vary_weights(model, std: float = 0.3, seed: int = 0) -> None:
    """Redraw every 2-D weight ~ N(0, std): as initialised a tiny model repeats one token, which would hide an
    off-by-one; redrawn, its greedy continuations vary."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _train_and_decode(target, name: str, config: dict, prompts: list[list[int]], new: int) -> bool:
    """Two AdamW steps of drafter ``name`` on the target's own features of ``prompts`` + their greedy answers, then
    speculative decoding through the engine at batch 2 against the model's own greedy tokens (near-ties of its
    logits allowed, :func:`drafttrain.preflight._matches`). Returns whether every output is equal."""
    from drafttrain.drafters import build_drafter
    from drafttrain.preflight import _matches, _own_greedy
    from drafttrain.compose import Run
    from drafttrain.verify.proposers import proposer_for

    refs = [_own_greedy(target.model, p, new) for p in prompts]
    torch.manual_seed(0)
    drafter = build_drafter(name, dict(config), target).train()
    rows = [p + r for p, (r, _) in zip(prompts, refs)]
    s = max(map(len, rows))
    ids = torch.zeros(len(rows), s, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    for i, (row, p) in enumerate(zip(rows, prompts)):
        ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, len(p) : len(row)] = 1
    lengths = torch.tensor([len(r) for r in rows])
    attn = (torch.arange(s)[None] < lengths[:, None]).long()
    feats = target.features(ids, attention_mask=attn, feature_layers=drafter.feature_layers)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "lengths": lengths, "features": feats[:, :-1]}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        out = drafter.training_loss(batch, torch.Generator().manual_seed(step))
        if not bool(torch.isfinite(out.loss)):
            raise FloatingPointError(f"{name}'s training loss is {float(out.loss)} at step {step}")
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    drafter.eval()
    widths = None if target.recurrent else [2, 1]  # a recurrent target verifies chains
    run = Run(target).engine(proposer_for(drafter, widths=widths), batch_size=2, max_new_tokens=new,
                     stop_token_ids=[]).run(prompts)  # fmt: skip
    return all(_matches(res.tokens, want, logits, len(p))[0] for p, (want, logits), res in zip(prompts, refs, run.results))


def sweep_one(name: str, tokenizer, new_tokens: int = 8) -> SweepRow:
    """The outcome of class ``name`` (module docstring). Never raises for the class's own reasons: a build failure
    is ``cannot build``, a pre-flight refusal ``refused``; any other exception is returned as ``crash`` with its
    one-line cause (the sweep's test fails on it)."""
    from drafttrain.preflight import check_target
    from drafttrain.target import Target
    from drafttrain.target.families import BrokenModel, UnsupportedTarget
    from drafttrain.target import tiny

    t0 = time.perf_counter()
    why = excluded(name)
    if why:
        return SweepRow(name, "excluded", why)
    try:
        model = tiny.build(name, tokenizer)
    except Exception as e:  # noqa: BLE001 - recorded with its reason
        line = " ".join(str(e).split())[:200] or type(e).__name__
        return SweepRow(name, "cannot build", f"{type(e).__name__}: {line}", seconds=time.perf_counter() - t0)
    vary_weights(model)
    try:
        target = Target(model, tokenizer)
        check_target(target, drafter=("parallelspec_eagle3", SWEEP_DRAFTERS["parallelspec_eagle3"]))
    except BrokenModel as e:  # the tiny config builds a model whose own forward fails: a limit of the shrinking
        return SweepRow(name, "cannot build", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    except UnsupportedTarget as e:
        return SweepRow(name, "refused", str(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a crash: reported, fails the test
        return SweepRow(name, "crash", f"pre-flight: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
                        seconds=time.perf_counter() - t0)  # fmt: skip
    row = SweepRow(name, "trains", layer_kinds=[c.kind for c in target.cache_layout])
    g = torch.Generator().manual_seed(1)
    v = int(target.lm_head.weight.shape[0])
    prompts = [torch.randint(3, v - 1, (n,), generator=g).tolist() for n in (6, 9)]
    for dname, dcfg in SWEEP_DRAFTERS.items():
        try:
            row.greedy_equal[dname] = _train_and_decode(target, dname, dcfg, prompts, new_tokens)
        except UnsupportedTarget as e:
            row.status, row.reason = "refused", str(e)
            break
        except Exception as e:  # noqa: BLE001 - a crash: reported, fails the test
            row.status, row.reason = "crash", f"{dname}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
            break
    if row.status == "trains" and not all(row.greedy_equal.values()):
        row.status, row.reason = "crash", f"not greedy-equal: {row.greedy_equal}"
    row.seconds = time.perf_counter() - t0
    return row


def summary(rows: list[SweepRow]) -> dict[str, int]:
    """status -> count."""
    out: dict[str, int] = {}
    for r in rows:
        out[r.status] = out.get(r.status, 0) + 1
    return out
