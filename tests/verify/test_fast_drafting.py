"""The ParallelSpec drafting hot path against the reference path, through the engine.

``ParallelSpecProposer(fast_greedy=True)`` builds its greedy trees from the draft vocabulary in one
batched top-k with memoized shapes; ``fast_greedy=False`` is the per-sequence full-vocabulary path
it replaces. Same trees -> same accepted lengths at every step and the same (plain greedy) output.
"""

from __future__ import annotations


import pytest
import torch

from drafttrain.verify import ParallelSpecProposer, PlainProposer, SpecEngine


@pytest.fixture(scope="module")
def varied(varied_target):
    """The tiny target with redrawn weights (conftest.varied_target): its greedy token changes every step."""
    return varied_target


@pytest.mark.parametrize("which", ["varied", "tiny"])  # tiny: drafts are accepted; varied: the token changes every step
@pytest.mark.parametrize("draft_vocab", [0, 2000])
@pytest.mark.parametrize("shape", [{"widths": [3, 2, 1, 1], "budget": 6}, {"choices": [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]}])
def test_fast_greedy_trees_equal_reference(varied, tiny_target, make_drafter, which, draft_vocab, shape):
    target = varied if which == "varied" else tiny_target
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 13, 8)]
    plain = SpecEngine(target, PlainProposer(), batch_size=3, max_new_tokens=20, stop_token_ids=-1).run(prompts)
    drafter = make_drafter(seed=3, draft_vocab_size=draft_vocab)
    if draft_vocab:  # the outputs' tokens first (so drafts can be right), then random others
        seen = list(dict.fromkeys(t for r in plain.results for t in r.tokens))
        rest = [t for t in torch.randperm(target.config.vocab_size, generator=g).tolist() if t not in set(seen)]
        drafter.set_draft_vocab(torch.tensor((seen + rest)[:draft_vocab]))
    drafter.layer.load_state_dict(target.last_layer.state_dict())  # accepts some drafts
    runs = {}
    for fast in (True, False):
        prop = ParallelSpecProposer(drafter, fast_greedy=fast, **shape)
        runs[fast] = SpecEngine(target, prop, batch_size=2, max_new_tokens=20, stop_token_ids=-1).run(prompts)
    for a, b, p in zip(runs[True].results, runs[False].results, plain.results):
        assert a.tokens == b.tokens == p.tokens
        assert a.accept_lengths == b.accept_lengths
    assert runs[True].stats.tree_nodes == runs[False].stats.tree_nodes
    if which == "tiny":
        assert sum(runs[True].stats.accept_hist.get(m, 0) for m in range(1, 9)) > 0  # some drafts were accepted
