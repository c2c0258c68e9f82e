"""Tests of drafttrain.verify.tree: tree builders against literal parents / masks and a plain-loop reference (< 2 s)."""

from __future__ import annotations

import itertools

import pytest
import torch

from drafttrain.verify.tree import (
    EAGLE_DEFAULT_CHOICES,
    MEDUSA_DEFAULT_CHOICES,
    DraftTree,
    best_first_template,
    chain_template,
    draft_candidates,
    parallelspec_tree,
    template_from_choices,
)


def test_template_from_choices_literal():
    """The module docstring's example: choices in any order are sorted by (depth, ranks)."""
    t = template_from_choices([(0, 0, 0), (1,), (0, 0), (0,)])
    assert t.ranks == ((0,), (1,), (0, 0), (0, 0, 0))
    assert t.parents.tolist() == [-1, -1, 0, 2]
    tree = t.fill([torch.tensor([10, 11]), torch.tensor([20]), torch.tensor([30])])
    assert tree.tokens.tolist() == [10, 11, 20, 30]
    assert tree.depth().tolist() == [1, 1, 2, 3]
    assert tree.children() == [[0, 1], [2], [], [3], []]
    assert tree.paths() == [[1], [0, 2, 3]]
    assert tree.path_to(3) == [0, 2, 3]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0],  # n0
            [1, 0, 1, 0, 0],  # n1
            [1, 1, 0, 1, 0],  # n2 (child of n0)
            [1, 1, 0, 1, 1],  # n3 (child of n2)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask(), expected)


def test_ancestor_mask_matches_plain_loop_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 17):
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
        tree = DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents))
        ref = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        for a in range(n + 1):
            ref[a, 0] = True
            node = a - 1
            while node >= 0:  # walk up to the root
                ref[a, node + 1] = True
                node = parents[node]
        assert torch.equal(tree.ancestor_mask(), ref)
        depth = [len(tree.path_to(i)) for i in range(n)]
        assert tree.depth().tolist() == depth


def test_default_trees():
    eagle = template_from_choices(EAGLE_DEFAULT_CHOICES)
    assert eagle.n == 25 and eagle.max_depth == 5
    # EAGLE's tree: 4 root children; (0,) has 3 children, (1,) 2, (2,) 2, (3,) 1
    assert eagle.parents[:12].tolist() == [-1, -1, -1, -1, 0, 0, 0, 1, 1, 2, 2, 3]
    assert eagle.parents[-5:].tolist() == [12, 12, 12, 20, 20]  # (0,0,0,x) under (0,0,0); (0,0,0,0,x) under (0,0,0,0)
    medusa = template_from_choices(MEDUSA_DEFAULT_CHOICES)
    assert medusa.n == 63 and medusa.max_depth == 4
    assert sum(1 for r in medusa.ranks if len(r) == 1) == 10
    assert chain_template(3).parents.tolist() == [-1, 0, 1]


def test_bad_choice_lists_raise():
    with pytest.raises(ValueError, match="no parent"):
        template_from_choices([(0,), (1, 0)])
    with pytest.raises(ValueError, match="must be 0"):
        template_from_choices([(0,), (2,)])
    with pytest.raises(ValueError, match="duplicate"):
        template_from_choices([(0,), (0,)])


def test_draft_tree_validation():
    with pytest.raises(ValueError, match="parent"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="siblings"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1]), torch.ones(2, 4) / 4, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="nodes"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]))
    assert DraftTree.empty().n == 0 and DraftTree.empty().ancestor_mask().tolist() == [[True]]
    chain = DraftTree.chain([4, 5, 6])
    assert chain.parents.tolist() == [-1, 0, 1] and chain.max_depth == 3


def _brute_force(scores, budget):
    """Plain-loop reference: enumerate every rank tuple, sort by (-score, depth, ranks), keep the first budget."""
    cands = []
    for t in range(1, len(scores) + 1):
        for r in itertools.product(*[range(len(s)) for s in scores[:t]]):
            s = 1.0
            for j, x in enumerate(r):
                s *= scores[j][x]
            cands.append((-s, t, r))
    return [r for _, _, r in sorted(cands)[:budget]]


def test_best_first_template_literal_and_reference():
    # depth 1: [0.6, 0.3], depth 2: [0.5, 0.4], depth 3: [0.9]
    scores = [[0.6, 0.3], [0.5, 0.4], [0.9]]
    t = best_first_template(scores, 5)
    # scores: (0,)=.6 (0,0)=.3 (1,)=.3 (0,0,0)=.27 (0,1)=.24 (0,1,0)=.216 (1,0)=.15 ...
    assert set(t.ranks) == {(0,), (1,), (0, 0), (0, 0, 0), (0, 1)}
    assert t.parents.tolist() == [-1, -1, 0, 0, 2]  # ranks sorted: (0,), (1,), (0,0), (0,1), (0,0,0)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        widths = torch.randint(1, 4, (3,), generator=g).tolist()
        scores = [sorted(torch.rand(w, generator=g).tolist(), reverse=True) for w in widths]
        budget = int(torch.randint(1, 12, (1,), generator=g))
        assert list(best_first_template(scores, budget).ranks) == sorted(_brute_force(scores, budget), key=lambda r: (len(r), r))


def test_parallelspec_tree_greedy_takes_top_k_per_depth():
    probs = torch.tensor(
        [
            [0.05, 0.5, 0.3, 0.15],  # depth 1: top-2 = [1, 2]
            [0.7, 0.1, 0.05, 0.15],  # depth 2: top-1 = [0]
        ]
    )
    tree = parallelspec_tree(probs, widths=[2, 1], budget=10)
    # best-first: (0,)=.5 (0,0)=.35 (1,)=.3 (1,0)=.21 -> all four fit the budget
    assert tree.tokens.tolist() == [1, 2, 0, 0]
    assert tree.parents.tolist() == [-1, -1, 0, 1]
    assert tree.dist_index.tolist() == [0, 0, 1, 1]
    assert torch.equal(tree.draft_probs, probs)
    small = parallelspec_tree(probs, widths=[2, 1], budget=2)
    assert small.tokens.tolist() == [1, 0] and small.parents.tolist() == [-1, 0]
    static = parallelspec_tree(probs, widths=[2, 1], budget=3, template=template_from_choices([(0,), (1,), (0, 0), (1, 0)]))
    assert static.tokens.tolist() == [1, 2, 0] and static.parents.tolist() == [-1, -1, 0]


def test_draft_candidates_sampling_without_replacement():
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.0, 0.25, 0.25])
    for _ in range(20):
        c = draft_candidates(q, 5, sample=True, generator=g)
        assert c.numel() == 3 and len(set(c.tolist())) == 3 and 1 not in c.tolist()  # support only, distinct
    first = torch.stack([draft_candidates(q, 1, True, g) for _ in range(2000)]).flatten()
    assert abs(float((first == 0).float().mean()) - 0.5) < 0.05  # the first draw is a draw from q
    assert draft_candidates(q, 2, sample=False).tolist() == [0, 2]


# ---------------------------------------------------------------------------------------------
# the drafting hot path: batched draft-vocabulary trees, memoized templates
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("static", [False, True])
def test_parallelspec_trees_greedy_equals_per_sequence_full_vocab_reference(static):
    """One softmax + top-k over the draft vocabulary for the batch gives the same trees as the per-sequence
    full-vocabulary path (scatter into v, softmax, D top-k calls), and each node's score is its path's product."""
    from drafttrain.verify.tree import parallelspec_trees_greedy

    g = torch.Generator().manual_seed(0)
    b, depth, n_draft, v = 5, 4, 300, 1000
    d2t = torch.randperm(v, generator=g)[:n_draft]
    logits = torch.randn(b, depth, n_draft, generator=g) * 3
    widths, budget = [4, 2, 2, 1], 7
    tpl = template_from_choices(MEDUSA_DEFAULT_CHOICES) if static else None
    fast = parallelspec_trees_greedy(logits, widths, budget, tpl, d2t)
    for i in range(b):
        full = torch.full((depth, v), float("-inf"))
        full[:, d2t] = logits[i]
        probs = torch.softmax(full, dim=-1)
        ref = parallelspec_tree(probs, widths, budget, template=tpl)
        assert fast[i].tokens.tolist() == ref.tokens.tolist()
        assert fast[i].parents.tolist() == ref.parents.tolist()
        assert fast[i].depth().tolist() == ref.depth().tolist()
        assert torch.equal(fast[i].ancestor_mask(), ref.ancestor_mask())
        path_p = [float(torch.prod(torch.stack([probs[t, fast[i].tokens[j]] for t, j in enumerate(fast[i].path_to(k))])))
                  for k in range(fast[i].n)]  # fmt: skip
        assert torch.allclose(fast[i].scores, torch.tensor(path_p), rtol=1e-5)
        assert fast[i].draft_probs is None
        par = fast[i].parents.tolist()
        assert all(p < 0 or fast[i].scores[k] <= fast[i].scores[p] for k, p in enumerate(par))  # child <= parent


def test_templates_are_memoized_and_still_validated():
    a = template_from_choices([(0,), (1,), (0, 0)])
    assert template_from_choices([[0], [1], [0, 0]]) is a  # a shape seen before is not rebuilt
    with pytest.raises(ValueError):
        template_from_choices([(0,), (2,)])  # bad lists still raise (failures are not memoized)
    with pytest.raises(ValueError):
        template_from_choices([(0,), (2,)])


def test_filled_tree_structure_equals_validated_tree():
    """A trusted tree from a template has the structure the validating constructor computes."""
    tpl = template_from_choices(EAGLE_DEFAULT_CHOICES)
    cands = [list(range(10 * t, 10 * t + 4)) for t in range(5)]
    fast = tpl.fill_lists(cands)
    ref = DraftTree(fast.tokens.clone(), fast.parents.clone())
    assert fast.depth().tolist() == ref.depth().tolist()
    assert fast.children() == ref.children()
    assert torch.equal(fast.ancestor_mask(), ref.ancestor_mask())
    assert fast.max_depth == 5
