"""Tests of drafttrain.verify.acceptance: literal cases, and losslessness by chi-square (< 30 s).

The chi-square tests run the rules as pure functions on a toy target/drafter pair with a vocabulary
of 8: the target's distribution of the first two emitted tokens is p(x1) p(x2 | x1), and the
drafter's q is deliberately different from p (independent of the path, as ParallelSpec's is, or
conditioned on each candidate's own token, as EAGLE's tree is).
Each test draws the first two tokens many times with fixed seeds and compares the 64-cell histogram
with the exact distribution. A correct rule must pass (p-value > 1e-3); the deliberately wrong
rules (residual not used; q not renormalised after a rejection of a draw without replacement) must
fail by a wide margin with the same trial count, which shows the test has the power to catch them.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.verify.acceptance import (
    Acceptance,
    SamplingParams,
    _residual,
    _sample,
    accept,
    accept_greedy,
    process_logits,
    speculative_sampling_chain,
    speculative_sampling_tree,
)
from drafttrain.verify.tree import DraftTree, parallelspec_tree, template_from_choices

V = 8
TRIALS = 2000  # enough: the wrong rules below fail with p < 1e-30 already at 1000 trials

# ---------------------------------------------------------------------------------------- literals


def test_process_logits_greedy_temperature_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert process_logits(logits, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    p = process_logits(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(p, torch.softmax(logits / 2.0, -1))
    # softmax(logits) = [0.6439, 0.2369, 0.0871, 0.0321]: top_p=0.7 keeps the first two (0.6439 < 0.7)
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[0.6439 / 0.8808, 0.2369 / 0.8808, 0.0, 0.0]]), atol=1e-4, rtol=0)
    # top_p below the first token's mass keeps exactly that token
    assert process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_process_logits_top_k_then_top_p():
    """Top-k keeps the k largest logits, renormalised; top-p then cuts that renormalised mass (MTAD App. F order)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [-1.0, 0.0, 3.0, 1.0]])
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    e = torch.tensor([[2.0, 1.0], [3.0, 1.0]]).softmax(-1)  # [0.7311, 0.2689], [0.8808, 0.1192]
    torch.testing.assert_close(p, torch.tensor([[e[0, 0], e[0, 1], 0, 0], [0, 0, e[1, 0], e[1, 1]]]))
    # top-p 0.72 after top-k 2: the first token alone (0.7311) reaches it in row 0; row 1 likewise (0.8808)
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.72, top_k=2))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    # without top-k the same top-p keeps two tokens of row 0 (0.6439 < 0.72 over the full softmax), one of row 1
    assert (process_logits(logits, SamplingParams(temperature=1.0, top_p=0.72)) > 0).sum(-1).tolist() == [2, 1]
    # top_k >= vocab is off; temperature applies before top-k
    torch.testing.assert_close(process_logits(logits, SamplingParams(1.0, top_k=4)), logits.softmax(-1))
    torch.testing.assert_close(process_logits(logits, SamplingParams(0.5, top_k=3))[0, :3],
                               (logits[0, :3] / 0.5).softmax(-1))  # fmt: skip
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(temperature=1.0, top_k=bad)


def test_accept_greedy_follows_argmax_children():
    """Tree: root -> {n0=5, n1=7}; n0 -> {n2=3}; n1 -> {n3=4, n4=2}. The target's argmax after the root
    is 7 (n1), after n1 is 2 (n4), after n4 is 6 (no child): path [1, 4], bonus 6."""
    tree = DraftTree(torch.tensor([5, 7, 3, 4, 2]), torch.tensor([-1, -1, 0, 1, 1]))
    best = [7, 3, 2, 0, 0, 6]  # argmax at rows [root, n0, n1, n2, n3, n4]
    logits = torch.nn.functional.one_hot(torch.tensor(best), 9).float()
    assert accept_greedy(tree, logits) == Acceptance([1, 4], 6)
    best = [1, 3, 2, 0, 0, 6]  # nothing matches at the root
    assert accept_greedy(tree, torch.nn.functional.one_hot(torch.tensor(best), 9).float()) == Acceptance([], 1)
    assert accept_greedy(DraftTree.empty(), torch.nn.functional.one_hot(torch.tensor([4]), 9).float()) == Acceptance([], 4)
    assert accept(tree, torch.nn.functional.one_hot(torch.tensor([7, 3, 2, 0, 0, 6]), 9).float(), SamplingParams()) == Acceptance([1, 4], 6)


def test_greedy_argmax_equals_torch_argmax_ties_nan_inf_and_layouts():
    """The numpy argmax behind greedy acceptance picks the very ids torch's does: first maximum on ties,
    NaN as the maximum, infinities, strided rows, 1-D, any leading dims; other dtypes go to torch."""
    from drafttrain.sampling import greedy_argmax

    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 5.0, nan, 1.0], [-inf] * 4, [0.0, inf, inf, 1.0], [1, 2, nan, 9]])
    assert greedy_argmax(x).tolist() == x.argmax(-1).tolist() == [1, 0, 0, 1, 2]
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(3, 7, 50, generator=g)[:, ::2], torch.randn(50, generator=g),
              torch.randint(0, 3, (6, 40), generator=g).float(), torch.randn(4, 9, generator=g).t()):  # fmt: skip
        got = greedy_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1))
    b = torch.randn(4, 30, generator=g).bfloat16()
    assert torch.equal(greedy_argmax(b), b.argmax(-1))


def test_sampling_rules_accept_when_draft_equals_target():
    """q == p: every draft is accepted (min(1, p/q) = 1), so a chain is accepted in full."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, generator=g), -1)
    d = torch.multinomial(p[:3], 1, generator=g)[:, 0]
    assert speculative_sampling_chain(d, p[:3], p, g).path == [0, 1, 2]
    tree = DraftTree.chain(d, p[:3])
    assert speculative_sampling_tree(tree, p, g).path == [0, 1, 2]


def test_tree_rule_needs_draft_probs():
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_sampling_tree(DraftTree(torch.tensor([1]), torch.tensor([-1])), torch.ones(2, V) / V)


# ---------------------------------------------------------------------------------------- chi-square


def _toy(params: SamplingParams, seed: int = 0):
    """Processed target p1 [V], p2 [V, V] (row x1: distribution after x1) and draft q [2, V] (depths 1, 2)."""
    g = torch.Generator().manual_seed(seed)
    p1 = process_logits(torch.randn(V, generator=g) * 1.2, params)
    p2 = process_logits(torch.randn(V, V, generator=g) * 1.2, params)
    q = process_logits(torch.randn(2, V, generator=g) * 1.5, params)
    return p1, p2, q


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts [c] against probs [c].

    Cells with probability 0 must be empty; cells expecting fewer than 5 counts are pooled into one
    (the usual validity condition of the chi-square approximation).
    """
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    zero = probs == 0
    assert counts[zero].sum() == 0, "a token with target probability 0 was emitted"
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big & ~zero].sum()[None]])
    exp = torch.cat([exp[big], exp[~big & ~zero].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def _first_two(step, p1: torch.Tensor, p2: torch.Tensor, g: torch.Generator) -> tuple[int, int]:
    """Emit tokens with ``step(p_root, p_after, g) -> emitted`` until two are out (a second step if needed)."""
    out = step(p1, p2, g)
    if len(out) == 1:
        out = out + step(p2[out[0]], p2, g)[:1]
    return out[0], out[1]


def _histogram(step, params, trials=TRIALS, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    p1, p2, _ = _toy(params)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V)
    for _ in range(trials):
        a, b = _first_two(step, p1, p2, g)
        counts[a * V + b] += 1
    exact = (p1[:, None] * p2).reshape(-1)
    return counts, exact


def _rows(tree: DraftTree, p_root: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """Target distributions at [root, nodes]: depth-1 node x -> p2[x]; deeper -> uniform (never needed)."""
    rows = [p_root]
    for tok, d in zip(tree.tokens.tolist(), tree.depth().tolist()):
        rows.append(p2[tok] if d == 1 else torch.full((V,), 1.0 / V))
    return torch.stack(rows)


def _chain_step(params, rule=speculative_sampling_chain):
    _, _, q = _toy(params)

    def step(p_root, p2, g):
        d = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])  # d_i ~ q_i
        tree = DraftTree.chain(d, q)
        acc = rule(d, q, _rows(tree, p_root, p2), g)
        return d[acc.path].tolist() + [acc.bonus]

    return step


# 3 candidates at depth 1, 2 under each at depth 2 (ParallelSpec: depth-2 candidates shared)
FULL_TREE = template_from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])


def _tree_step(params, replacement_rule: bool, iid_draws: bool):
    _, _, q = _toy(params)

    def step(p_root, p2, g):
        if iid_draws:  # SpecInfer: i.i.d. candidates (duplicates possible)
            cands = [torch.multinomial(q[t], w, replacement=True, generator=g) for t, w in ((0, 3), (1, 2))]
            tree = FULL_TREE.fill(cands, q)
        else:  # top-k-style tree: draws without replacement (Gumbel-top-k), the verifier's default
            tree = parallelspec_tree(q, [3, 2], 9, sample=True, generator=g, template=FULL_TREE)
        acc = speculative_sampling_tree(tree, _rows(tree, p_root, p2), g, replacement=replacement_rule)
        return tree.tokens[acc.path].tolist() + [acc.bonus]

    return step


SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]


@pytest.mark.parametrize("params", SAMPLING, ids=["T1", "T0.7-top_p0.9"])
def test_chain_rule_is_lossless(params):
    counts, exact = _histogram(_chain_step(params), params)
    assert _chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("params", SAMPLING, ids=["T1", "T0.7-top_p0.9"])
def test_tree_rule_without_replacement_is_lossless(params):
    """Recursive rejection sampling on draws without replacement (the verifier's default)."""
    counts, exact = _histogram(_tree_step(params, replacement_rule=False, iid_draws=False), params)
    assert _chi2_pvalue(counts, exact) > 1e-3


def test_tree_rule_with_iid_candidates_is_lossless():
    """SpecInfer's multi-step speculative sampling: i.i.d. candidates, q unchanged after a rejection."""
    params = SAMPLING[0]
    counts, exact = _histogram(_tree_step(params, replacement_rule=True, iid_draws=True), params)
    assert _chi2_pvalue(counts, exact) > 1e-3


def test_wrong_rule_q_not_renormalised_fails():
    """Draws without replacement verified as if i.i.d. (q not renormalised after a rejection): biased."""
    params = SAMPLING[0]
    counts, exact = _histogram(_tree_step(params, replacement_rule=True, iid_draws=False), params, trials=1000)
    assert _chi2_pvalue(counts, exact) < 1e-6


def _chain_without_residual(draft_tokens, draft_probs, target_probs, generator=None) -> Acceptance:
    """Deliberately wrong: after a rejection the bonus comes from p instead of the residual norm((p - q)+)."""
    for i, x in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x]):
            continue
        return Acceptance(list(range(i)), _sample(p, generator))
    return Acceptance(list(range(len(draft_tokens))), _sample(target_probs[len(draft_tokens)], generator))


def test_wrong_rule_without_residual_fails():
    params = SAMPLING[0]
    counts, exact = _histogram(_chain_step(params, rule=_chain_without_residual), params, trials=1000)
    assert _chi2_pvalue(counts, exact) < 1e-6


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(_residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(_residual(p, p), p)  # no mass left: p itself


def _eagle_tree_step(params):
    """EAGLE-style tree: 3 draws from q1, and below each depth-1 candidate x, 2 draws from q2[x] (a draft
    distribution conditioned on the candidate's own token, one row per expanded node)."""
    g0 = torch.Generator().manual_seed(7)
    q1 = process_logits(torch.randn(V, generator=g0) * 1.5, params)
    q2 = process_logits(torch.randn(V, V, generator=g0) * 1.5, params)

    def step(p_root, p2, g):
        from drafttrain.verify.tree import draft_candidates

        c1 = draft_candidates(q1, 3, True, g).tolist()
        toks, parents, rows, dist = list(c1), [-1] * len(c1), [q1], [0] * len(c1)
        for j, x in enumerate(c1):
            rows.append(q2[x])
            c2 = draft_candidates(q2[x], 2, True, g).tolist()
            toks += c2
            parents += [j] * len(c2)
            dist += [len(rows) - 1] * len(c2)
        tree = DraftTree(torch.tensor(toks), torch.tensor(parents), torch.stack(rows), torch.tensor(dist))
        acc = speculative_sampling_tree(tree, _rows(tree, p_root, p2), g)
        return tree.tokens[acc.path].tolist() + [acc.bonus]

    return step


@pytest.mark.parametrize("params", SAMPLING, ids=["T1", "T0.7-top_p0.9"])
def test_tree_rule_with_per_node_draft_rows_is_lossless(params):
    """The rule with children drawn from their parent's own (path-conditioned) row, as EagleProposer drafts."""
    counts, exact = _histogram(_eagle_tree_step(params), params)
    assert _chi2_pvalue(counts, exact) > 1e-3
