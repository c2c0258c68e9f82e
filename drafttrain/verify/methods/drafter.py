"""The ``drafter`` method (alias ``parallelspec``): the checkpoint's own drafter, drafting its own way.

Whatever recipe trained the checkpoint (Medusa, EAGLE, ParallelSpec in either integration), its
proposer is :func:`~drafttrain.verify.proposers.proposer_for` with the tree of the ``tree`` section
of ``conf/evaluate.yaml`` (:class:`~drafttrain.config.TreeConfig`); acceptance is the engine's lossless rule (greedy tree walk / recursive
rejection sampling). Runs are labelled with the drafter's name (``parallelspec``, ``eagle``, ...).
"""

from __future__ import annotations

from drafttrain.config import TreeConfig  # the one tree schema (scripts.evaluate's tree.*, trainer.spec_eval.tree.*)
from drafttrain.verify.methods.registry import Method, MethodContext, Variant, register


def make_proposer(c, drafter):
    """The drafter's own proposer (:func:`~drafttrain.verify.proposers.proposer_for`) with the tree of
    ``c.tree`` (``c``: a validated eval config)."""
    from drafttrain.verify.proposers import proposer_for
    from drafttrain.verify.tree import NAMED_CHOICES

    choices = c.tree.choices
    if isinstance(choices, str):
        choices = NAMED_CHOICES[choices]
    return proposer_for(drafter, widths=c.tree.widths, budget=c.tree.budget, choices=choices,
                        batched=c.tree.batched_drafting, plan=c.tree.plan)  # fmt: skip


def _check(c) -> list[str]:
    from drafttrain.verify.tree import NAMED_CHOICES

    t, problems = c.tree, []
    if t.widths is not None and (not t.widths or min(t.widths) < 1):
        problems.append("tree.widths must be positive ints")
    if t.budget is not None and t.budget < 1:
        problems.append("tree.budget must be >= 1")
    if t.choices is not None and not (t.choices in NAMED_CHOICES or isinstance(t.choices, list)):
        problems.append(f"tree.choices must be one of {sorted(NAMED_CHOICES)} or a list of rank lists")
    return problems


def _build(ctx: MethodContext) -> list[Variant]:
    return [Variant(ctx.drafter.name, lambda bs, refs: make_proposer(ctx.config, ctx.drafter))]  # labelled by the drafter


DRAFTER = register(
    Method("drafter", _build, needs_drafter=True, lossless=True, config=TreeConfig, section="tree", check=_check,
           summary="the checkpoint's drafter with its own proposer and the tree.* shape (lossless)"),
    "parallelspec",
)  # fmt: skip

__all__ = ["TreeConfig", "make_proposer", "DRAFTER"]
