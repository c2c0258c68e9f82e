"""A hybrid draft tree: the trained drafter's tree plus SSSD's training-free candidates, verified together.

SSSD (Marzollo et al. 2024, §3.1) drafts from n-gram continuations of the context in the sequence's own
input (prompt + output so far, §3.1.1) and in a datastore of reference text (§3.1.2) at no model cost.
:class:`HybridProposer` asks the trained drafter for its tree and SSSD for its candidate tree, and
verifies their **union as one token trie**: a node both propose is verified once, an SSSD continuation
of a drafter node hangs below it, and the SSSD-only nodes (at most ``extra_nodes`` per sequence) are
appended after the drafter's. One verification forward checks both, so the SSSD candidates cost only
their extra verification inputs; with :class:`~drafttrain.verify.planner.PlannedProposer` on top, they
are verified only where their calibrated value pays for that cost.

Node scores (read by the planner, :attr:`~drafttrain.verify.tree.DraftTree.scores`): the drafter's path
confidence for its nodes, SSSD's fused pseudo-probability (§3.1.3) for the nodes only SSSD proposes,
the larger of the two where both propose a node.

Lossless: under greedy decoding the engine's rule (:func:`~drafttrain.verify.acceptance.accept_greedy`)
walks any token trie and emits the target's argmax at every step, so the output equals plain greedy
decoding token for token whatever the tree holds. Under sampling the drafter's acceptance rule
(recursive rejection sampling) needs every sibling set drawn from one draft distribution, which the
union breaks, so **at temperature > 0 the SSSD candidates are left out** and the drafter's own tree is
verified unchanged (still lossless); use SSSD's membership rule (``methods=[sssd]``) to sample from
SSSD candidates alone.

Shape letters: b sequences, n tree nodes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from drafttrain.sampling import GREEDY
from drafttrain.verify.tree import DraftTree

#: SSSD-only nodes per hybrid tree at most, where a caller names none (the evaluations' ``sssd.nodes`` default,
#: drafttrain.config.SSSDEvalConfig, equals it: tests/verify/test_sssd.py)
DEFAULT_EXTRA_NODES = 8


def merge_trees(tree: DraftTree, extra_tokens: Sequence[int], extra_parents: Sequence[int],
                extra_scores: Sequence[float], max_extra: int) -> DraftTree:  # fmt: skip
    """The union of a drafter's tree and another candidate tree, as one token trie.

    Args:
        tree: the drafter's tree (n nodes, topological order; ``scores`` optional).
        extra_tokens: [m] candidate ids of the other tree (topological order, parents first).
        extra_parents: [m] their parents (-1 = child of the root, else an index < own index, into the extra tree).
        extra_scores: [m] their scores (SSSD: fused pseudo-probabilities).
        max_extra: at most this many nodes are added (the other tree's first ones; the rest are dropped
            together with their descendants).

    Returns:
        a :class:`DraftTree` with the drafter's n nodes first (same indices, same tokens, scores raised to
        the other tree's where it proposes the same path) and up to ``max_extra`` new nodes after them;
        ``draft_probs`` / ``dist_index`` are dropped (the union is for greedy acceptance), ``scores``
        [n + k] float32 is set (drafter nodes without scores count as 1.0), and ``sources`` [n + k]:
        0 for a node only the drafter proposes, 2 for one both propose, 1 for the added nodes (the
        planner calibrates each on its own).

    Raises:
        ValueError: an extra node's parent does not precede it.
    """
    toks = tree.tokens.tolist()
    pars = tree.parents.tolist()
    scores = tree.scores.tolist() if tree.scores is not None else [1.0] * len(toks)
    sources = tree.sources.tolist() if tree.sources is not None else [0] * len(toks)
    index: dict[tuple[int, int], int] = {}  # (parent index in the union, token) -> union index
    for i, (t, p) in enumerate(zip(toks, pars)):
        index.setdefault((p, t), i)
    mapped: list[int | None] = []  # extra index -> union index (None: dropped)
    added = 0
    for j, (t, p, s) in enumerate(zip(extra_tokens, extra_parents, extra_scores)):
        t, p, s = int(t), int(p), float(s)
        if p >= j:
            raise ValueError(f"extra node {j} has parent {p}: parents must precede their children")
        parent = -1 if p < 0 else mapped[p]
        if p >= 0 and parent is None:  # its parent was dropped
            mapped.append(None)
            continue
        hit = index.get((parent, t))
        if hit is not None:
            scores[hit] = max(scores[hit], s)
            if sources[hit] == 0:  # a drafter node SSSD proposes too
                sources[hit] = 2
            mapped.append(hit)
        elif added < max_extra:
            index[(parent, t)] = len(toks)
            mapped.append(len(toks))
            toks.append(t)
            pars.append(parent)
            scores.append(s)
            sources.append(1)
            added += 1
        else:
            mapped.append(None)
    src = torch.tensor(sources, dtype=torch.long)
    if added == 0 and tree.scores is not None:
        return DraftTree.trusted(tree.tokens, tree.parents, scores=torch.tensor(scores, dtype=torch.float32), sources=src)
    return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long),
                     scores=torch.tensor(scores, dtype=torch.float32), sources=src)  # fmt: skip


class HybridProposer:
    """The trained drafter's proposer with SSSD candidates added to its trees (greedy; see the module doc).

    Args:
        inner: the drafter's proposer (:func:`~drafttrain.verify.proposers.proposer_for`); must use the
            engine's acceptance rule (no ``accept`` of its own).
        sssd: an :class:`~drafttrain.verify.methods.sssd.SSSDDrafter` (input trie, and a datastore if it has one).
        extra_nodes: SSSD-only nodes added per tree at most (>= 0; 0 = the drafter's tree, re-scored).

    Raises:
        ValueError: ``inner`` has its own acceptance rule, or ``extra_nodes`` < 0.
    """

    lossless = True

    def __init__(self, inner, sssd, extra_nodes: int = DEFAULT_EXTRA_NODES):
        if getattr(inner, "accept", None) is not None:
            raise ValueError(f"proposer {getattr(inner, 'name', inner)!r} has its own acceptance rule")
        if extra_nodes < 0:
            raise ValueError(f"extra_nodes must be >= 0, got {extra_nodes}")
        self.inner = inner
        self.sssd = sssd
        self.extra_nodes = int(extra_nodes)
        self.name = f"{getattr(inner, 'name', 'drafter')}+sssd"
        self._states: dict[int, object] = {}
        self.nodes_added = 0  # SSSD-only nodes offered, over all trees
        self.trees = 0

    def __getattr__(self, name):  # widths, budget, template, feature_layers, ... of the inner proposer
        if name in ("inner", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self.inner.start(slot, prompt_ids, hidden, first_token)
        self._states[slot] = self.sssd.new_state(list(prompt_ids) + [int(first_token)])

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        """Per slot: the drafter's tree, plus (greedy only) SSSD's candidates merged in (:func:`merge_trees`)."""
        trees = self.inner.draft(slots, sampling, generator)
        if not sampling.greedy or self.extra_nodes == 0:
            return trees
        cands = self.sssd.draft_batch([self._states[s] for s in slots], self.extra_nodes)
        out = []
        for tree, c in zip(trees, cands):
            merged = merge_trees(tree, c.tokens.tolist(), c.parents.tolist(), c.scores.tolist(), self.extra_nodes)
            self.nodes_added += merged.n - tree.n
            self.trees += 1
            out.append(merged)
        return out

    def commit(self, slot, tokens, hidden) -> None:
        self.inner.commit(slot, tokens, hidden)
        self._states[slot].append(int(t) for t in tokens)

    def release(self, slot) -> None:
        self.inner.release(slot)
        self._states.pop(slot, None)

    def summary(self) -> dict:
        return {"trees": self.trees, "sssd_nodes_per_tree": self.nodes_added / max(self.trees, 1)}


__all__ = ["merge_trees", "HybridProposer"]
