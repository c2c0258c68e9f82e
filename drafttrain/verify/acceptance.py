"""Acceptance rules: pure functions from (draft tree, target distributions, RNG) to (accepted path, bonus token).

Every rule returns an :class:`Acceptance`: the accepted node indices from the root's child downward,
and the **bonus** token the target contributes after them (its own next token when nothing more
can be accepted). Rows of ``target_logits`` / ``target_probs`` follow the verification input
``[root, node 0, ..., node n-1]``: row 0 is the target's distribution after the root, row i + 1
after node i.

Rules and what makes them lossless (tests: ``tests/verify/test_acceptance.py``):

- :func:`accept_greedy`: walk down the tree while some child equals the target's argmax; the bonus
  is the argmax where the walk stops. Output = plain greedy decoding of the target, token for token.
- :func:`speculative_sampling_chain`: Leviathan et al. 2023 (Algorithm 1) / Chen et al. 2023
  (Algorithm 2): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
  sample the bonus from the residual norm((p_i - q_i)+); if all are accepted sample it from p_{k+1}.
- :func:`speculative_sampling_tree`: multi-candidate speculative sampling over a tree (SpecInfer,
  Miao et al. 2024, "multi-step speculative sampling"; ParallelSpec Algorithm 1). At a node, try its
  children in order: accept child x with probability min(1, p(x) / q(x)); on rejection replace p by
  norm((p - q)+) and try the next child. Children drawn i.i.d. from q (``replacement=True``) keep q
  as it is; children drawn *without replacement* (top-k style trees, Gumbel-top-k draws) need q
  renormalised without the rejected token after each rejection, q := q[x := 0] / (1 - q(x))
  (recursive rejection sampling, Jeong et al. 2024). If a child is accepted, descend and repeat with
  the target's distribution at that child; otherwise the bonus is drawn from the current residual p.

Temperature and top-p are applied identically to target and draft with
:func:`~drafttrain.sampling.process_logits` (the one transform, shared with generation)
before any rule sees probabilities (the draft side is processed by the proposer, which also draws
the candidates from those processed distributions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafttrain.sampling import SamplingParams, greedy_argmax, process_logits
from drafttrain.verify.tree import DraftTree


@dataclass
class Acceptance:
    """path: accepted node indices (root's child first, depth order); bonus: the target's next token after them.

    ``bonus=None`` (only from a proposer's own rule, e.g. MCSD with target-sampled roots): no bonus
    token; the last accepted node becomes the next step's root, so ``path`` must not be empty.
    """

    path: list[int] = field(default_factory=list)
    bonus: int | None = -1


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    """One U(0, 1) draw from ``generator`` on the generator's own device (the engine's is the target's; a
    CUDA generator cannot draw a CPU tensor). None: torch's global CPU RNG."""
    return float(torch.rand((), generator=generator, device=generator.device if generator is not None else "cpu"))


def target_rows(target_logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[n + 1, v] rows a rule samples from: the processed distribution, or the logits under greedy
    (argmax is all greedy needs and the rules take the argmax of whatever they get)."""
    return target_logits.float() if sampling.greedy else process_logits(target_logits, sampling)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm((p - q)+); p itself if the residual has no mass (only when p == q, where no rejection can happen)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Greedy tree acceptance: follow the child equal to the target's argmax as long as there is one.

    Args:
        tree: the draft tree (n nodes).
        target_logits: [n + 1, v] target logits at [root, node 0..n-1].

    Returns:
        :class:`Acceptance`; the bonus is the argmax after the last accepted node.
    """
    best = greedy_argmax(target_logits).tolist()  # [n + 1] the target's greedy token after each input
    tokens = tree.tokens.tolist()
    kids = tree.children()
    path: list[int] = []
    row = 0  # row of the current node (root)
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == best[row]), None)
        if nxt is None:
            return Acceptance(path, best[row])
        path.append(nxt)
        row = nxt + 1


def speculative_sampling_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Speculative sampling of a chain (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    Args:
        draft_tokens: [k] int64, d_i drawn from draft_probs[i].
        draft_probs: [k, v] float q_i.
        target_probs: [k + 1, v] float p_i (row i: after the root and d_1..d_i).
        generator: RNG.

    Returns:
        :class:`Acceptance` with path = [0, 1, ..., m-1] for m accepted drafts.
    """
    toks = draft_tokens.tolist()
    for i, x in enumerate(toks):
        p, q = target_probs[i], draft_probs[i]
        r = _uniform(generator)
        # accept d_i with probability min(1, p(d_i) / q(d_i))
        if r * float(q[x]) < float(p[x]):
            continue
        # first rejection: the bonus comes from the residual norm((p - q)+)
        return Acceptance(list(range(i)), _sample(_residual(p, q), generator))
    return Acceptance(list(range(len(toks))), _sample(target_probs[len(toks)], generator))


def speculative_sampling_tree(
    tree: DraftTree,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    replacement: bool = False,
) -> Acceptance:
    """Multi-candidate speculative sampling over a tree (SpecInfer; ParallelSpec Algorithm 1; RRS).

    Preconditions (what makes it lossless): the children of every node are successive draws from
    ``tree.draft_probs[dist_index]`` (i.i.d. if ``replacement``, else without replacement, in draw
    order), and the tree's shape does not depend on which tokens were drawn.

    Args:
        tree: draft tree with ``draft_probs`` [r, v] and ``dist_index`` [n].
        target_probs: [n + 1, v] processed target distributions at [root, node 0..n-1].
        generator: RNG.
        replacement: children drawn i.i.d. (True) or without replacement (False, the default:
            top-k-like trees; q is renormalised without each rejected token).

    Returns:
        :class:`Acceptance`.

    Raises:
        ValueError: the tree has nodes but no draft distributions.
    """
    if tree.n and tree.draft_probs is None:
        raise ValueError("sampling acceptance needs the tree's draft_probs / dist_index")
    tokens = tree.tokens.tolist()
    dist = tree.dist_index.tolist() if tree.n else []
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        p = target_probs[row]
        children = kids[row]
        if not children:  # leaf (or empty tree): the bonus comes from the target at this node
            return Acceptance(path, _sample(p, generator))
        q = tree.draft_probs[dist[children[0]]].float()
        accepted = None
        for c in children:
            x = tokens[c]
            r = _uniform(generator)
            # accept child x with probability min(1, p(x) / q(x))
            if r * float(q[x]) < float(p[x]):
                accepted = c
                break
            # rejected: the target's remaining mass is the residual norm((p - q)+) ...
            p = _residual(p, q)
            if not replacement:  # ... and the next child was drawn from q without x (recursive rejection sampling)
                q = q.clone()
                q[x] = 0.0
                s = q.sum()
                if s <= 0:
                    break
                q = q / s
        if accepted is None:  # every child rejected: the bonus comes from the residual
            return Acceptance(path, _sample(p, generator))
        path.append(accepted)
        row = accepted + 1


def accept(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    replacement: bool = False,
) -> Acceptance:
    """The engine's rule: :func:`accept_greedy` at temperature 0, else :func:`speculative_sampling_tree`
    on ``process_logits(target_logits, params)`` (the tree's draft_probs were processed the same way).

    Args:
        tree: draft tree (n nodes).
        target_logits: [n + 1, v] float target logits at [root, node 0..n-1].
        params: sampling parameters.
        generator: RNG.
        replacement: see :func:`speculative_sampling_tree`.
    """
    if params.greedy:
        return accept_greedy(tree, target_logits)
    return speculative_sampling_tree(tree, process_logits(target_logits, params), generator, replacement)
