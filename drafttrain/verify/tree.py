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

Trees are host-side bookkeeping: the index tensors built here (parents, depths, ancestor masks, tokens
from lists) are CPU tensors whatever torch's default device is; the engine moves what a forward needs.
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


def _depths(parents: list[int]) -> torch.Tensor:
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return torch.tensor(d, dtype=torch.long, device="cpu")


def _host(x, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a ``dtype`` tensor: a tensor stays on its device, anything else (a list) goes to the CPU."""
    return torch.as_tensor(x, dtype=dtype, device=x.device if isinstance(x, torch.Tensor) else "cpu")


def _children(parents: list[int]) -> tuple[tuple[int, ...], ...]:
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return tuple(tuple(k) for k in kids)


def _ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n + 1, n + 1, dtype=torch.bool, device="cpu")
    m[:, 0] = True  # everyone sees the root
    for i, p in enumerate(parents):
        m[i + 1] = m[p + 1]  # the parent's ancestors (row p+1 is final: p < i)
        m[i + 1, i + 1] = True
    return m


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
        scores: optional [n] float, the drafter's confidence in each node's whole path (product of its
            probabilities along the path; a child never scores above its parent). Read by
            :mod:`drafttrain.verify.planner` to decide how many nodes are worth verifying.
        sources: optional [n] int64, who proposed each node: 0 the drafter, 1 another proposer only
            (SSSD's training-free candidates in a hybrid tree, :mod:`drafttrain.verify.hybrid`), 2 both.
            The planner calibrates each source's scores on their own (their scales differ).

    The structure (:meth:`depth`, :meth:`children`, :meth:`ancestor_mask`) is computed once per tree
    and kept (trees are not modified after construction); trees filled from a :class:`TreeTemplate`
    get it from the template and skip validation (:meth:`trusted`): the template was validated once.

    Raises:
        ValueError: shapes disagree, a parent does not precede its child, siblings come from
            different distributions, or an index is out of range.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    dist_index: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sources: torch.Tensor | None = None

    @classmethod
    def trusted(cls, tokens: torch.Tensor, parents: torch.Tensor, draft_probs=None, dist_index=None, scores=None,
                structure: dict | None = None, sources=None) -> "DraftTree":
        """A tree built without the checks of the constructor, for the drafting hot path: the caller
        guarantees the invariants (e.g. :meth:`TreeTemplate.fill`). ``structure``: precomputed
        ``depth`` / ``children`` / ``mask`` entries (as :meth:`depth`, :meth:`children`, :meth:`ancestor_mask`)."""
        tree = cls.__new__(cls)
        tree.tokens, tree.parents, tree.draft_probs, tree.dist_index, tree.scores, tree.sources = (
            tokens, parents, draft_probs, dist_index, scores, sources)  # fmt: skip
        if structure:
            tree.__dict__["_structure"] = dict(structure)
        return tree

    def _cached(self, key: str, compute):
        cache = self.__dict__.setdefault("_structure", {})
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def __post_init__(self):
        self.tokens = _host(self.tokens, torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long, device=self.tokens.device).reshape(-1)
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"tokens has {n} nodes but parents has {self.parents.numel()}")
        par = self.parents.tolist()
        for i, p in enumerate(par):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must be -1 or an earlier node (topological order)")
        if self.sources is not None:
            self.sources = _host(self.sources, torch.long).reshape(-1)
            if self.sources.numel() != n:
                raise ValueError(f"sources has {self.sources.numel()} entries for {n} nodes")
        if (self.draft_probs is None) != (self.dist_index is None):
            raise ValueError("draft_probs and dist_index go together")
        if self.dist_index is not None:
            self.dist_index = _host(self.dist_index, torch.long).reshape(-1)
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
        """[n] int64 depth of each node (children of the root have depth 1). Do not modify it (it is kept)."""
        return self._cached("depth", lambda: _depths(self.parents.tolist()))

    @property
    def max_depth(self) -> int:
        return int(self.depth().max()) if self.n else 0

    def children(self) -> list[list[int]]:
        """Children lists, length n + 1: entry 0 = the root's children, entry i + 1 = node i's, in node order."""
        return [list(k) for k in self._cached("children", lambda: _children(self.parents.tolist()))]

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
        Do not modify it (it is kept).
        """
        return self._cached("mask", lambda: _ancestor_mask(self.parents.tolist()))

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "DraftTree":
        """No candidates: verification then emits only the target's own next token (plain decoding)."""
        return cls(torch.zeros(0, dtype=torch.long, device="cpu"), torch.zeros(0, dtype=torch.long, device="cpu"))

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A chain d_1 -> d_2 -> ... (node i's parent is i - 1); ``draft_probs`` [n, v] row i drew node i."""
        tokens = _host(tokens, torch.long).reshape(-1)
        n = tokens.numel()
        dist = torch.arange(n, device="cpu") if draft_probs is not None else None
        return cls(tokens, torch.arange(n, device="cpu") - 1, draft_probs, dist)


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
        cands = [c.tolist() if isinstance(c, torch.Tensor) else list(c) for c in candidates]
        return self.fill_lists(cands, draft_probs)

    def fill_lists(self, candidates: Sequence[Sequence[int]], draft_probs: torch.Tensor | None = None,
                   scores: Sequence[Sequence[float]] | None = None) -> DraftTree:  # fmt: skip
        """:meth:`fill` from plain lists (the drafting hot path: no per-node tensor indexing, no re-validation).

        Args:
            candidates: ``candidates[t]`` = candidate ids at depth t + 1, best / first drawn first.
            draft_probs: as in :meth:`fill`.
            scores: optional ``scores[t][r]`` = the probability of candidate r at depth t + 1 (sorted
                decreasing); the tree's ``scores`` are then each node's product along its path.

        Raises:
            ValueError: a rank is beyond the candidates of its depth.
        """
        toks = []
        for r in self.ranks:
            t = len(r) - 1
            if t >= len(candidates) or r[-1] >= len(candidates[t]):
                raise ValueError(f"node {r} needs candidate {r[-1]} at depth {t + 1}, which is not there")
            toks.append(int(candidates[t][r[-1]]))
        st = self._structure()
        dist = st["dist"] if draft_probs is not None else None
        sc = None
        if scores is not None:
            vals: list[float] = []
            for i, r in enumerate(self.ranks):
                p = self.parent_list[i]
                vals.append((1.0 if p < 0 else vals[p]) * float(scores[len(r) - 1][r[-1]]))
            sc = torch.tensor(vals, dtype=torch.float32, device="cpu")
        toks_t = torch.tensor(toks, dtype=torch.long, device="cpu")
        return DraftTree.trusted(toks_t, self.parents, draft_probs, dist, sc,
                                 {"depth": st["depth"], "children": st["children"], "mask": st["mask"]})  # fmt: skip

    @property
    def parent_list(self) -> list[int]:
        return self._structure()["parent_list"]

    def _structure(self) -> dict:
        """Depths, children, ancestor mask and depth index of this shape, computed once (the template is immutable)."""
        st = self.__dict__.get("_cache")
        if st is None:
            par = self.parents.tolist()
            st = {"parent_list": par, "depth": _depths(par), "children": _children(par), "mask": _ancestor_mask(par),
                  "dist": torch.tensor([len(r) - 1 for r in self.ranks], dtype=torch.long, device="cpu")}  # fmt: skip
            object.__setattr__(self, "_cache", st)
        return st

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
    """Build a :class:`TreeTemplate` from a Medusa-style choice list (memoized: a shape seen before is
    returned as built then, with its structure already computed; templates are immutable).

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
    key = tuple(tuple(int(x) for x in c) for c in choices)
    hit = _TEMPLATES.get(key)
    if hit is not None:
        return hit
    tpl = _build_template(key)
    if len(_TEMPLATES) >= _TEMPLATE_CACHE_SIZE:
        _TEMPLATES.pop(next(iter(_TEMPLATES)))  # oldest first
    _TEMPLATES[key] = tpl
    return tpl


_TEMPLATES: dict[tuple[tuple[int, ...], ...], TreeTemplate] = {}
_TEMPLATE_CACHE_SIZE = 4096


def _build_template(choices: tuple[tuple[int, ...], ...]) -> TreeTemplate:
    ranks = sorted(set(choices), key=lambda c: (len(c), c))
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
    return TreeTemplate(tuple(ranks), torch.tensor(parents, dtype=torch.long, device="cpu"))


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
    sorted_p = [torch.topk(draft_probs[t], avail[t]).values.tolist() for t in range(depth)]  # the w largest
    if template is None:
        template = best_first_template(sorted_p, budget)
    else:
        template = template.truncate(avail, budget)
    return template.fill_lists([c.tolist() for c in cands], draft_probs[:depth], sorted_p)


def parallelspec_trees_greedy(
    logits: torch.Tensor,
    widths: Sequence[int],
    budget: int,
    template: TreeTemplate | None = None,
    d2t: torch.Tensor | None = None,
) -> list[DraftTree]:
    """:func:`parallelspec_tree` for a whole batch under greedy verification, from draft-vocabulary logits.

    The same trees as ``parallelspec_tree(softmax(full_vocab_logits), widths, budget, template=template)``
    per row (same candidates, same shape; ties between equal probabilities aside), at a fraction of the
    cost: one softmax and one top-k over the N-entry draft vocabulary for the whole batch instead of a
    scatter into the v-entry vocabulary, a softmax and D top-k calls per sequence; shapes come from
    memoized templates; no ``draft_probs`` (greedy acceptance does not read them). Trees carry
    ``scores`` (path confidences) for the planner.

    Args:
        logits: [b, D, N] float drafter logits over the draft vocabulary (N = v when unrestricted).
        widths: candidates per depth; budget: maximum nodes; template: optional static shape.
        d2t: [N] int64 target id of each draft id (``Drafter.draft_token_ids``; None: the identity).

    Returns:
        b :class:`DraftTree` (greedy: no draft_probs), each with ``scores`` [n].
    """
    b, d_all, n_vocab = logits.shape
    depth = min(len(widths), d_all)
    widths = [min(int(w), n_vocab) for w in widths[:depth]]
    if b == 0 or depth == 0:
        return [DraftTree.empty() for _ in range(b)]
    top = torch.topk(torch.softmax(logits[:, :depth].float(), dim=-1), max(widths), dim=-1)  # [b, depth, w]
    ids = top.indices if d2t is None else d2t.to(top.indices.device)[top.indices]
    vals, ids = top.values.tolist(), ids.tolist()
    fixed = template.truncate(widths, budget) if template is not None else None
    trees = []
    for i in range(b):
        scores = [vals[i][t][: widths[t]] for t in range(depth)]
        tpl = fixed if fixed is not None else best_first_template(scores, budget)
        trees.append(tpl.fill_lists(ids[i], None, scores))
    return trees
