"""Improved multi-candidate speculative decoding (MCSD): target-initialized multi-candidate trees,
the dynamic sliced topology-aware mask, and the early-stopping decision model.

Source: Lu et al., "Improving Multi-candidate Speculative Decoding".

Tree topology (§3.1, §4.1). A configuration ``(W_t, k_1, ..., k_gamma)``: W_t tokens are sampled from
the *target's* distribution at the current position ("target model initialized multi-candidate
generation"), and the drafter grows each of them level by level, every node of level i - 1 getting
k_i children. The paper's best static configuration (2, 4, 3, 1, 1) has per root
4 + 4*3 + 4*3*1 + 4*3*1*1 = 40 drafted tokens and 2*4*3*1*1 = 24 candidate sequences; its mask is
(W_t + drafted)^2 = 82^2. In the verifier's tree contract (root = the last committed token, excluded):

- W_t = 1: the single target-sampled token *is* the verifier's bonus token, which is committed and is
  the root; the tree is the k-tree below it (k_1 children of the root, ...). With a lossless
  multi-candidate rule this is lossless (``is_lossless``), as the paper observes (MT-bench score within
  +-0.05 at W_t = 1).
- W_t > 1: the W_t target samples are nodes 0..W_t-1 (``parents = -1``), each with its own k-tree.
  Keeping the root whose subtree yields the longest accepted sequence makes the output distribution
  ``P_target(t) * P_acceptance(t+1, t+2, ... | t)`` (§3.1): **lossy** (``is_lossless = False``).

Node order is level order (all target roots, then all level-1 drafts, ...; children grouped under
their parent in parent order), so the nodes of the first l levels are a prefix of the node list.

Dynamic sliced topology-aware mask (§3.2): "construct a large topology-aware causal mask during
initialization" for the maximum depth, and take its upper-left ``n_l x n_l`` block when drafting stops
after level l — equal to a mask built from scratch for the truncated configuration, which
:class:`SlicedTreeMask` provides (no mask is rebuilt while drafting).

Decision model (§3.3, :mod:`~drafttrain.verify.methods.mcsd_decision`): a small MLP on drafter hidden
states (type 1, three layers) or on the top-k probabilities and entropy of the drafter's distribution
(type 2, two layers) predicting whether the target accepts the token; drafting stops early when the
predicted probabilities of all candidate sequences are below a threshold beta (0.4 in the paper).

In the engine: :class:`MCSDProposer` (module-level notes below); in the harness the ``mcsd`` method
(section ``mcsd.*`` = :class:`MCSDEvalConfig`): one run per W_t, plus early-stop runs per beta.

:class:`MCSDProposer` notes. W_t = 1: the verifier's bonus token is the root, drafts are verified by
the engine's lossless multi-candidate rule (greedy tree walk / recursive rejection sampling):
**lossless**. W_t > 1: the target's distribution after the last accepted token is kept instead of
sampling one bonus token from it; the next tree starts from W_t tokens drawn from it (the "target
model initialized" roots) and the root whose subtree is accepted furthest wins
(:func:`target_initialized_accept`): **lossy**. Such steps emit no bonus token (``Acceptance.bonus =
None``): their "bonus" is the chosen root of the next tree. The first step of a sequence, and any step
after one that accepted nothing, has no kept distribution and runs as W_t = 1. Our trained drafter is
ParallelSpec's parallel one: one forward gives q_1..q_{K+1} for depths 1..K+1 after the root, the same
for every node at a depth (as Medusa heads), so "the drafter's distribution after node x at depth d"
is q_{d+1} whatever x is (it reuses :class:`~drafttrain.verify.proposers.ParallelSpecProposer`'s
drafter KV cache and batched forward).

Shape letters: n tree nodes, v vocabulary, W target roots, f frontier nodes, d hidden size, k top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod

import torch

from drafttrain.config import GE1, UNIT
from drafttrain.sampling import GREEDY, process_logits
from drafttrain.verify.acceptance import Acceptance, accept, target_rows
from drafttrain.verify.methods.mcsd_decision import level_features
from drafttrain.verify.methods.registry import Method, MethodContext, Variant, register
from drafttrain.verify.methods.sssd import MembershipResult, membership_walk
from drafttrain.verify.proposers import ParallelSpecProposer
from drafttrain.verify.tree import DraftTree


# ---------------------------------------------------------------------------------------------
# configuration and topology
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MCSDConfig:
    """A static MCSD configuration ``(W_t, k_1, ..., k_gamma)`` (§4.1).

    Attributes:
        ks: children per node at each drafted level (k_1..k_gamma), each >= 1.
        num_target_roots: W_t >= 1, tokens sampled from the target to start the tree.
    """

    ks: tuple[int, ...]
    num_target_roots: int = 1

    def __post_init__(self):
        if len(self.ks) < 1 or any(int(k) < 1 for k in self.ks):
            raise ValueError(f"ks must be a non-empty sequence of ints >= 1, got {self.ks}")
        if self.num_target_roots < 1:
            raise ValueError(f"num_target_roots must be >= 1, got {self.num_target_roots}")
        object.__setattr__(self, "ks", tuple(int(k) for k in self.ks))

    @property
    def is_lossless(self) -> bool:
        """False when W_t > 1: choosing among target-sampled roots by acceptance length changes the
        output distribution (§3.1). True for W_t = 1 when drafts are verified by a lossless rule."""
        return self.num_target_roots == 1

    @property
    def depth(self) -> int:
        """gamma, the number of drafted levels."""
        return len(self.ks)

    @property
    def num_drafted(self) -> int:
        """Drafted tokens: W_t * (k_1 + k_1 k_2 + ... + k_1...k_gamma)."""
        return self.num_target_roots * sum(prod(self.ks[: i + 1]) for i in range(len(self.ks)))

    @property
    def num_nodes(self) -> int:
        """Tree nodes in the verifier's contract: drafted tokens, plus the W_t roots when W_t > 1."""
        return self.num_drafted + (self.num_target_roots if self.num_target_roots > 1 else 0)

    @property
    def num_candidate_sequences(self) -> int:
        """Leaves: W_t * k_1 * ... * k_gamma."""
        return self.num_target_roots * prod(self.ks)


@dataclass
class MCSDTopology:
    """Static shape of an MCSD tree (no tokens).

    Attributes:
        parents: int64 [n], -1 = child of the committed root, else the parent's index (< own index).
        levels: int64 [n], drafter iteration that produced the node: 0 for target-sampled roots
            (W_t > 1), 1..gamma for drafted nodes.
        is_target_root: bool [n].
        level_end: ``level_end[l]`` = number of nodes of levels <= l (l = 0..gamma).
    """

    parents: torch.Tensor
    levels: torch.Tensor
    is_target_root: torch.Tensor
    level_end: list[int]


def mcsd_topology(ks: Sequence[int], num_target_roots: int = 1) -> MCSDTopology:
    """Level-order topology of the configuration ``(num_target_roots, *ks)`` (see module docstring).

    Example (W_t = 2, ks = (2, 1))::

        node     0  1 | 2  3  4  5 | 6  7  8  9
        parent  -1 -1 | 0  0  1  1 | 2  3  4  5
        level    0  0 | 1  1  1  1 | 2  2  2  2

    Raises:
        ValueError: see :class:`MCSDConfig`.
    """
    cfg = MCSDConfig(tuple(ks), num_target_roots)
    parents: list[int] = []
    levels: list[int] = []
    if cfg.num_target_roots > 1:
        frontier = list(range(cfg.num_target_roots))
        parents += [-1] * cfg.num_target_roots
        levels += [0] * cfg.num_target_roots
    else:
        frontier = [-1]
    level_end = [len(parents)]
    for level, k in enumerate(cfg.ks, start=1):
        new = []
        for node in frontier:
            for _ in range(k):
                new.append(len(parents))
                parents.append(node)
                levels.append(level)
        frontier = new
        level_end.append(len(parents))
    n = len(parents)
    return MCSDTopology(
        parents=torch.tensor(parents, dtype=torch.long),
        levels=torch.tensor(levels, dtype=torch.long),
        is_target_root=torch.tensor([lv == 0 for lv in levels], dtype=torch.bool).reshape(n),
        level_end=level_end,
    )


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Topology-aware causal mask of a tree, built from scratch: the node block of :meth:`DraftTree.ancestor_mask`.

    Args:
        parents: int64 [n], parents[i] in [-1, i).

    Returns:
        bool [n, n]; ``mask[i, j]`` is True iff node j is node i or an ancestor of it (the committed
        root and the KV cache, which every node sees, are not part of this block).

    Raises:
        ValueError: ``parents[i]`` not in [-1, i).
    """
    return DraftTree(torch.zeros_like(parents), parents).ancestor_mask()[1:, 1:].contiguous()


class SlicedTreeMask:
    """Dynamic sliced topology-aware mask (§3.2): built once for the full configuration, sliced per level.

    Args:
        config: the maximum configuration ``(W_t, k_1..k_gamma)``.

    Attributes:
        topology: :class:`MCSDTopology` of the full tree.
        full: bool [n, n], :func:`tree_ancestor_mask` of the full tree.
    """

    def __init__(self, config: MCSDConfig):
        self.config = config
        self.topology = mcsd_topology(config.ks, config.num_target_roots)
        self.full = tree_ancestor_mask(self.topology.parents)

    def num_nodes(self, level: int) -> int:
        """Nodes of levels <= ``level`` (0 <= level <= gamma)."""
        if not 0 <= level <= self.config.depth:
            raise ValueError(f"level must be in [0, {self.config.depth}], got {level}")
        return self.topology.level_end[level]

    def mask(self, level: int) -> torch.Tensor:
        """bool [n_l, n_l]: the upper-left block of the full mask (a view, no copy)."""
        n = self.num_nodes(level)
        return self.full[:n, :n]

    def parents(self, level: int) -> torch.Tensor:
        """int64 [n_l]: parents of the tree truncated after ``level``."""
        return self.topology.parents[: self.num_nodes(level)]


# ---------------------------------------------------------------------------------------------
# growing a tree
# ---------------------------------------------------------------------------------------------
@dataclass
class MCSDTree:
    """An MCSD draft tree in the verifier's contract (``DraftTree(**tree.contract())``).

    Attributes:
        tokens: int64 [n]; parents: int64 [n] (level order, see :func:`mcsd_topology`).
        draft_probs: float [r, v], the drafter distribution of every frontier node that was expanded,
            in expansion order; dist_index: int64 [n], the row each node was drawn from (-1 for
            target-sampled roots, which come from the target).
        num_target_roots: W_t; levels: drafted levels actually grown (< gamma after an early stop).
        is_lossless: see :attr:`MCSDConfig.is_lossless`.
        replacement: whether siblings were drawn with replacement (a lossless multi-candidate rule
            must match: i.i.d. draws for SpecInfer-style rules, without replacement for MCSD's).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor
    dist_index: torch.Tensor
    num_target_roots: int
    levels: int
    is_lossless: bool
    replacement: bool

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def contract(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "parents": self.parents, "draft_probs": self.draft_probs, "dist_index": self.dist_index}


def sample_target_roots(
    target_probs: torch.Tensor, num_roots: int, generator: torch.Generator | None = None, greedy: bool = False
) -> torch.Tensor:
    """The W_t target-initialized tokens (§3.1): drawn from the target's next-token distribution
    without replacement (distinct roots), or its top-W_t when ``greedy``.

    Args:
        target_probs: float [v] (need not be normalised).

    Returns:
        int64 [W_t], in draw order (greedy: by decreasing probability).
    """
    if greedy:
        return torch.topk(target_probs, num_roots).indices
    return torch.multinomial(target_probs.float(), num_roots, replacement=False, generator=generator)


DraftStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow_mcsd_tree(
    draft_step: DraftStep,
    config: MCSDConfig,
    target_roots: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    replacement: bool = False,
    stop: Callable[[int, torch.Tensor], bool] | None = None,
) -> MCSDTree:
    """Grow the ``(W_t, k_1..k_gamma)`` tree level by level with a drafter.

    Args:
        draft_step: ``(tokens [m], parents [m], frontier [f]) -> probs [f, v]``: the drafter's
            next-token distributions after each frontier node (index -1 = the committed root) of the
            tree built so far. A tree-attention drafter can take its mask from
            ``SlicedTreeMask(config).mask(level)`` since the tree so far is exactly that slice.
        config: the configuration; W_t must equal ``len(target_roots)`` when it is > 1.
        target_roots: int64 [W_t] from :func:`sample_target_roots` (W_t > 1), or None (W_t = 1: the
            verifier's bonus token is the committed root).
        generator, greedy: children are the top-k_i tokens when greedy, else sampled.
        replacement: sample siblings with replacement (i.i.d.) or without (distinct).
        stop: optional ``(level, probs [f, v]) -> bool``, called after each level but the last with the
            distributions just used; True stops growth there (the decision model's early stop, §3.3).

    Returns:
        :class:`MCSDTree` whose parents equal ``SlicedTreeMask(config).parents(tree.levels)``.

    Raises:
        ValueError: ``target_roots`` does not match W_t.
    """
    w = config.num_target_roots
    if w > 1:
        if target_roots is None or target_roots.shape != (w,):
            raise ValueError(f"W_t = {w} needs target_roots of shape [{w}]")
        tokens = [int(t) for t in target_roots.tolist()]
        parents = [-1] * w
        dist = [-1] * w
        frontier = list(range(w))
    else:
        if target_roots is not None and target_roots.numel() != 1:
            raise ValueError("W_t = 1 takes target_roots=None (or one token, the committed root)")
        tokens, parents, dist, frontier = [], [], [], [-1]
    rows: list[torch.Tensor] = []
    levels = 0
    for level, k in enumerate(config.ks, start=1):
        probs = draft_step(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), torch.tensor(frontier, dtype=torch.long)
        )  # [f, v]
        if probs.shape[0] != len(frontier):
            raise ValueError(f"draft_step returned {probs.shape[0]} rows for {len(frontier)} frontier nodes")
        if greedy:
            children = torch.topk(probs, k, dim=-1).indices  # [f, k]
        else:
            children = torch.multinomial(probs.float(), k, replacement=replacement, generator=generator)  # [f, k]
        new_frontier = []
        for j, node in enumerate(frontier):
            row = len(rows) + j
            for tok in children[j].tolist():
                new_frontier.append(len(tokens))
                tokens.append(int(tok))
                parents.append(node)
                dist.append(row)
        rows.extend(probs.unbind(0))
        frontier = new_frontier
        levels = level
        if stop is not None and level < config.depth and stop(level, probs):
            break
    vocab = rows[0].shape[-1] if rows else 0
    return MCSDTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        draft_probs=torch.stack(rows) if rows else torch.zeros(0, vocab),
        dist_index=torch.tensor(dist, dtype=torch.long),
        num_target_roots=w,
        levels=levels,
        is_lossless=config.is_lossless,
        replacement=replacement,
    )


def target_initialized_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_target_roots: int,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> MembershipResult:
    """Verify a tree with W_t target-sampled roots and keep the root with the longest acceptance (§3.1).

    LOSSY for W_t > 1 (the choice among roots depends on how well each subtree is accepted). Within
    each root's subtree the drafts are verified with the membership rule (sample the target at the
    node, accept if among the children; :func:`drafttrain.verify.methods.sssd.membership_walk`); the
    verifier's lossless multi-candidate rule can replace it per subtree. Ties go to the lower root
    index (the first draw; under greedy the target's argmax). W_t = 1 is the plain membership rule.

    Args:
        tokens, parents: int64 [n] (roots = nodes 0..W_t-1 when W_t > 1).
        target_probs: float [n + 1, v]; row 0 after the committed root, row i + 1 after node i.

    Returns:
        :class:`~drafttrain.verify.methods.sssd.MembershipResult`: the accepted nodes (the chosen root first)
        and the tokens to commit (their tokens + one bonus token from the target).
    """
    if target_probs.shape[0] != tokens.shape[0] + 1:
        raise ValueError(f"target_probs must be [n + 1, v], got {tuple(target_probs.shape)}")
    toks, pars = tokens.tolist(), parents.tolist()

    def next_token(node: int) -> int:
        row = target_probs[node + 1]
        return int(torch.argmax(row)) if greedy else int(torch.multinomial(row.float(), 1, generator=generator))

    if num_target_roots == 1:
        return membership_walk(toks, pars, next_token)
    best: MembershipResult | None = None
    for r in range(num_target_roots):
        if pars[r] != -1:
            raise ValueError(f"node {r} is not a target root (parent {pars[r]})")
        # re-root at r: r's children hang from the walk's root (-1); the roots get an unreachable
        # parent (-2), which also cuts off the other roots' subtrees
        sub = [-1 if p == r else (-2 if p == -1 else p) for p in pars]
        res = membership_walk(toks, sub, lambda node, r=r: next_token(r if node == -1 else node))
        res = MembershipResult([r] + res.accepted_nodes, [toks[r]] + res.tokens)
        if best is None or len(res.accepted_nodes) > len(best.accepted_nodes):
            best = res
    assert best is not None
    return best


# ---------------------------------------------------------------------------------------------
# the engine proposer (MCSD-improved §3.1, §4.1; the decision model of §3.3 in mcsd_decision.py)
# ---------------------------------------------------------------------------------------------
class MCSDProposer(ParallelSpecProposer):
    """Improved MCSD trees ``(W_t, k_1..k_γ)`` grown by a parallel drafter (module docstring).

    Args:
        drafter: a ParallelSpec drafter (``propose`` / the batched interface of :class:`ParallelSpecProposer`).
        config: :class:`MCSDConfig`; levels beyond the drafter's depths are
            dropped (W_t = 1: K + 1 levels at most; W_t > 1: K, the roots take depth 1).
        batched: one drafter forward for the whole batch (see :class:`ParallelSpecProposer`).
        decision_model: optional early-stop model (§3.3; :func:`drafttrain.verify.methods.mcsd_decision.load_decision_model`)
            on :func:`level_features`: level l + 1 is grown only while the product of the predicted
            acceptance of levels 1..l + 1 is >= ``beta`` (0.4 in the paper). W_t = 1 trees only. The
            decision reads the drafter's distributions, never the drawn tokens, so W_t = 1 stays lossless.
        decision_topk: k of the features when logging without a model (a model brings its own).
        log_decisions: collect ``{"features", "label"}`` per level that was reached (its parent level
            accepted) in :attr:`decisions`: the decision model's training data (``scripts.train_decision_model``).

    Attributes:
        lossless: ``config.is_lossless`` (W_t == 1).
    """

    def __init__(self, drafter, config: MCSDConfig, batched: bool = True, decision_model=None, beta: float = 0.4,
                 decision_topk: int = 8, log_decisions: bool = False):  # fmt: skip
        super().__init__(drafter, batched=batched)
        self.config = config
        self.decision_model = decision_model.eval() if decision_model is not None else None
        self.beta = float(beta)
        self.decision_topk = int(getattr(decision_model, "topk", decision_topk))
        self.decisions: list[dict] | None = [] if log_decisions else None  # (features, depth, label) per reached level
        self._level_feats: dict[int, torch.Tensor] = {}
        self.name = f"mcsd_w{config.num_target_roots}"
        self.lossless = config.is_lossless
        k1 = self.depth
        self._cfg1 = MCSDConfig(config.ks[:k1], 1)  # W_t = 1 shape (also the W_t > 1 mode's first step)
        self._cfg_w = MCSDConfig(config.ks[: max(k1 - 1, 1)], config.num_target_roots)
        self._next: dict[int, torch.Tensor] = {}  # slot -> target distribution after the next root [v]
        self._rooted: dict[int, bool] = {}  # slot -> this step's tree has W_t target roots

    def release(self, slot) -> None:
        super().release(slot)
        self._next.pop(slot, None)
        self._rooted.pop(slot, None)

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        logits = self._draft_logits_batched(slots) if self.batched else [self._draft_logits_one(s) for s in slots]
        trees = []
        for slot, lg in zip(slots, logits):  # [K + 1, v]: the drafter's distributions of depths 1..K + 1
            probs = torch.softmax(lg.float(), dim=-1) if sampling.greedy else process_logits(lg, sampling)
            nxt = self._next.pop(slot, None)
            w = self.config.num_target_roots
            # W_t distinct draws need W_t tokens of nonzero mass (top-p can leave fewer): else a W_t = 1 step
            rooted = nxt is not None and w > 1 and int((nxt > 0).sum()) >= w
            self._rooted[slot] = rooted
            if rooted:  # depth 1 = W_t target draws; level l (depth l + 1) grows from q_{l+1}
                roots = sample_target_roots(nxt, w, generator, greedy=sampling.greedy)
                cfg = self._cfg_w
            else:
                roots, cfg = None, self._cfg1
            depth_of: list[int] = []

            def step(tokens, parents, frontier, probs=probs, depth_of=depth_of):
                while len(depth_of) < tokens.numel():  # depths of the nodes added since the last call
                    p = int(parents[len(depth_of)])
                    depth_of.append(1 if p < 0 else depth_of[p] + 1)
                # children of a node at depth d are drawn from q_{d+1} (row d; the committed root is depth 0)
                return probs[[0 if f < 0 else depth_of[f] for f in frontier.tolist()]]

            stop = None
            if not rooted and (self.decision_model is not None or self.decisions is not None):
                feats = level_features(probs[: len(cfg.ks)], self.decision_topk)  # [levels, k + 2]
                self._level_feats[slot] = feats
                if self.decision_model is not None:
                    p_level = self.decision_model.accept_prob(feats)  # [levels]

                    def stop(level, _probs, p_level=p_level):  # grow level + 1 only if some path may reach it
                        return bool(torch.prod(p_level[: level + 1]) < self.beta)

            t = grow_mcsd_tree(step, cfg, roots, generator, greedy=sampling.greedy, replacement=False, stop=stop)
            if rooted:  # the roots come from the target, not a draft distribution: the rule needs none
                trees.append(DraftTree(t.tokens, t.parents))
            else:
                trees.append(DraftTree(t.tokens, t.parents, t.draft_probs, t.dist_index))
        return trees

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        """W_t = 1 trees: the engine's lossless rule; W_t > 1 trees: the best target root (lossy).

        With W_t > 1 configured, a step that accepted something keeps the target's distribution after
        its last accepted node for the next tree's roots and emits no bonus token.
        """
        w = self.config.num_target_roots
        if self._rooted.get(slot):
            res = target_initialized_accept(tree.tokens, tree.parents, w, target_rows(target_logits, sampling),
                                            generator, greedy=sampling.greedy)  # fmt: skip
            acc = Acceptance(res.accepted_nodes, None)
        else:
            acc = accept(tree, target_logits, sampling, generator, replacement=False)
            feats = self._level_feats.pop(slot, None)
            if self.decisions is not None and feats is not None:  # a level is a decision once its parent level was accepted
                levels = int(tree.depth().max()) if tree.n else 0
                for lv in range(1, min(levels, len(acc.path) + 1) + 1):
                    self.decisions.append({"features": feats[lv - 1].tolist(), "label": int(len(acc.path) >= lv)})
            if w == 1 or not acc.path:
                return acc
            acc = Acceptance(acc.path, None)
        row = target_logits[acc.path[-1] + 1].float()
        self._next[slot] = torch.softmax(row, -1) if sampling.greedy else process_logits(row, sampling)
        return acc


# ---------------------------------------------------------------------------------------------
# the method in the harness: config section, registry entry
# ---------------------------------------------------------------------------------------------
@dataclass
class MCSDEvalConfig:
    """``mcsd.*`` of ``conf/evaluate.yaml`` (MCSD-improved §3.1, §4.1): one run per W_t in ``target_roots``
    with levels ``ks``, plus early-stop runs with a decision model (§3.3)."""

    ks: list[int] = field(default_factory=lambda: [3, 2, 1, 1])
    target_roots: list[int] = field(default_factory=lambda: [1, 2])
    decision_model: str | None = None  # early-stop model folder (scripts.train_decision_model); adds an "mcsd_w1_dm" run
    beta: float = 0.4  # early-stop threshold (§3.3)
    betas: list[float] | None = None  # a threshold sweep instead: one "mcsd_w1_dm_b<beta>" run per value
    decisions_out: str | None = None  # append W_t = 1 runs' (level features, accepted) rows here: the model's data
    decision_topk: int = 8  # k of the logged features

    numeric_ranges = dict(ks=GE1, target_roots=GE1, beta=UNIT, betas=UNIT, decision_topk=GE1)


def _check(c) -> list[str]:
    m = c.mcsd
    if not m.ks or min(m.ks) < 1 or not m.target_roots or min(m.target_roots) < 1:
        return ["mcsd.ks and mcsd.target_roots must be non-empty lists of ints >= 1"]
    return []


def _build(ctx: MethodContext) -> list[Variant]:
    import json
    from pathlib import Path

    c, m, drafter = ctx.config, ctx.config.mcsd, ctx.drafter
    if drafter.spec.drafting != "parallel":  # the drafter's declaration (drafters/base.py DrafterSpec)
        raise ValueError(f"mcsd grows its trees from the per-depth distributions of one drafter pass: use a "
                         f"parallel drafter's checkpoint for it (parallelspec, parallelspec_eagle, medusa), not "
                         f"'{drafter.name}', which drafts {drafter.spec.drafting}")  # fmt: skip
    decisions_file = Path(m.decisions_out) if m.decisions_out else None

    def write_decisions(prop, rec, bs):
        if decisions_file is None or not prop.decisions:
            return
        decisions_file.parent.mkdir(parents=True, exist_ok=True)
        with decisions_file.open("a") as f:
            for row in prop.decisions:
                f.write(json.dumps({**row, "prompts": c.prompts, "batch_size": bs}) + "\n")
        rec["decisions_logged"] = len(prop.decisions)

    variants = [Variant(f"mcsd_w{w}", lambda bs, refs, w=w: MCSDProposer(
        drafter, MCSDConfig(tuple(m.ks), w), log_decisions=decisions_file is not None and w == 1,
        decision_topk=m.decision_topk), finish=write_decisions) for w in m.target_roots]  # fmt: skip
    if m.decision_model:
        from drafttrain.verify.methods.mcsd_decision import load_decision_model

        model = load_decision_model(m.decision_model)
        betas = [("mcsd_w1_dm", m.beta)] if not m.betas else [(f"mcsd_w1_dm_b{b:g}", b) for b in m.betas]
        variants += [Variant(label, lambda bs, refs, beta=beta: MCSDProposer(
            drafter, MCSDConfig(tuple(m.ks), 1), decision_model=model, beta=beta)) for label, beta in betas]  # fmt: skip
    return variants


MCSD = register(Method("mcsd", _build, needs_drafter=True, lossless=None, config=MCSDEvalConfig, check=_check,
                       summary="improved MCSD trees grown by the drafter; W_t = 1 lossless, W_t > 1 lossy"))  # fmt: skip
