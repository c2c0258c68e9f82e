"""Tests of drafttrain.verify.planner (speculation that never loses).

The planner only chooses which nodes of a proposer's tree are verified and whether to draft, so
whatever it decides the output must stay plain greedy, token for token. Its decisions are driven by
forward times; here a fixed cost model replaces the measured one so that every branch (verify all,
verify some, verify none and skip drafting, then draft again) runs deterministically.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from drafttrain.verify import DraftTree, ParallelSpecProposer, PlainProposer, SpecEngine
from drafttrain.verify.planner import (
    ForwardCostModel,
    PlannedProposer,
    SpeculationPlanner,
    subtree,
)
from drafttrain.verify.proposers import proposer_for


class FixedCost(ForwardCostModel):
    """t(b, M) = 1 + slope * (M - b): measured forwards are ignored. ``profiled``: the slope counts as known
    (else the planner's first drafted step is its profile, as with the real model)."""

    def __init__(self, slope: float, profiled: bool = True):
        super().__init__()
        self.slope, self.profiled = slope, profiled

    def observe(self, batch, inputs, seconds):
        super().observe(batch, inputs, 0.0)

    def predict(self, batch, inputs):
        return 1.0 + self.slope * (inputs - batch)

    def slope_known(self, batch):
        return self.profiled or super().slope_known(batch)


def planner(slope: float, profiled: bool = True, **kw) -> SpeculationPlanner:
    """A planner whose costs are fixed: t(b, M) from FixedCost, no measured step overhead; it drafts from
    the second step at a batch size (one plain forward as reference)."""
    p = SpeculationPlanner(**{"max_skip": 4, "probe_budget": 0.03, "plain_first": 1, **kw})
    p.cost = FixedCost(slope, profiled)
    p.observe_overhead = lambda batch, drafted, seconds: None
    return p


def test_cost_model_interpolates_and_extrapolates_at_the_measured_slope():
    c = ForwardCostModel(drift=False)  # absolute times: the table's own rules
    assert c.predict(1, 1) is None
    for t in (1.0, 1.2, 1.1):
        c.observe(1, 1, t)
    c.observe(1, 9, 3.0)
    assert c.predict(1, 1) == pytest.approx(1.1)  # median
    assert c.predict(1, 5) == pytest.approx(1.1 + 0.5 * 1.9)  # linear between measured sizes
    assert c.predict(1, 20) == pytest.approx(3.0 + 11 * 1.9 / 8)  # beyond: the measured per-input slope
    assert c.predict(4, 4) is None  # other batch sizes are measured on their own
    assert c.samples(1, 1) == 3 and c.samples(1, 2) == 0


def test_cost_model_borrows_the_per_input_slope_of_the_nearest_batch_size():
    """Beyond the largest M measured at b, an extra input costs what it cost at the nearest batch size
    that measured one (continuous batching changes b whenever a sequence ends); where none has, the
    plain forward's average cost per input (compute-bound: never flat)."""
    c = ForwardCostModel(drift=False)
    c.observe(16, 16, 1.0)
    assert not c.slope_known(16)
    assert c.predict(16, 32) == pytest.approx(2.0)  # nothing known anywhere: 1/16 s per input
    assert c.predict(16, 100) == pytest.approx(1.0 + 84 / 16)
    c.observe(16, 116, 3.0)  # 100 extra inputs cost 2 s at b = 16: 0.02 s each
    assert c.slope_known(16) and c.slope_known(3)
    c.observe(15, 15, 0.9)
    assert c.predict(15, 65) == pytest.approx(0.9 + 50 * 0.02)
    c.observe(4, 4, 0.5)
    c.observe(4, 14, 0.6)  # 0.01 s each at b = 4
    assert c.predict(5, 15) is None  # b = 5 never measured: no plain reference
    c.observe(6, 6, 0.55)
    assert c.predict(6, 16) == pytest.approx(0.55 + 10 * 0.01)  # b = 4 is nearer to 6 than 15 or 16
    assert c.predict(16, 66) == pytest.approx(2.0)  # measured range: interpolation as before


def test_cost_model_never_carries_a_measured_cost_flat():
    """The batch-16 table of a 2-core Zen 3 run: the plain forward (16 inputs) and a 17-input one measured
    often at the same time, larger trees each measured once or twice at their (compute-bound) cost. Every
    larger size is predicted at what it measured, and beyond them the cost keeps growing; the model
    before carried the 16-input cost flat to every size up to 257 inputs."""
    c = ForwardCostModel(drift=False)
    for _ in range(5):
        c.observe(16, 16, 0.0654)
        c.observe(16, 17, 0.0652)  # no dearer than 16 inputs: the noise of a shared host
    for m in (40, 90, 160, 257):
        c.observe(16, m, 0.0654 * m / 16)  # each extra input at the plain forward's average cost
    assert c.predict(16, 257) == pytest.approx(0.0654 * 257 / 16)
    assert c.predict(16, 120) == pytest.approx(0.0654 * 120 / 16)
    assert c.predict(16, 400) == pytest.approx(0.0654 * 400 / 16, rel=1e-3)  # beyond: the measured slope
    assert c.measured(16)[16] == c.measured(16)[17] == pytest.approx(0.0653)  # pooled: more inputs never cheaper
    flat = ForwardCostModel(drift=False)  # a memory-bound host: measured flat, extrapolated at the floor
    flat.observe(2, 2, 1.0)
    flat.observe(2, 10, 1.0)
    assert flat.predict(2, 110) == pytest.approx(1.0 + 100 * 0.02 * 1.0 / 2)
    with pytest.raises(ValueError, match="min_input_cost"):
        ForwardCostModel(min_input_cost=0.0)
    with pytest.raises(ValueError, match="window"):
        ForwardCostModel(window=0)


def test_first_drafting_profiles_the_cost_per_input_then_prices_by_it():
    """Plain steps first (their median is the reference); where no batch size has measured what an extra
    input costs, the first drafted step verifies the batch's best b nodes (M = 2b), whatever they are
    worth; once that forward is measured, a compute-bound host's nodes are priced at their cost and do
    not pay, and drafting stops."""
    p = SpeculationPlanner()
    trees = [_chain([0.6, 0.3, 0.1])] * 16
    for _ in range(3):
        assert not p.should_draft(16)
        p.cost.observe(16, 16, 0.064)
    assert p.should_draft(16)
    p.observe_draft(16, 0.036)
    keep, _ = p.plan(trees)
    assert sum(map(len, keep)) == 16 and all(k == [0] for k in keep) and p.profiles == 1
    assert p.should_draft(16)  # a profile starts no skip run
    p.cost.observe(16, 32, 0.128)  # compute-bound: 4 ms per input, a node worth 0.6 tokens of 4 ms each
    keep, _ = p.plan(trees)
    assert keep == [[]] * 16 and p.profiles == 1
    assert not p.should_draft(16)
    with pytest.raises(ValueError, match="plain_first"):
        SpeculationPlanner(plain_first=0)


def test_cost_model_follows_the_host_speed_for_sizes_no_longer_measured():
    """A host that slows down 20% while only plain forwards are measured: the drifting model scales the
    drafted sizes' old times with it, the absolute one keeps them (and drafting looks 20% cheaper or, the
    other way round, dearer than it is)."""
    for drift in (True, False):
        c = ForwardCostModel(drift=drift)
        for _ in range(5):
            c.observe(1, 1, 1.0)
            c.observe(1, 5, 1.2)
        assert c.predict(1, 5) == pytest.approx(1.2) and c.speed == pytest.approx(1.0)
        for _ in range(20):  # the host slows down by 20%; only plain forwards are measured
            c.observe(1, 1, 1.2)
        assert c.predict(1, 1) == pytest.approx(1.2)
        if drift:
            assert c.speed == pytest.approx(1.2)
            assert c.predict(1, 5) == pytest.approx(1.44)  # 1.2 x its time at the old speed
            assert c.predict(1, 3) == pytest.approx(1.32)  # between measured sizes: scaled alike
            assert c.measured(1) == {1: pytest.approx(1.2), 5: pytest.approx(1.44)}
        else:
            assert c.predict(1, 5) == pytest.approx(1.2)  # stale
    with pytest.raises(ValueError, match="drift_window"):
        ForwardCostModel(drift_window=0)


def test_cost_model_speed_ignores_extrapolations_and_zero_times():
    """Only a size measured at this batch size (or between two) is a reference for the host's speed: a
    first forward of a new size, or a zero time (a fake clock), leaves the speed as it was."""
    c = ForwardCostModel()
    c.observe(1, 1, 1.0)
    c.observe(1, 9, 5.0)  # beyond the measured range: no reference
    c.observe(2, 2, 7.0)  # another batch size, first forward: no reference
    assert c.speed == 1.0
    c.observe(2, 2, 0.0)
    assert c.speed == 1.0
    c.observe(1, 5, 3.3)  # between 1 (1.0) and 9 (5.0): predicted 3.0
    assert c.speed == pytest.approx(1.1)
    p = SpeculationPlanner()
    assert p.summary()["host_speed"] == 1.0
    p.cost = c
    p.observe_draft(1, 0.004)
    summary = p.summary()
    assert summary["host_speed"] == pytest.approx(1.1)
    assert summary["forward_ms"] == {"b1": {1: pytest.approx(1100.0), 5: pytest.approx(3300.0), 9: pytest.approx(5500.0)},
                                     "b2": {2: pytest.approx(3850.0)}}  # median of 7 and 0, at speed 1.1
    assert summary["draft_ms"] == {1: 4.0}


def _chain(scores):
    n = len(scores)
    return DraftTree(torch.arange(10, 10 + n), torch.arange(n) - 1, scores=torch.tensor(scores))


def test_plan_takes_the_nodes_that_pay_best_first_across_the_batch():
    p = planner(slope=0.0)
    p.cost.observe(2, 2, 0.0)
    keep, _ = p.plan([_chain([0.9, 0.8, 0.1]), _chain([0.5, 0.4])])
    assert keep == [[0, 1, 2], [0, 1]]  # free verification: everything
    p = planner(slope=0.3)  # each node costs 0.3 of a forward: only values above ~the running rate pay
    keep, _ = p.plan([_chain([0.9, 0.8, 0.1]), _chain([0.5, 0.4])])
    assert keep == [[0, 1], []]  # (2 + .9 + .8) / 1.6 beats adding .5: (2 + 2.2) / 1.9
    assert all(k == sorted(k) for k in keep)
    p = planner(slope=5.0)  # verification far too dear: plain decoding, and the next step skips drafting
    p.cost.observe(1, 1, 0.0)  # plain decoding measured at batch 1
    p.observe_draft(1, 0.1)  # drafting spent 0.1 s for nothing: this batch size's average gain 1 / 1.1
    keep, _ = p.plan([_chain([0.9, 0.8])])
    assert keep == [[]]
    skipped = 0
    while not p.should_draft(1):
        skipped += 1
    assert skipped == 3  # a priced skip run: the 0.1 s lost is <= 3% of 3 + 1 plain steps: ceil(0.1 / 0.03 - 1)


def test_children_never_outrank_parents_and_calibration_learns():
    p = planner(slope=0.0)
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]), scores=torch.tensor([0.5, 0.5, 0.1]))
    keep, raw = p.plan([tree])
    assert keep == [[0, 1, 2]] and raw[0] == pytest.approx([0.5, 0.5, 0.1])
    for _ in range(50):  # node 0 (confidence 0.5) always accepted, its children never
        p.observe_acceptance(tree, [0.5, 0.5, 0.1], accepted_tokens=[5])
    assert p.calibrated(0.5) > 0.45 and p.calibrated(0.1) < 0.02  # bin (0.4, 0.5]: 1 of 2 nodes; (0.03, 0.1]: 0
    p.observe_acceptance(tree, [0.5, 0.5, 0.1], accepted_tokens=[5, 7])
    assert p.calibrated(0.1) > 0.02


def test_each_source_has_its_own_calibration():
    """Hybrid trees (verify/hybrid.py): a drafter node and an SSSD node of the same raw score are
    calibrated apart, so a drafter that is right at 0.5 is not dragged down by SSSD candidates that are not."""
    p = planner(slope=0.0)
    tree = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, -1]), scores=torch.tensor([0.5, 0.5]),
                     sources=torch.tensor([0, 1]))  # fmt: skip
    for _ in range(60):  # the drafter's node always accepted, SSSD's sibling never
        p.observe_acceptance(tree, [0.5, 0.5], accepted_tokens=[5])
    assert p.calibrated(0.5, 0) > 0.9 and p.calibrated(0.5, 1) < 0.1
    assert p.calibrated(0.5, 2) == pytest.approx(0.5)  # no evidence yet for nodes both propose: the raw value
    keep, _ = p.plan([tree])
    assert keep == [[0, 1]]  # free verification still takes both
    p.cost = FixedCost(0.3)
    keep, _ = p.plan([tree])
    assert keep == [[0]]  # the dear one is dropped by its own source's record
    names = p.summary()["calibration"]
    assert "<=0.5" in names and "sssd <=0.5" in names
    untagged = planner(slope=0.0)  # a tree without sources: every node is the drafter's
    for _ in range(60):
        untagged.observe_acceptance(DraftTree(tree.tokens, tree.parents, scores=tree.scores), [0.5, 0.5], [5])
    assert 0.4 < untagged.calibrated(0.5) < 0.6  # one of the two 0.5 nodes accepted: the mixed record


def test_step_overhead_prices_a_drafted_step():
    """A drafted step whose time outside drafting and the forward is large (measured) is priced with it:
    the same tree that pays without overhead is not verified with it, and drafting then pauses."""
    tree = _chain([0.9, 0.8])
    p = planner(slope=0.1)  # forward 1.0 s plain, +0.1 s per node
    del p.observe_overhead  # the real method: overheads given by hand below
    p.cost.observe(1, 1, 0.0)
    assert p.plan([tree])[0] == [[0, 1]]
    p.observe_overhead(1, True, 3.0)  # a drafted step also spends 3 s in bookkeeping, a plain one none
    p.observe_overhead(1, False, 0.0)
    assert p.plan([tree])[0] == [[]]  # (1 + 1.7) / (1.2 + 3) < 1 / 1
    assert not p.should_draft(1)
    assert p.summary()["overhead_ms"] == {"b1_plain": 0.0, "b1_drafted": 3000.0}


def test_planned_proposer_measures_step_overhead(tiny_target, make_drafter):
    """PlannedProposer times whole engine steps (its draft call to the engine's step_done) and reports
    what is neither drafting nor the verification forward, apart for drafted and plain steps; the
    prefills between steps are left out."""
    drafter = make_drafter(seed=3)
    pl = SpeculationPlanner()
    prop = PlannedProposer(ParallelSpecProposer(drafter, widths=[2, 1, 1], budget=3), pl)
    seen = []
    orig = pl.observe_overhead
    pl.observe_overhead = lambda b, d, s: (seen.append((b, d, s)), orig(b, d, s))
    steps = []  # whole steps for the realized rates: (b, drafted, seconds, tokens committed)
    orig_step = pl.observe_step
    pl.observe_step = lambda b, d, s, n: (steps.append((b, d, s, n)), orig_step(b, d, s, n))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 13, 8)]
    eng = SpecEngine(tiny_target, prop, batch_size=2, max_new_tokens=12, stop_token_ids=-1)
    eng.run(prompts)
    # each live sequence commits 1 to 3 + 1 tokens (one that finishes commits nothing)
    assert steps and all(s > 0 and 0 <= n <= 4 * b for b, _, s, n in steps) and max(n for *_, n in steps) > 2
    assert sum(n for *_, n in steps) <= 3 * 11  # 12 new tokens per prompt, the first from its prefill
    assert any(d for _, d, _, _ in steps)
    assert seen and all(s >= 0 for _, _, s in seen)
    assert {b for b, _, _ in seen} <= {1, 2} and any(d for _, d, _ in seen)
    assert len(seen) == pl.steps  # every step, also the last before a prefill and the run's last
    assert (2, True) in pl.overhead_seconds


def test_a_sequences_first_drafting_is_not_priced_as_a_step(tiny_target, make_drafter):
    """The drafter's prefill over a new sequence's prompt is paid once per sequence: a drafting call that
    holds one is kept apart from the planner's drafting-time estimate (which prices every later step)
    and stands in only until a steady step is measured."""
    drafter = make_drafter(seed=3)
    inner = ParallelSpecProposer(drafter, widths=[2, 1, 1], budget=3)
    seen_slots, orig = set(), inner.draft

    def draft(slots, sampling, generator):  # a new sequence's first drafting is slow, as a long prompt's prefill
        if any(s not in seen_slots for s in slots):
            time.sleep(0.05)
        seen_slots.update(slots)
        return orig(slots, sampling, generator)

    inner.draft = draft
    pl = SpeculationPlanner(max_skip=1, plain_first=1, probe_rows=3)  # skip runs of one step: steady steps come soon after
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 13, 8)]
    SpecEngine(tiny_target, PlannedProposer(inner, pl), batch_size=3, max_new_tokens=24, stop_token_ids=-1).run(prompts)
    assert len(seen_slots) == 3 and pl.draft_seconds  # sequences started, and steady steps were measured
    assert max(pl.draft_seconds.values()) < 0.05 <= min(pl.first_draft_seconds.values())
    assert all(pl.draft_cost(b) == pl.draft_seconds[b] for b in pl.draft_seconds)
    fresh = SpeculationPlanner()
    fresh.observe_draft(2, 0.4, first=True)
    assert fresh.draft_cost(2) == 0.4 and fresh.draft_cost(4) == 0.8  # before any steady step: the first one stands in
    fresh.observe_draft(2, 0.01)
    assert fresh.draft_cost(2) == 0.01 and fresh.draft_cost(1) == 0.005


def test_subtree_reindexes():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 2]), scores=torch.tensor([0.9, 0.3, 0.8, 0.7]))
    sub = subtree(tree, [0, 2, 3])
    assert sub.tokens.tolist() == [5, 7, 8] and sub.parents.tolist() == [-1, 0, 1]
    assert sub.scores.tolist() == pytest.approx([0.9, 0.8, 0.7])
    assert subtree(tree, []).n == 0
    tagged = DraftTree(tree.tokens, tree.parents, scores=tree.scores, sources=torch.tensor([0, 1, 2, 1]))
    assert subtree(tagged, [0, 2, 3]).sources.tolist() == [0, 2, 1]


@pytest.fixture(scope="module")
def varied(varied_target):
    """The tiny target with redrawn weights (conftest.varied_target): its greedy token changes every step."""
    return varied_target


@pytest.mark.parametrize("which", ["varied", "tiny"])
@pytest.mark.parametrize("slope", [0.0, 0.15, 50.0])  # verify all / some / none (drafting skipped, resumed)
def test_planned_engine_equals_plain_greedy(varied, tiny_target, make_drafter, which, slope):
    target = varied if which == "varied" else tiny_target
    drafter = make_drafter(seed=3)
    drafter.layer.load_state_dict(target.last_layer.state_dict())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 13, 8, 21, 6)]
    plain = SpecEngine(target, PlainProposer(), batch_size=3, max_new_tokens=24, stop_token_ids=-1).run(prompts)
    # the first drafted step profiles the cost per input (its b best nodes: also the calibration's first
    # evidence, which a drafter under-confident at first needs); slope 0 verifies everything from the start
    pl = planner(slope, profiled=slope == 0.0)
    prop = PlannedProposer(ParallelSpecProposer(drafter, widths=[2, 2, 1, 1], budget=5), pl)
    run = SpecEngine(target, prop, batch_size=2, max_new_tokens=24, stop_token_ids=-1).run(prompts)
    for a, p in zip(run.results, plain.results):
        assert a.tokens == p.tokens
    if slope == 50.0:
        assert pl.skipped_steps > pl.steps // 2  # drafting mostly skipped
        assert pl.nodes_verified <= 2 and pl.profiles == 1  # the profile's nodes only
    assert run.stats.tree_nodes == pl.nodes_verified
    if slope == 0.0:
        assert pl.nodes_verified == pl.nodes_offered > 0
    if which == "tiny" and slope < 1:
        assert run.stats.tau > 1.0  # drafts were accepted through the wrapper: the drafter stayed in step


def test_planned_drafter_cache_stays_in_step_through_skips(tiny_target, make_drafter):
    """After skipped steps the inner drafter gets the missed items in one commit (or one start):
    its committed item count equals the target's committed tokens at every drafted step."""
    drafter = make_drafter(seed=3)
    inner = ParallelSpecProposer(drafter, widths=[2, 1, 1], budget=3)
    pl = planner(slope=50.0)  # skip runs of 1, 2, 4, 4, ...
    prop = PlannedProposer(inner, pl)
    checked = []
    orig = inner.draft

    def draft(slots, sampling, generator):
        trees = orig(slots, sampling, generator)
        for s in slots:  # after the append: items = committed tokens - 1 (the root's item is the next one)
            seq = next(q for q in eng.rows if q is not None and q.slot == s)
            checked.append(int(inner._cache.lengths[s]) == len(seq.prompt) + len(seq.generated) - 1)
        return trees

    inner.draft = draft
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 13, 8)]
    eng = SpecEngine(tiny_target, prop, batch_size=2, max_new_tokens=30, stop_token_ids=-1)
    eng.run(prompts)
    assert checked and all(checked)


def test_proposer_for_plan_and_refusal():
    class OwnRule:
        name = "own"

        def accept(self, *a):
            raise AssertionError

    with pytest.raises(ValueError, match="own acceptance rule"):
        PlannedProposer(OwnRule())


def test_planned_sampling_runs_and_keeps_draws_prefix(tiny_target, make_drafter):
    """Under sampling the kept children of a node are its first draws (ranks 0..m-1), so the recursive
    rejection rule still applies; a run completes with valid trees."""
    from drafttrain.verify import SamplingParams

    drafter = make_drafter(seed=3)
    drafter.layer.load_state_dict(tiny_target.last_layer.state_dict())
    prop = proposer_for(drafter, widths=[3, 2, 1], budget=5, plan=True)
    prop.planner.cost = FixedCost(0.2)
    seen = []
    orig = prop.inner.draft

    def draft(slots, sampling, generator):
        trees = orig(slots, sampling, generator)
        seen.extend(trees)
        return trees

    prop.inner.draft = draft
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 9)]
    run = SpecEngine(tiny_target, prop, batch_size=2, max_new_tokens=16, stop_token_ids=-1,
                     sampling=SamplingParams(temperature=0.8)).run(prompts)  # fmt: skip
    assert all(len(r.tokens) == 16 for r in run.results)
    assert seen and all(t.draft_probs is not None and t.scores is not None for t in seen)


def test_drafter_eval_planned_run(tiny_target, make_drafter):
    """The in-training evaluation's planned run: its outputs are checked like the others; tau stays the full tree's."""
    from drafttrain.eval.in_training import drafter_eval

    drafter = make_drafter(seed=3)
    drafter.layer.load_state_dict(tiny_target.last_layer.state_dict())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 9, 6)]
    r = drafter_eval(tiny_target, drafter, prompts, 12, batch_size=2, progress=False, plan=True)
    assert r["greedy_equal"] and r["speedup_planned"] > 0 and r["planner"]["steps"] > 0
    assert r["tau"] > 1.0  # the unplanned chain's acceptance, as before
    assert r["speedup_decode"] > 0 and r["speedup_planned_decode"] > 0  # the decoding steps alone


def test_bench_planner_variants_side_by_side(tmp_path, checkpoint):
    """scripts.bench_planner on the tiny target: plain and every variant per batch size and round,
    interleaved; every output equal to plain greedy; the report's rows and command."""
    from scripts.bench_planner import main

    out = tmp_path / "planner"
    tiny = ["target.name=tiny", "target.random_init=true", "target.hidden_size=64", "target.intermediate_size=128",
            "target.num_hidden_layers=2", "target.num_attention_heads=4", "target.num_key_value_heads=2"]  # conf/target/tiny.yaml
    res = main([f"run={checkpoint}", *tiny, "sssd=input", "nodes=4", "num_prompts=3", "max_new_tokens=8", "b1_prompts=2",
                "batch_sizes=[1,2]", "rounds=2", "variants=[mixed,per_source,full,tree,realized]", f"out={out}"])  # fmt: skip
    variants = ("mixed", "per_source", "full", "tree", "realized")
    got = [(r["batch_size"], r["variant"], r["prompts"]) for r in res["rows"]]
    assert got == [(b, v, n) for b, n in ((1, 2), (2, 3)) for v in variants]  # batch 1: 2 prompts, interleaved per prompt
    for r in res["rows"]:
        assert r["greedy_equal"] is True and len(r["speedups"]) == 2 and r["speedup_median"] > 0
        assert len(r["decode_speedups"]) == 2 and r["decode_speedup_median"] > 0  # prompt forwards left out
        assert (r["planner_last_round"] is None) == (r["variant"] == "tree")  # the whole tree: no planner
        assert r["plain_tokens_per_s"] > 0 and r["tau"] >= 1.0
    full = next(r for r in res["rows"] if r["variant"] == "full" and r["batch_size"] == 2)["planner_last_round"]
    assert full["overhead_ms"]  # the full variant measured step overheads
    md = out.with_suffix(".md").read_text()
    assert "| 2 | full | 3 | **" in md and "python -m scripts.bench_planner" in md
    assert json.loads(out.with_suffix(".json").read_text())["sssd"] == "input, 4 nodes"


def test_bench_planner_rejects_unknown_variant(checkpoint):
    from drafttrain.config import ConfigError
    from scripts.bench_planner import main

    with pytest.raises(ConfigError, match="variants"):
        main([f"run={checkpoint}", "variants=[fancy]"])


def _skip_run(p: SpeculationPlanner) -> int:
    """Steps at batch 1 until the planner drafts again (the skip run under way)."""
    n = 0
    while not p.should_draft(1):
        n += 1
    return n


def test_priced_probes_set_the_skip_run_from_the_measured_loss():
    """An unpaid drafted step that lost L seconds is followed by a skip run of ceil(L / (budget * t_plain) - 1)
    steps, at least the doubling run (1, 2, 4, ... unpaid steps in a row), at most max_skip."""

    def priced(budget, max_skip=64):
        p = SpeculationPlanner(max_skip=max_skip, probe_budget=budget, plain_first=1)
        p.cost = FixedCost(5.0)  # plain forward 1 s, +5 s per node: a node never pays
        p.cost.observe(1, 1, 0.0)
        p.observe_draft(1, 0.35)  # drafting lost 0.35 s
        assert p.plan([_chain([0.9])])[0] == [[]]
        return p

    p = priced(0.1)
    assert p.last_loss == pytest.approx(0.35)
    assert _skip_run(p) == 3  # ceil(0.35 / 0.1 - 1)
    p = priced(0.01, max_skip=20)
    assert _skip_run(p) == 20  # ceil(34) capped
    p = priced(0.9)  # a generous budget: the doubling runs
    assert _skip_run(p) == 1
    p.plan([_chain([0.9])])  # the re-probe does not pay either: the run doubles
    assert _skip_run(p) == 2
    p.plan([_chain([0.9])])
    assert _skip_run(p) == 4
    with pytest.raises(ValueError, match="probe_budget"):
        SpeculationPlanner(probe_budget=1.5)
    with pytest.raises(ValueError, match="max_skip"):
        SpeculationPlanner(max_skip=0)


@pytest.mark.parametrize("budget", [0.03, 0.1])
def test_priced_probes_bound_what_a_drafter_that_never_pays_costs(budget):
    """A drafter whose drafting and probe nodes never pay, over a long run: the time lost against plain
    decoding (its drafting) stays within the budget, where skip runs that are not priced (capped at one
    step here) lose several times more."""

    def lost_fraction(p, steps=600):
        lost = 0.0
        for _ in range(steps):
            if p.should_draft(1):
                p.plan([_chain([0.3, 0.2])])
                lost += p.last_loss
        return lost / steps  # a plain step costs 1 s

    def make(**kw):
        p = SpeculationPlanner(plain_first=1, **kw)
        p.cost = FixedCost(0.5)
        p.cost.observe(1, 1, 0.0)
        p.observe_draft(1, 0.35)
        return p

    priced = lost_fraction(make(probe_budget=budget))
    doubling = lost_fraction(make(probe_budget=0.9, max_skip=1))
    assert 0 < priced <= 1.05 * budget
    assert doubling > 2 * priced


def test_realized_rates_decide_whether_to_keep_drafting():
    """Once enough drafting steps are seen, their measured tokens/s against plain steps' decide: a step whose
    predicted gain is below 1 starts no skip run while drafting measured faster, and a step whose predicted
    gain is far above 1 starts one when drafting measured slower (the model before only asked the measured
    rates to keep drafting, never to stop it); with too few seen, the prediction decides."""
    def make(realized, drafted=(2, 1.0), plain=(1, 1.0), n=10):
        p = SpeculationPlanner(realized=realized, plain_first=1)
        p.cost = FixedCost(0.1)  # plain forward 1 s, +0.1 s per node
        p.cost.observe(1, 1, 0.0)
        p.observe_draft(1, 0.2)  # drafting costs 0.2 s
        for _ in range(n):
            p.observe_step(1, True, drafted[1], drafted[0])
            p.observe_step(1, False, plain[1], plain[0])
        return p

    bad = _chain([0.01])  # predicted: plain decoding, gain 1 / 1.2
    assert make(True).realized_rate(1, True) == pytest.approx(2.0)
    for p, skips in ((make(False), True),  # the prediction alone
                     (make(True), False),  # measured: 2 tokens/s drafted against 1 plain
                     (make(True, drafted=(1, 2.0)), True),  # measured: 0.5 against 1
                     (make(True, n=7), True)):  # too few steps seen to judge by
        p.plan([bad])
        assert p.should_draft(1) is not skips
    p = make(True, plain=(1, 1.0), n=10)
    p._steps_seen.pop((1, False))  # no plain step seen: the cost model's plain step (1 s + 0 overhead)
    p.plan([bad])
    assert p.should_draft(1)
    assert "b1_drafted" in p.summary()["realized_tok_s"]
    good = _chain([0.9, 0.8])  # predicted: (1 + 1.7) / 1.4, gain 1.9
    for realized, n, skips in ((True, 10, True), (False, 10, False), (True, 7, False)):
        p = make(realized, drafted=(1, 2.0), n=n)  # measured: 0.5 tokens/s drafting against 1 plain
        assert p.plan([good])[0] == [[0, 1]]
        assert p.should_draft(1) is not skips
        assert p.summary()["realized_stops"] == int(skips)
    p = make(True, drafted=(1, 2.0))
    p.plan([good])
    assert p.last_loss == pytest.approx(1.0)  # a measured drafting step: 2 s for 1 token, 1 s plain
    assert _skip_run(p) == 99  # ceil(1 / 0.01 - 1), within max_skip (256)


def test_drafter_eval_interleaved_equals_whole_runs(tiny_target, make_drafter, monkeypatch):
    """interleave="prompt" (prompt by prompt through every run in turn) and "step" (the engines in
    lock-step): the same outputs and counters (tau, generated tokens) as whole runs, one result per
    prompt in prompt order."""
    from drafttrain.eval.in_training import drafter_eval

    drafter = make_drafter(seed=3)
    drafter.layer.load_state_dict(tiny_target.last_layer.state_dict())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 11, 7)]
    kw = dict(batch_size=1, progress=False, tree_widths=[2, 1, 1], tree_budget=4)
    whole = drafter_eval(tiny_target, drafter, prompts, 10, **kw)
    for unit in ("prompt", "step"):
        inter = drafter_eval(tiny_target, drafter, prompts, 10, interleave=unit, **kw)
        assert inter["greedy_equal"] and whole["greedy_equal"]
        assert [o["tokens"] for o in inter["outputs"]] == [o["tokens"] for o in whole["outputs"]]
        assert inter["tau"] == pytest.approx(whole["tau"]) and inter["tau"] > 1.0
        assert inter["generated_tokens"] == whole["generated_tokens"] == 30
        planned = drafter_eval(tiny_target, drafter, prompts, 10, interleave=unit, plan=True, full_tree=False, **kw)
        assert planned["greedy_equal"] and planned["planner"]["steps"] > 0 and planned["speedup"] > 0
    kw["batch_size"] = 2  # lock-step at batch 2: continuous batching in both engines
    import drafttrain.eval.driver as spec_mod

    warmed, inner = [], spec_mod.run_interleaved

    def spy(engines, prompts, **k):  # the warm-up: an untimed prefill of the first wave, before any engine runs
        assert all(not e.results and e.stats.forwards == 0 for e in engines.values())
        k.pop("warm_up")()
        warmed.append(sum(e.stats.forwards for e in engines.values()))  # it ran outside the timed engines
        return inner(engines, prompts, **k)

    monkeypatch.setattr(spec_mod, "run_interleaved", spy)
    two = drafter_eval(tiny_target, drafter, prompts, 10, interleave="step", plan=True, **kw)
    assert warmed == [0]
    assert two["greedy_equal"] and two["tau"] > 1.0 and two["planner"]["steps"] > 0
    with pytest.raises(ValueError, match="unit"):
        drafter_eval(tiny_target, drafter, prompts, 10, interleave="sometimes", **kw)


def test_run_interleaved_orders():
    """run_interleaved: whole runs in dict order; per prompt, the order reversed every other prompt
    (neighbours stay neighbours) or rotated by one (every engine takes every position)."""
    from drafttrain.eval.driver import run_interleaved

    calls = []

    class Fake:
        def __init__(self, name):
            self.name, self.seen = name, []

        def run(self, prompts, progress=False):
            calls.append((self.name, [p[0] for p in prompts]))
            self.seen += prompts
            return list(self.seen)  # stands in for an EngineRun holding every prompt so far

    def go(**kw):
        calls.clear()
        runs = run_interleaved({n: Fake(n) for n in "abc"}, [[0], [1], [2]], **kw)
        assert all(r == [[0], [1], [2]] for r in runs.values())  # each engine saw every prompt, in order
        return [n for n, _ in calls]

    assert go(unit="run") == ["a", "b", "c"] and calls[0] == ("a", [0, 1, 2])
    assert go(unit="prompt") == list("abc" "cba" "abc")
    assert go(unit="prompt", rotate=True) == list("abc" "bca" "cab")



def test_run_interleaved_lock_step():
    """unit="step": the engines advance one step each in turn (reversed every other turn); an engine
    that is done sits out; each returns its own result."""
    from drafttrain.eval.driver import run_interleaved

    calls = []

    class Fake:
        def __init__(self, name, steps):
            self.name, self.left, self.got = name, steps, None

        def submit(self, prompts):
            self.got = prompts

        @property
        def done(self):
            return self.left == 0

        def advance(self):
            calls.append(self.name)
            self.left -= 1

        def result(self):
            return (self.name, self.got)

        results = {}

    runs = run_interleaved({"a": Fake("a", 3), "b": Fake("b", 1)}, [[7]], unit="step",
                           warm_up=lambda: calls.append("warm"))  # fmt: skip
    assert calls == ["warm", "a", "b", "a", "a"]  # warm-up first, untimed; turn 0: a b; turn 1: (b done) a; turn 2: a
    assert runs == {"a": ("a", [[7]]), "b": ("b", [[7]])}
    with pytest.raises(ValueError, match="unit"):
        run_interleaved({}, [], unit="batch")


def test_a_probe_drafts_a_few_rows_and_prices_drafting_every_row():
    """Where drafting has not been judged to pay at a batch size (or a larger one), only ``probe_rows``
    sequences draft; the step's nodes, b / rows times over, with the drafting time scaled to b rows price
    drafting every row: the next step drafts every row only where that pays."""
    p = planner(0.01, probe_rows=2)
    assert p.draft_rows(16) == 2 and p.draft_rows(2) == 2 and p.draft_rows(1) == 1
    p.observe_draft(2, 0.05)  # drafting every row: 0.4, the scaled price
    trees = [_chain([0.9, 0.9, 0.9])] * 2 + [DraftTree.empty()] * 14
    keep, _ = p.plan(trees, drafted=2)
    assert [len(k) for k in keep[:2]] == [3, 3] and not any(keep[2:]) and p.probes == 1
    # every row: 16 + 8 * 6 * 0.9 = 59.2 tokens in 0.4 + 1 + 0.48 s against 16 in 1 s: it pays
    assert p.draft_rows(16) == 16 and p.draft_rows(8) == 8 and p.draft_rows(32) == 2
    q = planner(0.2, probe_rows=2)  # 0.2 s an input: no node pays, for 2 rows or for 16
    q.observe_draft(2, 0.05)
    keep, _ = q.plan(trees, drafted=2)
    assert not any(keep) and q.draft_rows(16) == 2 and not q.should_draft(16)  # a skip run follows
    r = planner(0.01, probe_rows=2)  # drafting every row costs 8 x 0.5 s: 59.2 tokens in 5.48 s < 16 in 1 s
    r.observe_draft(2, 0.5)
    r.plan(trees, drafted=2)
    assert r.draft_rows(16) == 2 and not r.should_draft(16)
    with pytest.raises(ValueError, match="probe_rows"):
        SpeculationPlanner(probe_rows=0)


class _Recorder:
    """An inner proposer that records what it is handed and drafts a one-node chain per sequence."""

    name, lossless = "rec", True

    def __init__(self):
        self.drafted, self.started = [], []

    def start(self, slot, prompt_ids, hidden, first_token):
        self.started.append(slot)

    def commit(self, slot, tokens, hidden):
        pass

    def release(self, slot):
        pass

    def draft(self, slots, sampling=None, generator=None):
        self.drafted.append(list(slots))
        return [_chain([0.5]) for _ in slots]


def test_a_probe_drafts_the_rows_whose_drafter_is_in_step_first():
    """A probe's rows are those the drafter has seen (least to catch up on first), then the shortest prompts:
    a first drafting runs the drafter over the whole prompt. The others stay pending (their start is handed
    on when they first draft), and their trees are empty."""
    inner = _Recorder()
    p = planner(0.01, probe_rows=2)
    prop = PlannedProposer(inner, p)
    for slot, n in zip(range(4), (10, 3, 7, 5)):
        prop.start(slot, list(range(n)), torch.zeros(n, 1), 1)
    p.cost.observe(4, 4, 1.0)
    trees = prop.draft([0, 1, 2, 3])
    assert inner.drafted == [[1, 3]] and sorted(inner.started) == [1, 3]
    assert [t.n for t in trees] == [0, 1, 0, 1]
    for s, t in enumerate(trees):
        prop.commit(s, [1] * (t.n + 1), torch.zeros(t.n + 1, 1))
    prop.step_done()
    assert not p._steps_seen  # a probe is neither a drafting nor a plain step of the measured rates
    p._pays.clear()  # whatever it judged: probe again; now slots 1 and 3 are in step, 0 and 2 are not started
    prop.draft([0, 1, 2, 3])
    assert inner.drafted[-1] == [1, 3]
