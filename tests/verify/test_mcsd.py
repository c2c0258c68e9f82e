"""Tests of drafttrain.verify.methods.mcsd: topology counts, literal and sliced masks vs from-scratch masks,
tree growth order, target-initialized acceptance, decision model (< 5 s)."""

from __future__ import annotations

import pytest
import torch

from drafttrain.layout import additive_mask
from drafttrain.verify.methods.mcsd import (
    MCSDConfig,
    SlicedTreeMask,
    grow_mcsd_tree,
    mcsd_topology,
    sample_target_roots,
    target_initialized_accept,
    tree_ancestor_mask,
)
from drafttrain.verify.methods.mcsd_decision import (
    DecisionModel,
    decision_features_topk,
    decision_loss,
    should_stop,
    soft_accept_label,
)

CONFIGS = [((2, 1), 2), ((2, 2), 1), ((4, 3, 1, 1), 2), ((4, 2, 2, 1), 1), ((1, 1, 1), 3), ((3,), 1), ((2, 3), 4)]


def reference_mask(parents: list[int]) -> torch.Tensor:
    """Plain loop: mask[i, j] iff j is on the walk from i up to the committed root."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_topology_literal_and_paper_counts():
    topo = mcsd_topology((2, 1), num_target_roots=2)
    assert topo.parents.tolist() == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    assert topo.levels.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert topo.is_target_root.tolist() == [True, True] + [False] * 8
    assert topo.level_end == [2, 6, 10]
    one = mcsd_topology((2, 2), num_target_roots=1)  # W_t = 1: the k-tree under the committed root
    assert one.parents.tolist() == [-1, -1, 0, 0, 1, 1] and one.level_end == [0, 2, 6]
    # §4.1: (2, 4, 3, 1, 1) drafts 40 tokens per root, 24 candidate sequences, an (2 + 80)^2 mask
    paper = MCSDConfig((4, 3, 1, 1), num_target_roots=2)
    assert paper.num_drafted == 80 and paper.num_nodes == 82 and paper.num_candidate_sequences == 24
    assert SlicedTreeMask(paper).full.shape == (82, 82)
    assert not paper.is_lossless and MCSDConfig((4, 2, 2, 1)).is_lossless
    with pytest.raises(ValueError, match="ks"):
        MCSDConfig((2, 0))
    with pytest.raises(ValueError, match="num_target_roots"):
        MCSDConfig((2,), 0)


def test_mask_literal():
    topo = mcsd_topology((1, 1), num_target_roots=2)  # two roots, each with a chain of two drafts
    assert topo.parents.tolist() == [-1, -1, 0, 1, 2, 3]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [0, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [0, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_ancestor_mask(topo.parents), expected)
    add = additive_mask(expected, torch.bfloat16)  # the MCSD mask as attention takes it
    assert add.dtype == torch.bfloat16 and add[0, 0] == 0 and add[0, 1] == torch.finfo(torch.bfloat16).min
    with pytest.raises(ValueError, match="parents"):
        tree_ancestor_mask(torch.tensor([-1, 1]))


@pytest.mark.parametrize("ks,w", CONFIGS)
def test_sliced_mask_equals_from_scratch_mask_at_every_depth(ks, w):
    sliced = SlicedTreeMask(MCSDConfig(ks, w))
    assert torch.equal(sliced.full, reference_mask(sliced.topology.parents.tolist()))
    for level in range(0, len(ks) + 1):
        if level > 0:
            scratch_parents = mcsd_topology(ks[:level], w).parents  # a tree configured with fewer levels
        else:  # only the target-sampled roots (none when W_t = 1)
            scratch_parents = torch.full((w if w > 1 else 0,), -1, dtype=torch.long)
        assert torch.equal(sliced.parents(level), scratch_parents)
        assert torch.equal(sliced.mask(level), tree_ancestor_mask(scratch_parents))
        assert torch.equal(sliced.mask(level), reference_mask(scratch_parents.tolist()))
        if sliced.num_nodes(level):
            assert sliced.mask(level).data_ptr() == sliced.full.data_ptr()  # a view: nothing rebuilt
    with pytest.raises(ValueError, match="level"):
        sliced.mask(len(ks) + 1)


def _toy_drafter(vocab: int = 11):
    """Deterministic drafter: after a node with token t (root: token 0) it prefers t+1, t+2, ... (mod v)."""
    calls = []

    def step(tokens, parents, frontier):
        calls.append((tokens.clone(), parents.clone(), frontier.clone()))
        last = torch.tensor([0 if f < 0 else int(tokens[f]) for f in frontier.tolist()])
        logits = -((torch.arange(vocab)[None, :] - last[:, None] - 1) % vocab).float()  # t+1 best, t+2 next...
        return torch.softmax(logits, dim=-1)

    return step, calls


@pytest.mark.parametrize("ks,w", CONFIGS)
def test_grown_tree_follows_the_topology(ks, w):
    cfg = MCSDConfig(ks, w)
    step, calls = _toy_drafter()
    roots = torch.tensor([5, 7, 9, 2][:w]) if w > 1 else None
    tree = grow_mcsd_tree(step, cfg, roots, greedy=True)
    topo = mcsd_topology(ks, w)
    assert torch.equal(tree.parents, topo.parents) and tree.levels == len(ks) and len(tree) == cfg.num_nodes
    assert tree.is_lossless == (w == 1)
    for i, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        if topo.levels[i] == 0:
            assert tok == roots[i] and tree.dist_index[i] == -1
            continue
        sibling_rank = [j for j, p in enumerate(tree.parents.tolist()) if p == par].index(i)
        parent_tok = 0 if par < 0 else tree.tokens[par].item()
        assert tok == (parent_tok + 1 + sibling_rank) % 11  # greedy = top-k in order
        row = tree.draft_probs[tree.dist_index[i]]
        assert int(torch.argmax(row)) == (parent_tok + 1) % 11  # the row it was drawn from is its parent's
    # each drafter call saw exactly the slice of the tree grown so far
    sliced = SlicedTreeMask(cfg)
    for level, (toks, pars, frontier) in enumerate(calls):
        assert torch.equal(pars, sliced.parents(level))
        assert frontier.tolist() == ([-1] if level == 0 and w == 1 else list(range(sliced.num_nodes(level - 1) if level else 0, sliced.num_nodes(level))))


def test_early_stop_truncates_to_a_slice_and_sampling_is_distinct():
    cfg = MCSDConfig((3, 2, 2), 2)
    step, _ = _toy_drafter()
    tree = grow_mcsd_tree(step, cfg, torch.tensor([1, 4]), stop=lambda level, probs: level == 2)
    assert tree.levels == 2 and torch.equal(tree.parents, SlicedTreeMask(cfg).parents(2))
    g = torch.Generator().manual_seed(0)
    sampled = grow_mcsd_tree(step, cfg, torch.tensor([1, 4]), generator=g, replacement=False)
    for par in set(sampled.parents.tolist()):
        kids = [t for t, p in zip(sampled.tokens.tolist(), sampled.parents.tolist()) if p == par and par >= 0]
        assert len(kids) == len(set(kids))  # without replacement: distinct siblings
    roots = sample_target_roots(torch.tensor([0.1, 0.5, 0.0, 0.4]), 2, greedy=True)
    assert roots.tolist() == [1, 3]
    drawn = sample_target_roots(torch.tensor([0.1, 0.5, 0.0, 0.4]), 3, generator=g)
    assert sorted(drawn.tolist()) == [0, 1, 3]  # distinct, never the zero-probability token
    with pytest.raises(ValueError, match="target_roots"):
        grow_mcsd_tree(step, cfg, None)


def test_target_initialized_accept_keeps_the_longest_root():
    # roots 0 (token 5) and 1 (token 7); root 1's chain 8 -> 9 matches the target, root 0's does not
    tokens = torch.tensor([5, 7, 6, 8, 3, 9])
    parents = torch.tensor([-1, -1, 0, 1, 2, 3])
    v = 12
    greedy_next = {-1: 5, 0: 1, 1: 8, 2: 3, 3: 9, 4: 0, 5: 10}  # the target's argmax after each node
    probs = torch.zeros(len(tokens) + 1, v)
    for node, tok in greedy_next.items():
        probs[node + 1, tok] = 1.0
    res = target_initialized_accept(tokens, parents, 2, probs, greedy=True)
    assert res.accepted_nodes == [1, 3, 5] and res.tokens == [7, 8, 9, 10]
    # lossy: the target's own choice at the root was 5 (root 0), yet root 1 is kept
    assert greedy_next[-1] == 5
    # W_t = 1 is the plain membership rule from the committed root
    one = target_initialized_accept(torch.tensor([5, 1]), torch.tensor([-1, 0]), 1, probs[:3], greedy=True)
    assert one.accepted_nodes == [0, 1] and one.tokens == [5, 1, 8]


def test_decision_model_features_loss_and_stop():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    feats = decision_features_topk(probs, 2)
    assert torch.allclose(feats, torch.tensor([[0.5, 0.25, 1.5 * torch.log(torch.tensor(2.0)).item()]]))
    assert torch.allclose(soft_accept_label(torch.tensor([0.2, 0.6]), torch.tensor([0.4, 0.3])), torch.tensor([0.5, 1.0]))
    model = DecisionModel(in_features=3, hidden=16, num_layers=2)
    assert sum(p.numel() for p in model.parameters()) == 3 * 16 + 16 + 16 + 1
    assert sum(p.numel() for p in DecisionModel(8, 16, 3).parameters()) == 8 * 16 + 16 + 16 * 16 + 16 + 16 + 1
    # learns a separable toy rule: accepted iff the top probability > 0.5
    g = torch.Generator().manual_seed(0)
    dist = torch.softmax(torch.randn(512, 20, generator=g) * 3, dim=-1)
    x = decision_features_topk(dist, 2)
    y = (dist.max(-1).values > 0.5).float()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = decision_loss(model(x), y).item()
    for _ in range(200):
        opt.zero_grad()
        loss = decision_loss(model(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    assert ((model.accept_prob(x) > 0.5).float() == y).float().mean() > 0.95
    mask = torch.zeros(512, dtype=torch.bool)
    mask[:10] = True
    assert decision_loss(model(x), y, mask).item() == pytest.approx(decision_loss(model(x)[:10], y[:10]).item())
    with pytest.raises(ValueError, match="no element"):
        decision_loss(model(x), y, torch.zeros(512, dtype=torch.bool))
    assert should_stop(torch.tensor([0.1, 0.39]), beta=0.4) and not should_stop(torch.tensor([0.1, 0.4]), beta=0.4)
