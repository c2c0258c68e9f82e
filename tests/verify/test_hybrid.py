"""The hybrid draft tree (drafttrain/verify/hybrid.py): drafter tree ∪ SSSD candidates, one verification."""

from __future__ import annotations

import pytest
import torch

from drafttrain.eval.in_training import drafter_eval
from drafttrain.sampling import SamplingParams
from drafttrain.verify.hybrid import HybridProposer, merge_trees
from drafttrain.verify.methods.sssd import SSSDConfig, SSSDDrafter
from drafttrain.verify.proposers import proposer_for
from drafttrain.verify.tree import DraftTree


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.path_to(i)) for i in range(tree.n)}


def test_merge_is_the_token_trie_union():
    # drafter: 5 -> 6 -> 7 and 8 (siblings at depth 1); scores 0.9, 0.5, 0.2, 0.3
    d = DraftTree(torch.tensor([5, 8, 6, 7]), torch.tensor([-1, -1, 0, 2]), scores=torch.tensor([0.9, 0.3, 0.5, 0.2]))
    # SSSD: 5 -> 6 -> 9 (shares 5 -> 6), 4 -> 3, each path score listed parents first
    m = merge_trees(d, [5, 6, 9, 4, 3], [-1, 0, 1, -1, 3], [0.95, 0.6, 0.4, 0.1, 0.05], max_extra=8)
    assert m.tokens.tolist()[:4] == [5, 8, 6, 7] and m.parents.tolist()[:4] == [-1, -1, 0, 2]  # drafter's nodes first
    assert _paths(m) == _paths(d) | {(5, 6, 9), (4,), (4, 3)}
    assert m.n == 7  # 5 and 5 -> 6 verified once
    sc = dict(zip(map(tuple, [[5], [8], [5, 6], [5, 6, 7], [5, 6, 9], [4], [4, 3]]), m.scores.tolist()))
    assert sc[(5,)] == pytest.approx(0.95) and sc[(5, 6)] == pytest.approx(0.6)  # the larger score of a shared node
    assert sc[(5, 6, 7)] == pytest.approx(0.2) and sc[(5, 6, 9)] == pytest.approx(0.4)
    assert m.draft_probs is None and m.dist_index is None
    src = dict(zip(map(tuple, [[5], [8], [5, 6], [5, 6, 7], [5, 6, 9], [4], [4, 3]]), m.sources.tolist()))
    assert src == {(5,): 2, (5, 6): 2, (8,): 0, (5, 6, 7): 0, (5, 6, 9): 1, (4,): 1, (4, 3): 1}  # both / drafter / SSSD


def test_merge_caps_the_added_nodes_and_drops_orphans():
    d = DraftTree(torch.tensor([5]), torch.tensor([-1]))
    m = merge_trees(d, [1, 2, 3, 5, 6], [-1, 0, 1, -1, 3], [0.5] * 5, max_extra=1)
    # 1 is added; 2 (child of 1) would be the second extra node: dropped, and so is its child 3;
    # 5 is the drafter's own node (no budget used) but 6 below it would exceed the budget
    assert _paths(m) == {(5,), (1,)}
    assert merge_trees(d, [9], [-1], [0.5], max_extra=0).n == 1
    with pytest.raises(ValueError, match="parent"):
        merge_trees(d, [1, 2], [1, -1], [0.5, 0.5], max_extra=4)


@pytest.fixture(scope="module")
def drafter(make_drafter):
    return make_drafter(seed=0).eval()


def _prompts(n=(5, 17)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (k,), generator=g).tolist() for k in n]


@pytest.mark.parametrize("plan", [False, True])
def test_hybrid_decoding_equals_plain_greedy(varied_target, drafter, plan):
    """Greedy output through the engine with SSSD candidates merged in (and under the planner) equals
    plain greedy decoding on every prompt; SSSD nodes were really verified."""
    sssd = SSSDDrafter(SSSDConfig(max_prefix_len=3, min_prefix_len=1))
    out = drafter_eval(varied_target, drafter, _prompts(), 24, batch_size=2, progress=False,
                                   tree_widths=[2, 1, 1, 1], tree_budget=5, plan=plan, full_tree=not plan,
                                   sssd=sssd, sssd_nodes=4)  # fmt: skip
    assert out["greedy_equal"] is True
    assert out["generated_tokens"] == 2 * 24


def test_sssd_candidates_raise_tau_where_the_context_repeats(tiny_target, drafter):
    """The tiny target as loaded repeats one token: the input trie predicts it, the untrained drafter does
    not. The hybrid accepts several tokens per step where the drafter alone accepts almost none."""
    prompts = _prompts()
    kw = dict(batch_size=2, progress=False, tree_widths=[2, 1, 1, 1], tree_budget=5)
    alone = drafter_eval(tiny_target, drafter, prompts, 32, **kw)
    sssd = SSSDDrafter(SSSDConfig(max_prefix_len=3, min_prefix_len=1))
    hybrid = drafter_eval(tiny_target, drafter, prompts, 32, sssd=sssd, sssd_nodes=6, **kw)
    assert hybrid["greedy_equal"] is True and alone["greedy_equal"] is True
    assert [o["tokens"] for o in hybrid["outputs"]] == [o["tokens"] for o in alone["outputs"]]
    assert hybrid["tau"] > alone["tau"] + 1.0, (hybrid["tau"], alone["tau"])
    assert hybrid["tree_nodes_per_step"] > alone["tree_nodes_per_step"]


def test_sampling_verifies_the_drafters_tree_only(drafter):
    """At temperature > 0 the union would break the drafter's rejection-sampling rule: no SSSD node is added."""
    inner = proposer_for(drafter, widths=[2, 1], budget=3)
    hyb = HybridProposer(inner, SSSDDrafter(SSSDConfig(max_prefix_len=3, min_prefix_len=1)), extra_nodes=4)
    p = [7, 8, 9, 7, 8, 9, 7, 8]
    hyb.start(0, p[:-1], torch.randn(len(p) - 1, drafter.feature_dim), p[-1])
    t = hyb.draft([0], SamplingParams(0.7, 0.9), torch.Generator().manual_seed(0))[0]
    assert t.draft_probs is not None and t.n <= 3 and hyb.nodes_added == 0
    with pytest.raises(ValueError, match="extra_nodes"):
        HybridProposer(inner, hyb.sssd, extra_nodes=-1)
