"""Improved multi-candidate speculative decoding (MCSD): target-initialized multi-candidate trees,
the dynamic sliced topology-aware mask, and the early-stopping decision model.

Source: Lu et al., "Improving Multi-candidate Speculative Decoding" (../shared/papers/MCSD-improved.txt).

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

Decision model (§3.3): a small MLP on drafter hidden states (type 1, three layers) or on the top-k
probabilities and entropy of the drafter's distribution (type 2, two layers) predicting whether the
target accepts the token; drafting stops early when the predicted probabilities of all candidate
sequences are below a threshold beta (0.4 in the paper).

Shape letters: n tree nodes, v vocabulary, W target roots, f frontier nodes, d hidden size, k top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain.verify.sssd import MembershipResult, membership_walk


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
    """Topology-aware causal mask of a tree, built from scratch.

    Args:
        parents: int64 [n], parents[i] in [-1, i).

    Returns:
        bool [n, n]; ``mask[i, j]`` is True iff node j is node i or an ancestor of it (the committed
        root and the KV cache, which every node sees, are not part of this block).

    Raises:
        ValueError: ``parents[i]`` not in [-1, i).
    """
    n = int(parents.shape[0])
    if bool(((parents < -1) | (parents >= torch.arange(n))).any()):
        raise ValueError("parents[i] must be -1 or in [0, i)")
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean keep-mask -> additive float mask (0 where True, ``finfo(dtype).min`` where False), built
    in the model dtype (see PLATFORM.md: boolean masks are silently wrong with eager attention)."""
    out = torch.zeros(mask.shape, dtype=dtype)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


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
    node, accept if among the children; :func:`drafttrain.verify.sssd.membership_walk`); the
    verifier's lossless multi-candidate rule can replace it per subtree. Ties go to the lower root
    index (the first draw; under greedy the target's argmax). W_t = 1 is the plain membership rule.

    Args:
        tokens, parents: int64 [n] (roots = nodes 0..W_t-1 when W_t > 1).
        target_probs: float [n + 1, v]; row 0 after the committed root, row i + 1 after node i.

    Returns:
        :class:`~drafttrain.verify.sssd.MembershipResult`: the accepted nodes (the chosen root first)
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
# decision model (§3.3)
# ---------------------------------------------------------------------------------------------
def decision_features_topk(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Type-2 decision-model input: ``ConCat(Topk(y), Ent(y))`` of a drafter distribution (§3.3).

    Args:
        probs: float [..., v], a probability distribution over the last axis.
        k: number of top probabilities.

    Returns:
        float [..., k + 1]: the k largest probabilities (descending) and the entropy in nats.
    """
    top = torch.topk(probs, k, dim=-1).values
    ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1, keepdim=True)
    return torch.cat([top, ent], dim=-1)


def soft_accept_label(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Type-1 training label ``min(1, p(x|I) / q(x|I))``: the probability that speculative sampling
    accepts x. (The paper prints ``max``; a label in [0, 1] for BCE needs ``min``.)"""
    return torch.clamp(p_target / q_draft.clamp_min(1e-30), max=1.0)


class DecisionModel(nn.Module):
    """MLP predicting whether the target accepts a drafted token (MCSD-improved §3.3).

    Type 1: drafter hidden state (``in_features = d``), three layers; type 2: top-k probabilities +
    entropy (``in_features = k + 1``, :func:`decision_features_topk`), two layers.

    Args:
        in_features: input size; hidden: hidden width; num_layers: linear layers (>= 1), ReLU between.

    Shapes: forward ``features [..., in_features] -> logits [...]`` (float).
    """

    def __init__(self, in_features: int, hidden: int = 64, num_layers: int = 2):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        dims = [in_features] + [hidden] * (num_layers - 1) + [1]
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < num_layers - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)

    @torch.no_grad()
    def accept_prob(self, features: torch.Tensor) -> torch.Tensor:
        """Predicted acceptance probability [...] = sigmoid(logits)."""
        return torch.sigmoid(self(features))


def decision_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy on accepted (1) / rejected (0) labels, or soft labels in [0, 1]
    (:func:`soft_accept_label`); mean over ``mask`` (bool, same shape) when given.

    Raises:
        ValueError: shapes differ or the mask selects nothing.
    """
    if logits.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    if mask is None:
        return loss.mean()
    if not bool(mask.any()):
        raise ValueError("mask selects no element")
    return loss[mask].mean()


def should_stop(accept_probs: torch.Tensor, beta: float = 0.4) -> bool:
    """Early stop (§3.3): True when the predicted acceptance of *every* candidate sequence is below
    beta ("if the probabilities for all sequences are lower than the threshold, draft generation will
    stop early"). An empty input stops."""
    return bool((accept_probs < beta).all())
