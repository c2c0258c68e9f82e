"""The ``replay`` method: a verifier benchmark whose drafts are the plain greedy output, each right
with probability ``replay_accept_prob`` (:class:`~drafttrain.verify.proposers.ReplayProposer`, EMS-SD
App. B geometric acceptance). Drafting costs nothing, so it measures the verifier alone. Greedy only;
needs no checkpoint. Its keys are top-level in ``conf/evaluate.yaml`` (``replay_accept_prob``,
``replay_depth``).
"""

from __future__ import annotations

from drafttrain.verify.methods.registry import Method, MethodContext, Variant, register


def _check(c) -> list[str]:
    if c.temperature != 0 or not 0 <= c.replay_accept_prob <= 1 or c.replay_depth < 1:
        return ["proposer=replay needs temperature=0, replay_accept_prob in [0, 1] and replay_depth >= 1"]
    return []


def _build(ctx: MethodContext) -> list[Variant]:
    from drafttrain.verify.proposers import ReplayProposer

    c = ctx.config
    ctx.drafter_info["replay_accept_prob"] = c.replay_accept_prob

    def make(bs, refs):
        return ReplayProposer({tuple(p): r for p, r in zip(ctx.prompts, refs)}, depth=c.replay_depth,
                              accept_prob=c.replay_accept_prob, seed=c.seed)  # fmt: skip

    return [Variant("replay", make)]


REPLAY = register(Method("replay", _build, needs_drafter=False, lossless=True, check=_check,
                         summary="verifier benchmark: drafts replay the plain output (greedy only)"))  # fmt: skip

__all__ = ["REPLAY"]
