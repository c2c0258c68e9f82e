"""The pre-flight check: a few tokens through a freshly loaded target before any work is spent on it.

A target a user brings may be a class nobody listed. Before self-distillation starts, :func:`check_target` runs

1. its structure (:func:`drafttrain.target.families.probe_structure`: decoder, layers, final norm, head) and
   drafttrain's forward against the model's own (``model(ids).logits``: the LM head and a folded logit scale);
2. where the run decodes with the engine: its cache layout (:func:`drafttrain.target.families.cache_layout`) and
   the engine at batch 2 (two prompts of different lengths): prefill, two plain decoding steps, one verification
   of a short draft that is half wrong (a chain on a target with recurrent layers, a two-branch tree elsewhere,
   so a rejection is rolled back), one more plain step; every emitted token against the greedy tokens of the
   model's own full forward (no cache);
3. where a drafter is named: its initialisation on the target and one training loss on a batch of the target's
   own features.

Any exception or a token that differs refuses the run with one line (:class:`UnsupportedTarget`) naming the model's
class, the part that failed and what still works. A differing token whose logit in the model's own forward is
within :data:`TIE` of the reference token's (a near-tie, which float reassociation may flip) is not a failure.

Layer: beside :mod:`drafttrain.compose` (it builds an engine and a drafter on a target).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from drafttrain.target.families import BrokenModel, UnsupportedTarget, broken_model, own_forward_error

log = logging.getLogger(__name__)

#: logit margin (relative to the largest |logit|) under which two tokens count as tied in the reference
TIE = 1e-4
#: the largest logit difference between the engine and the model's own full forward, relative to the largest |logit|,
#: by the target's dtype (float reassociation alone stays orders of magnitude below these)
LOGITS_RTOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}
#: the prompts' lengths and the greedy tokens checked after each
PROMPT_LENGTHS = (7, 4)
NEW_TOKENS = 6

ENGINE_FALLBACK = ("HF generation still works: data.generation.backend=hf and trainer.spec_eval.num_prompts=0 train "
                   "a drafter without the engine")  # fmt: skip


@dataclass
class PreflightReport:
    """What :func:`check_target` ran: ``checks`` (one line each), the layer kinds, the time it took."""

    model_class: str
    checks: list[str] = field(default_factory=list)
    layer_kinds: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _refuse(cls: str, part: str, why: str, works: str) -> UnsupportedTarget:
    why = " ".join(str(why).split())[:300]
    return UnsupportedTarget(f"{cls}: {part} failed ({why}); {works}")


@torch.no_grad()
def _own_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The model's own greedy continuation by full forwards (no cache) and the logits [len + n, v] of the final
    sequence (the reference every engine token is compared with)."""
    dev = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt], device=dev)
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist(), model(ids).logits[0].float()


def _matches(got: list[int], want: list[int], logits: torch.Tensor, start: int) -> tuple[bool, str]:
    """``got`` equals ``want`` up to near-ties of the reference (position ``start + i`` of ``logits`` scores token
    i); after a tie the continuations may differ and are not compared."""
    scale = float(logits.abs().max()) or 1.0
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        row = logits[start + i - 1]
        gap = float(row[w] - row[g])
        if gap <= TIE * scale:
            return True, ""
        return False, f"token {i} is {g} where the model's own forward gives {w} (logit gap {gap:.3g})"
    if len(got) != len(want):
        return False, f"{len(got)} tokens where {len(want)} were expected"
    return True, ""


class _Scripted:
    """A proposer that drafts what it is told: step 3 of each sequence a half-wrong draft, else nothing."""

    name = "preflight"

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int, chain: bool):
        self.refs, self.vocab, self.chain = refs, vocab, chain
        self.state: dict[int, dict] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        # hidden: the post-norm states of the inputs whose outputs were committed, in sequence order
        self.state[slot] = {"ref": self.refs[tuple(prompt_ids)], "n": 1, "step": 0, "hidden": [hidden[-1:]],
                            "prompt": tuple(prompt_ids)}  # fmt: skip

    def draft(self, slots, sampling=None, generator=None):
        from drafttrain.verify.tree import DraftTree

        out = []
        for slot in slots:
            st = self.state[slot]
            st["step"] += 1
            ref, n = st["ref"], st["n"]
            if st["step"] == 3 and n + 1 < len(ref):
                right, wrong = ref[n], (ref[n + 1] + 1) % self.vocab
                if self.chain:  # root -> right -> wrong: accepts 1, rolls back 1
                    out.append(DraftTree.chain([right, wrong]))
                else:  # root -> {wrong', right -> wrong}: accepts the second branch's first node
                    other = (right + 1) % self.vocab
                    out.append(DraftTree(torch.tensor([other, right, wrong], device="cpu"),
                                           torch.tensor([-1, -1, 1], device="cpu")))
            else:
                out.append(DraftTree.empty())
        return out

    def commit(self, slot, tokens, hidden) -> None:
        self.state[slot]["n"] += len(tokens)
        self.state[slot]["hidden"].append(hidden)

    def finish(self, slot, hidden):
        st = self.state[slot]
        return torch.cat(st["hidden"] + [hidden], dim=0)  # [1 + generated - 1, d]: from the prompt's last token on

    def release(self, slot) -> None:
        self.state.pop(slot, None)


def _prompts(target) -> list[list[int]]:
    v = int(target.lm_head.weight.shape[0])
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, max(v - 1, 4), (n,), generator=g, device="cpu").tolist() for n in PROMPT_LENGTHS]


def check_engine(target) -> list[str]:
    """Step 2 of the module docstring. Returns the lines of what was checked.

    Raises:
        UnsupportedTarget: the engine's cache or decoding differs from the model's own forward (or raises).
    """
    from drafttrain.compose import Run

    cls = type(target.model).__name__
    try:
        layout = target.cache_layout
    except UnsupportedTarget as e:
        raise UnsupportedTarget(f"{e}; {ENGINE_FALLBACK}") from None
    prompts = _prompts(target)
    refs = [_own_greedy(target.model, p, NEW_TOKENS) for p in prompts]
    recurrent = any(c.is_recurrent for c in layout)
    proposer = _Scripted({tuple(p): r for p, (r, _) in zip(prompts, refs)}, int(target.lm_head.weight.shape[0]),
                         chain=recurrent)  # fmt: skip
    part = "the engine (prefill, 2 decoding steps, a verification with a rejected draft, 1 more step, batch 2)"
    try:
        run = Run(target).engine(proposer, batch_size=2, max_new_tokens=NEW_TOKENS, stop_token_ids=[]).run(prompts)
    except UnsupportedTarget as e:
        raise UnsupportedTarget(f"{e}; {ENGINE_FALLBACK}") from None
    except Exception as e:  # noqa: BLE001 - one line naming the part
        raise _refuse(cls, part, f"{type(e).__name__}: {e}", ENGINE_FALLBACK) from e
    worst = 0.0
    for p, (want, logits), res in zip(prompts, refs, run.results):
        ok, why = _matches(res.tokens, want, logits, len(p))
        if not ok:
            raise _refuse(cls, part, f"decodes differently from its own forward: {why}", ENGINE_FALLBACK)
        if res.tokens == want and res.features is not None:  # the logits the engine decided on, position by position
            with torch.no_grad():
                got = target.lm_head(res.features.to(target.device)).float()
            ref = logits[len(p) - 1 : len(p) - 1 + got.shape[0]]
            scale = float(ref.abs().max()) or 1.0
            rel = float((got - ref).abs().max()) / scale
            worst = max(worst, rel)
            if rel > LOGITS_RTOL[str(target.model.dtype).removeprefix("torch.")]:
                raise _refuse(cls, part, f"its logits differ from the model's own forward by {rel:.2g} of the largest "
                              "|logit| (the engine's multi-token forward over a cache and the model's full forward "
                              "do not agree)", ENGINE_FALLBACK)  # fmt: skip
    kinds = sorted({c.kind for c in layout})
    return [f"engine: greedy-equal to the model's own forward at batch 2, logits within {worst:.1g} of its largest "
            f"({', '.join(kinds)} layers"
            f"{'; chains: recurrent states roll back by replay' if recurrent else ''})"]


def check_drafter(target, name: str, config: dict[str, Any]) -> list[str]:
    """Step 3 of the module docstring.

    Raises:
        UnsupportedTarget: building the drafter or its first loss raises (the message names the recipe's drafter).
    """
    from drafttrain.drafters import build_drafter

    cls = type(target.model).__name__
    part = f"the {name} drafter's initialisation on it"
    try:
        torch.manual_seed(0)
        drafter = build_drafter(name, dict(config), target).train()
        v = int(target.lm_head.weight.shape[0])
        g = torch.Generator().manual_seed(0)
        lengths = (12, 9)
        ids = torch.randint(3, max(v - 1, 4), (2, max(lengths)), generator=g, device="cpu")
        loss_mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, n:] = 0
            loss_mask[i, 3:n] = 1
        lens = torch.tensor(lengths, device="cpu")
        attn = (torch.arange(ids.shape[1], device="cpu")[None] < lens[:, None]).long()
        dev = target.device
        feats = target.features(ids.to(dev), attention_mask=attn.to(dev), feature_layers=drafter.feature_layers)
        batch = {"input_ids": ids.to(dev), "loss_mask": loss_mask.to(dev), "lengths": lens,
                 "features": feats[:, :-1]}  # fmt: skip
        out = drafter.training_loss(batch, torch.Generator().manual_seed(0))
        if not bool(torch.isfinite(out.loss)):
            raise ValueError(f"its first training loss is {float(out.loss)}")
        out.loss.backward()
    except UnsupportedTarget as e:
        raise UnsupportedTarget(f"{e}; the engine and HF generation still work with another recipe") from None
    except Exception as e:  # noqa: BLE001 - one line naming the part
        raise _refuse(cls, part, f"{type(e).__name__}: {e}", "the target itself works (other recipes, HF "
                      "generation)") from e  # fmt: skip
    return [f"drafter: {name} builds and trains one step on the target's features"]


def check_target(target, *, engine: bool = True, drafter: tuple[str, dict] | None = None) -> PreflightReport:
    """The pre-flight check of the module docstring, before any work is spent on ``target``.

    Args:
        target: a loaded :class:`drafttrain.target.Target`.
        engine: the run decodes with drafttrain's engine (self-distillation through it, its evaluation).
        drafter: (recipe drafter name, drafter config) to build and train once, or None.

    Returns:
        a :class:`PreflightReport`.

    Raises:
        UnsupportedTarget: one line: the model's class, the part that failed, what still works.
    """
    t0 = time.perf_counter()
    cls = type(target.model).__name__
    report = PreflightReport(cls)
    try:
        target.structure
    except BrokenModel:
        raise  # the model's own forward fails: its message says so, and HF generation cannot run it either
    except UnsupportedTarget as e:
        raise UnsupportedTarget(f"{e}; drafttrain drives a target through these parts, so no recipe can use it "
                                "(HF generation of the model itself is unaffected)") from None  # fmt: skip
    part = "drafttrain's forward (decoder, final norm, LM head) against the model's own logits"
    try:
        ids = torch.tensor([_prompts(target)[0]], device=target.device)
        with torch.no_grad():
            try:
                want = target.model(ids).logits.float()
            except Exception as e:  # noqa: BLE001 - broken when its forward without a cache fails too, else a part
                own = own_forward_error(target.model, ids)
                if own is not None:
                    raise broken_model(cls, ids.shape[1], own) from e
                raise
            got = target.forward(ids).logits
        scale = float(want.abs().max()) or 1.0
        diff = float((got - want).abs().max())
        if diff > 1e-3 * scale + 1e-5:
            raise ValueError(f"its logits differ by {diff:.3g} (largest |logit| {scale:.3g})")
    except BrokenModel:
        raise
    except Exception as e:  # noqa: BLE001 - one line naming the part
        raise _refuse(cls, part, f"{type(e).__name__}: {e}", "HF generation of the model itself is unaffected") from e
    report.checks.append("forward: drafttrain's features and logits are the model's own")
    if engine:
        report.checks += check_engine(target)
        report.layer_kinds = [c.kind for c in target.cache_layout]
    if drafter is not None:
        report.checks += check_drafter(target, *drafter)
    report.seconds = time.perf_counter() - t0
    log.info("pre-flight check of %s (%.1f s): %s", cls, report.seconds, "; ".join(report.checks))
    return report
