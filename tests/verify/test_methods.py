"""SSSD, improved MCSD and MTAD run through the batched engine (drafttrain.verify.methods.{sssd,mcsd,mtad}) on tiny targets.

Lossless methods (SSSD, MCSD W_t = 1) must reproduce plain greedy decoding token for token in every
engine mode with continuous batching; the lossy ones are pinned by what their rule allows: MCSD
W_t = 2 only emits tokens among the target's top-2 at their own prefix (roots) or its argmax
(descendants, bonus), and MTAD accepts every draft at τ = 0 and none at τ = 1.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.drafters.base import DrafterSpec
from drafttrain.verify import MODES, SpecEngine
from drafttrain.verify.acceptance import Acceptance
from drafttrain.verify.methods.mcsd import MCSDConfig, MCSDProposer
from drafttrain.verify.methods.mtad import MTADProposer
from drafttrain.verify.methods.sssd import SSSDConfig, SSSDDrafter, SSSDProposer
from drafttrain.verify.methods.sssd_datastore import Datastore
from drafttrain.verify.proposers import PlainProposer

PROMPT_LENGTHS = (3, 11, 30, 7, 19)
NEW = 20


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def plain(varied_target, prompts):
    """Plain greedy outputs (no stop token) through the engine, one prompt at a time."""
    run = SpecEngine(varied_target, PlainProposer(), batch_size=1, max_new_tokens=NEW, stop_token_ids=[-1]).run(prompts)
    return [r.tokens for r in run.results]


@pytest.mark.parametrize("mode", MODES)
def test_sssd_greedy_equals_plain_and_drafts_from_datastore(varied_target, prompts, plain, mode):
    """SSSD with a datastore that holds the true continuations: lossless and accepting (τ > 2)."""
    store = Datastore.from_documents([p + o for p, o in zip(prompts, plain)])
    drafter = SSSDDrafter(SSSDConfig(node_budget=8, max_depth=4, min_continuations=1), store)
    run = SpecEngine(varied_target, SSSDProposer(drafter), batch_size=3, max_new_tokens=NEW, mode=mode,
                     stop_token_ids=[-1]).run(prompts)  # fmt: skip
    assert [r.tokens for r in run.results] == plain
    assert run.stats.tau > 2.0
    # input-only SSSD on random prompts finds (almost) nothing, and stays lossless
    none = SSSDDrafter(SSSDConfig(node_budget=8, use_datastore=False))
    run2 = SpecEngine(varied_target, SSSDProposer(none), batch_size=3, max_new_tokens=NEW, mode=mode,
                      stop_token_ids=[-1]).run(prompts)  # fmt: skip
    assert [r.tokens for r in run2.results] == plain
    assert run2.stats.tau < run.stats.tau


def test_sssd_sampling_runs_with_membership_rule(varied_target, prompts, plain):
    """Sampling needs SSSD's own rule (its trees carry no draft distributions): the engine must use it."""
    from drafttrain.verify import SamplingParams

    store = Datastore.from_documents([p + o for p, o in zip(prompts, plain)])
    drafter = SSSDDrafter(SSSDConfig(node_budget=8, max_depth=4, min_continuations=1), store)
    run = SpecEngine(varied_target, SSSDProposer(drafter), batch_size=2, max_new_tokens=NEW, stop_token_ids=[-1],
                     sampling=SamplingParams(temperature=0.3)).run(prompts)  # fmt: skip
    assert all(len(r.tokens) == NEW for r in run.results)


@pytest.mark.parametrize("mode", MODES)
def test_mcsd_w1_greedy_equals_plain(varied_target, prompts, plain, make_drafter, mode):
    prop = MCSDProposer(make_drafter(seed=5).eval(), MCSDConfig((3, 2, 1, 1, 1)))
    assert prop.lossless and prop.name == "mcsd_w1"
    run = SpecEngine(varied_target, prop, batch_size=3, max_new_tokens=NEW, mode=mode, stop_token_ids=[-1]).run(prompts)
    assert [r.tokens for r in run.results] == plain
    assert run.stats.tree_nodes / run.stats.seq_steps == pytest.approx(3 + 6 + 6 + 6, abs=1e-9)  # K + 1 = 4 levels


class OracleParallelDrafter:
    """A parallel drafter (``propose`` interface) whose K + 1 distributions are the target's own along its
    greedy rollout, so drafts are right. ``alt=True``: the rollout takes the target's *second* choice at
    depth 1, so only the subtree of the second-best target root can be accepted beyond depth 1."""

    num_mask_tokens = 2
    spec = DrafterSpec(drafting="parallel")  # the declaration the proposers follow
    feature_layers = (-1,)
    draft_depth = num_mask_tokens + 1

    def __init__(self, target, prompts, alt=False):
        self.target, self.prompts, self.alt = target, prompts, alt

    def eval(self):
        return self

    @torch.no_grad()
    def propose(self, ids, feats, cache):
        new = ids[0].tolist()  # items' tokens: prompt[1:] + first token at the start, then the committed tokens
        if not hasattr(cache, "oracle_history"):
            p = next(p for p in self.prompts if p[1:] == new[: len(p) - 1])
            cache.oracle_history = [p[0]]
        cache.oracle_history += new
        seq, out = list(cache.oracle_history), []
        for d in range(self.num_mask_tokens + 1):
            lg = self.target.forward(torch.tensor([seq])).logits[0, -1].float()
            out.append(lg)
            seq.append(int(lg.topk(2).indices[1 if (self.alt and d == 0) else 0]))
        return torch.stack(out)[None]


def _mcsd_w2_run(target, prompts, alt, mode):
    prop = MCSDProposer(OracleParallelDrafter(target, prompts, alt), MCSDConfig((2, 1, 1), num_target_roots=2),
                        batched=False)  # fmt: skip
    assert not prop.lossless and prop.name == "mcsd_w2"
    return SpecEngine(target, prop, batch_size=3, max_new_tokens=NEW, mode=mode, stop_token_ids=[-1]).run(prompts)


@pytest.mark.parametrize("mode", MODES)
def test_mcsd_w2_no_bonus_steps_keep_the_cache_right(varied_target, prompts, plain, mode):
    """W_t = 2 with drafts that follow the target's argmax: the argmax root's subtree wins every step, so
    the output is plain greedy exactly, through rooted steps that emit no bonus token (the last accepted
    token is re-fed as the next root: a wrong K/V slot or position would change the output)."""
    run = _mcsd_w2_run(varied_target, prompts, alt=False, mode=mode)
    assert [r.tokens for r in run.results] == plain
    # after the first step every step is rooted: 2 roots + 2 * (2 + 2) drafted nodes, root + 2 levels accepted
    assert run.stats.accept_hist.get(3, 0) >= 0.8 * run.stats.seq_steps
    assert run.stats.tau == pytest.approx(3.0, abs=0.3)


@pytest.mark.parametrize("mode", MODES)
def test_mcsd_w2_picks_the_better_root_and_is_lossy(varied_target, prompts, plain, mode):
    """Drafts that follow the target's second choice: the second root's subtree is accepted further, so it
    wins; the output leaves plain greedy (lossy) but every token is the target's top-1 or top-2 at its own
    prefix, checked by a fresh forward."""
    run = _mcsd_w2_run(varied_target, prompts, alt=True, mode=mode)
    outs = [r.tokens for r in run.results]
    assert outs != plain
    second = 0
    for p, out in zip(prompts, outs):
        assert len(out) == NEW
        top2 = varied_target.forward(torch.tensor([p + out])).logits[0, len(p) - 1 : -1].topk(2, dim=-1).indices
        assert all(t in top2[i].tolist() for i, t in enumerate(out)), "emitted a token outside the target's top 2"
        second += sum(int(t == top2[i, 1]) for i, t in enumerate(out))
    assert second >= len(prompts) * 3


@pytest.mark.parametrize("mode", MODES)
def test_mtad_threshold_ends(varied_target, prompts, plain, make_drafter, mode):
    """τ = 1 accepts nothing (MTAD = the target alone, = plain greedy); τ = 0 accepts every draft."""
    drafter = make_drafter(seed=7).eval()
    run = SpecEngine(varied_target, MTADProposer(drafter, num_beams=3, threshold=1.0), batch_size=3,
                     max_new_tokens=NEW, mode=mode, stop_token_ids=[-1]).run(prompts)  # fmt: skip
    assert [r.tokens for r in run.results] == plain
    assert set(run.stats.accept_hist) == {0}
    run0 = SpecEngine(varied_target, MTADProposer(drafter, num_beams=3, num_steps=3, threshold=0.0), batch_size=3,
                      max_new_tokens=NEW, mode=mode, stop_token_ids=[-1]).run(prompts)  # fmt: skip
    assert set(run0.stats.accept_hist) == {3}
    assert all(len(r.tokens) == NEW for r in run0.results)


def test_no_bonus_without_path_is_an_error(varied_target, prompts):
    class Broken(PlainProposer):
        def accept(self, slot, tree, logits, sampling, generator):
            return Acceptance([], None)

    with pytest.raises(RuntimeError, match="at least one node"):
        SpecEngine(varied_target, Broken(), batch_size=2, max_new_tokens=4, stop_token_ids=[-1]).run(prompts[:2])
