"""Draft token trees: the candidates a proposer hands the verifier for one sequence and one step.

A tree hangs below a **root**: the sequence's last emitted token, whose keys/values are not yet in
the target's cache (after a verification step it is the bonus token). Node i (0..n-1) is a
candidate token; ``parents[i]`` is the node it continues (-1 = the root) and parents come first
(``parents[i] < i``). The target verifies every root-to-node path in one forward pass with tree
attention (SpecInfer, Miao et al. 2024; ParallelSpec Appendix A.3): node i sees the committed cache,
the root and its own ancestors, and sits at position ``cache_len + depth(i)``.

Index diagram (root = row/column 0, node i = row/column i + 1)::

    choices (Medusa-style rank tuples)   tree            ancestor_mask() [n+1, n+1]
    (0,)      -> node 0, parent -1          root            r 0 1 2 3
    (1,)      -> node 1, parent -1         /    \\        r 1 . . . .
    (0, 0)    -> node 2, parent 0        n0      n1     0 1 1 . . .
    (0, 0, 0) -> node 3, parent 2        |              1 1 . 1 . .
                                         n2             2 1 1 . 1 .
                                         |              3 1 1 . 1 1
                                         n3

Static shapes come from a choice list (a list of rank tuples; rank r at depth t = the (r+1)-th
candidate at depth t): Medusa's and EAGLE's published default trees are included. The ParallelSpec
tree (:func:`parallelspec_tree`) takes the top-k per depth of the drafter's single-pass
distributions (ParallelSpec Algorithm 1, "draft future token tree N ... with a single forward pass")
and keeps the ``budget`` highest-scoring nodes.

Shape letters: n tree nodes, v vocab, r draft distributions, D depth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

# Medusa's default tree for Vicuna-7B ("mc_sim_7b_63", FasterDecoding/Medusa medusa/model/medusa_choices.py):
# 63 nodes, depth 4, found by maximising the expected acceptance length on a calibration set.
MEDUSA_DEFAULT_CHOICES: list[tuple[int, ...]] = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
]  # fmt: skip

# EAGLE's default tree (SafeAILab/EAGLE eagle/model/choices.py, "mc_sim_7b_63" there too): 25 nodes, depth 5.
EAGLE_DEFAULT_CHOICES: list[tuple[int, ...]] = [
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 0, 0), (0, 0, 1),
    (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
]  # fmt: skip

NAMED_CHOICES = {"medusa_default": MEDUSA_DEFAULT_CHOICES, "eagle_default": EAGLE_DEFAULT_CHOICES}


@dataclass
class DraftTree:
    """Candidate tokens for one sequence and one verification step.

    Attributes:
        tokens: [n] int64 candidate token ids (the root is not included).
        parents: [n] int64 parent node of each node, -1 for a child of the root; ``parents[i] < i``.
        draft_probs: optional [r, v] float, the (temperature/top-p processed) draft distributions the
            children were drawn from. Needed by the sampling acceptance rules, not by greedy.
        dist_index: optional [n] int64, row of ``draft_probs`` node i was drawn from. Siblings share a
            row (they are successive draws from one distribution).

    Raises:
        ValueError: shapes disagree, a parent does not precede its child, siblings come from
            different distributions, or an index is out of range.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    dist_index: torch.Tensor | None = None

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long, device=self.tokens.device).reshape(-1)
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"tokens has {n} nodes but parents has {self.parents.numel()}")
        par = self.parents.tolist()
        for i, p in enumerate(par):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must be -1 or an earlier node (topological order)")
        if (self.draft_probs is None) != (self.dist_index is None):
            raise ValueError("draft_probs and dist_index go together")
        if self.dist_index is not None:
            self.dist_index = torch.as_tensor(self.dist_index, dtype=torch.long).reshape(-1)
            if self.dist_index.numel() != n:
                raise ValueError(f"dist_index has {self.dist_index.numel()} entries for {n} nodes")
            r = self.draft_probs.shape[0]
            di = self.dist_index.tolist()
            if n and not all(0 <= d < r for d in di):
                raise ValueError(f"dist_index out of range for {r} draft distributions")
            for kids in self.children():
                if len({di[c] for c in kids}) > 1:
                    raise ValueError("siblings must be drawn from the same draft distribution (one dist_index)")

    # -- derived structure ----------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.tokens.numel()

    def depth(self) -> torch.Tensor:
        """[n] int64 depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return torch.tensor(d, dtype=torch.long)

    @property
    def max_depth(self) -> int:
        return int(self.depth().max()) if self.n else 0

    def children(self) -> list[list[int]]:
        """Children lists, length n + 1: entry 0 = the root's children, entry i + 1 = node i's, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.n + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i (inclusive)."""
        par = self.parents.tolist()
        path = []
        while i >= 0:
            path.append(i)
            i = par[i]
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths, one per leaf, leaves in node order."""
        kids = self.children()
        return [self.path_to(i) for i in range(self.n) if not kids[i + 1]]

    def ancestor_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: entry [a, b] is True where b is a or an ancestor of a (root = index 0, node i = i + 1).

        This is the tree-attention mask of the verification input ``[root, node 0, ..., node n-1]``.
        """
        n = self.n
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True  # everyone sees the root
        for i, p in enumerate(self.parents.tolist()):
            m[i + 1] = m[p + 1]  # the parent's ancestors (row p+1 is final: p < i)
            m[i + 1, i + 1] = True
        return m

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "DraftTree":
        """No candidates: verification then emits only the target's own next token (plain decoding)."""
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A chain d_1 -> d_2 -> ... (node i's parent is i - 1); ``draft_probs`` [n, v] row i drew node i."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = tokens.numel()
        dist = torch.arange(n) if draft_probs is not None else None
        return cls(tokens, torch.arange(n) - 1, draft_probs, dist)


# ---------------------------------------------------------------------------------------------
# Tree shapes from rank tuples (Medusa-style choice lists)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeTemplate:
    """A static tree shape: node i is the ``ranks[i][-1]``-th candidate at depth ``len(ranks[i])``.

    Attributes:
        ranks: rank tuple of each node, sorted by (depth, ranks) as Medusa does.
        parents: [n] int64 as in :class:`DraftTree`.
    """

    ranks: tuple[tuple[int, ...], ...]
    parents: torch.Tensor

    @property
    def n(self) -> int:
        return len(self.ranks)

    @property
    def max_depth(self) -> int:
        return max((len(r) for r in self.ranks), default=0)

    def fill(self, candidates: Sequence[torch.Tensor], draft_probs: torch.Tensor | None = None) -> DraftTree:
        """Tokens for this shape from per-depth candidate lists (Medusa / ParallelSpec style).

        Args:
            candidates: ``candidates[t]`` = [w_t] int64 candidate ids at depth t + 1, best / first drawn first.
            draft_probs: optional [D, v] distribution of each depth (row t drew ``candidates[t]``).

        Returns:
            A :class:`DraftTree`; node (r_1..r_t) holds ``candidates[t-1][r_t]`` and draws from row t - 1.

        Raises:
            ValueError: a rank is beyond the candidates of its depth (use :meth:`truncate` first).
        """
        toks = []
        for r in self.ranks:
            t = len(r) - 1
            if t >= len(candidates) or r[-1] >= candidates[t].numel():
                raise ValueError(f"node {r} needs candidate {r[-1]} at depth {t + 1}, which is not there")
            toks.append(int(candidates[t][r[-1]]))
        dist = torch.tensor([len(r) - 1 for r in self.ranks], dtype=torch.long) if draft_probs is not None else None
        return DraftTree(torch.tensor(toks, dtype=torch.long), self.parents.clone(), draft_probs, dist)

    def truncate(self, widths: Sequence[int], budget: int | None = None) -> "TreeTemplate":
        """Keep nodes whose rank at every depth t is below ``widths[t - 1]`` (depths past ``len(widths)`` are
        dropped), then the first ``budget`` of them in (depth, ranks) order. The result is still a tree."""
        keep = [r for r in self.ranks if len(r) <= len(widths) and all(x < widths[t] for t, x in enumerate(r))]
        if budget is not None:
            keep = keep[: max(budget, 0)]
        if len(keep) == self.n:
            return self
        return template_from_choices(keep)


def template_from_choices(choices: Sequence[Sequence[int]]) -> TreeTemplate:
    """Build a :class:`TreeTemplate` from a Medusa-style choice list.

    Args:
        choices: rank tuples, e.g. ``[(0,), (1,), (0, 0)]``; any order, no duplicates.

    Raises:
        ValueError: a tuple's prefix is missing (it would have no parent), a rank is negative, or the
            ranks of a node's children are not 0..m-1 (children must be the first m candidates, so that
            sampled candidates are the first m draws without replacement, as the lossless rule needs).

    Example:
        >>> t = template_from_choices([(0,), (1,), (0, 0)])
        >>> t.ranks, t.parents.tolist()
        (((0,), (1,), (0, 0)), [-1, -1, 0])
    """
    ranks = sorted({tuple(int(x) for x in c) for c in choices}, key=lambda c: (len(c), c))
    if len(ranks) != len(choices):
        raise ValueError("duplicate or empty entries in the choice list")
    index = {r: i for i, r in enumerate(ranks)}
    parents = []
    kids: dict[tuple[int, ...], list[int]] = {}
    for r in ranks:
        if not r or min(r) < 0:
            raise ValueError(f"bad choice {r}: ranks must be non-empty tuples of non-negative ints")
        parent = r[:-1]
        if parent and parent not in index:
            raise ValueError(f"choice {r} has no parent {parent} in the list")
        parents.append(index[parent] if parent else -1)
        kids.setdefault(parent, []).append(r[-1])
    for parent, rs in kids.items():
        if sorted(rs) != list(range(len(rs))):
            raise ValueError(f"children of {parent or 'the root'} have ranks {sorted(rs)}; they must be 0..{len(rs) - 1}")
    return TreeTemplate(tuple(ranks), torch.tensor(parents, dtype=torch.long))


def chain_template(depth: int) -> TreeTemplate:
    """A chain of ``depth`` nodes: choices (0,), (0, 0), ..."""
    return template_from_choices([(0,) * t for t in range(1, depth + 1)])


def best_first_template(scores: Sequence[Sequence[float]], budget: int) -> TreeTemplate:
    """The ``budget`` rank tuples with the highest path score, as a tree (EAGLE-2 style expansion).

    The score of (r_1..r_t) is prod_j ``scores[j][r_j]``, with each ``scores[j]`` sorted in decreasing
    order and in [0, 1]; so a child never outscores its parent nor a sibling of lower rank, and the
    best-first expansion below (pop the best tuple, push its first child and its next sibling)
    always yields a valid tree whose children have ranks 0..m-1. Ties go to the shallower, then the
    lexicographically smaller tuple.

    Args:
        scores: per depth t, the sorted probabilities of the candidates at that depth (their count is
            the width at that depth).
        budget: maximum number of nodes.
    """
    depth = len(scores)
    out: list[tuple[int, ...]] = []
    if depth == 0 or budget <= 0 or len(scores[0]) == 0:
        return template_from_choices(out)
    heap = [(-float(scores[0][0]), 1, (0,))]
    while heap and len(out) < budget:
        neg, _, r = heapq.heappop(heap)
        out.append(r)
        t = len(r)
        if r[-1] + 1 < len(scores[t - 1]):  # next sibling: replace this depth's factor
            prev = float(scores[t - 1][r[-1]])
            s = -neg / prev * float(scores[t - 1][r[-1] + 1]) if prev > 0 else 0.0
            sib = r[:-1] + (r[-1] + 1,)
            heapq.heappush(heap, (-s, t, sib))
        if t < depth and len(scores[t]) > 0:  # first child
            heapq.heappush(heap, (neg * float(scores[t][0]), t + 1, r + (0,)))
    return template_from_choices(out)


# ---------------------------------------------------------------------------------------------
# Candidates and the ParallelSpec tree
# ---------------------------------------------------------------------------------------------


def draft_candidates(
    probs: torch.Tensor, k: int, sample: bool, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The k candidates of one draft distribution.

    Args:
        probs: [v] float probabilities (already temperature / top-p processed when sampling).
        k: how many candidates (at most the size of the support when sampling).
        sample: False -> top-k (greedy verification); True -> k draws *without replacement* in draw
            order (Gumbel-top-k: argsort of log q + Gumbel noise), as the recursive rejection sampling
            rule of :func:`drafttrain.verify.acceptance.speculative_sampling_tree` requires.

    Returns:
        [min(k, support)] int64 token ids.
    """
    if not sample:
        return torch.topk(probs, min(k, probs.numel())).indices
    support = int((probs > 0).sum())
    k = min(k, support)
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    keys = torch.where(probs > 0, probs.double().log() + gumbel, torch.full_like(gumbel, float("-inf")))
    return torch.topk(keys, k).indices


def parallelspec_tree(
    draft_probs: torch.Tensor,
    widths: Sequence[int],
    budget: int,
    sample: bool = False,
    generator: torch.Generator | None = None,
    template: TreeTemplate | None = None,
) -> DraftTree:
    """The ParallelSpec draft tree from one drafter forward pass (ParallelSpec Algorithm 1 + Appendix A.3).

    The parallel drafter gives one distribution per future position, q_1..q_D (D = K + 1), the same
    for every node at a depth. Depth t gets ``widths[t-1]`` candidates (top-k, or draws without
    replacement when sampling). The shape is either ``template`` (a static choice list, truncated to
    the widths and the budget) or, by default, the ``budget`` rank tuples with the highest product of
    *sorted* probabilities (:func:`best_first_template`). The shape depends only on the
    distributions, never on which tokens were drawn, which keeps sampled verification lossless.

    Args:
        draft_probs: [D, v] float draft distributions of depths 1..D.
        widths: candidates per depth (len <= D; depths beyond it are not drafted).
        budget: maximum number of nodes.
        sample: draw candidates (sampling) instead of taking the top-k (greedy).
        generator: RNG for the draws.
        template: optional static shape (rank tuples) instead of the best-first one.

    Returns:
        A :class:`DraftTree` with ``draft_probs`` and ``dist_index`` = depth - 1.
    """
    depth = min(len(widths), draft_probs.shape[0])
    cands = [draft_candidates(draft_probs[t], int(widths[t]), sample, generator) for t in range(depth)]
    avail = [c.numel() for c in cands]
    if template is None:
        sorted_p = [torch.topk(draft_probs[t], avail[t]).values.tolist() for t in range(depth)]  # the w largest
        template = best_first_template(sorted_p, budget)
    else:
        template = template.truncate(avail, budget)
    return template.fill(cands, draft_probs[:depth])
