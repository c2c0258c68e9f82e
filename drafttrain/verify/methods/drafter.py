"""The ``drafter`` method (alias ``parallelspec``): the checkpoint's own drafter, drafting its own way.

Whatever recipe trained the checkpoint (Medusa, EAGLE, ParallelSpec in either integration), its
proposer is :func:`~drafttrain.verify.proposers.proposer_for` with the tree of the ``tree`` section
of ``conf/evaluate.yaml``; acceptance is the engine's lossless rule (greedy tree walk / recursive
rejection sampling). Runs are labelled with the drafter's name (``parallelspec``, ``eagle``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drafttrain.config import GE1
from drafttrain.verify.methods.registry import Method, MethodContext, Variant, register


@dataclass
class TreeConfig:
    """Draft tree of the drafter's proposer (docs/design.md, "The verifier"; ParallelSpec Appendix A.3): ``tree.*`` in
    ``conf/evaluate.yaml``.

    ``widths``: candidates per depth (null = a chain over all K + 1 depths); ``budget``: maximum nodes
    (null = one per depth); ``choices``: a static shape instead of the best-first one: ``eagle_default``,
    ``medusa_default`` or a list of rank lists, e.g. ``[[0], [1], [0, 0]]``. ``batched_drafting``: the
    drafter drafts the whole batch in shared forwards (ParallelSpec: one forward; EAGLE: one per
    depth); false = one sequence at a time, each with its own drafter cache (a reference to compare).
    ``plan``: the online planner (:mod:`drafttrain.verify.planner`) chooses every step how many of the
    tree's nodes to verify, including none (τ is then per verification step of the pruned trees).
    """

    widths: list[int] | None = None
    budget: int | None = None
    choices: Any = None
    batched_drafting: bool = True
    # verify per step only the nodes that pay for their measured cost, pause drafting while nothing does
    # (drafttrain/verify/planner.py; lossless); false = verify the whole tree every step
    plan: bool = True

    numeric_ranges = dict(widths=GE1, budget=GE1)  # checked at validation (drafttrain.config.numeric_ranges)


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
