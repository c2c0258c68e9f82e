"""Tests of drafttrain.verify.methods.sssd: input trie vs brute force, fused trees (literal, ancestor-closed,
within budget), membership rule lossless (chi-square) and greedy-exact, simulation, planner (< 15 s)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from drafttrain.verify.methods.sssd_datastore import Datastore
from drafttrain.verify.methods.sssd import (
    InputTrie,
    SSSDConfig,
    SSSDDrafter,
    SSSDState,
    SSSDTree,
    fuse_candidates,
    membership_accept,
    membership_walk,
    plan_speculation_length,
    simulate_greedy,
)


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square goodness-of-fit p-value (all expected counts > 0)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


# ---------------------------------------------------------------------------------------------
# input trie
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,vocab", [(0, 2), (1, 3), (2, 6)])
def test_input_trie_counts_equal_brute_force_under_incremental_updates(seed, vocab):
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, vocab, 300).tolist()
    trie = InputTrie(max_ngram=5, tokens=stream[:17])
    pos = 17
    while pos < len(stream):  # append in random chunks, as accepted tokens arrive
        step = int(rng.integers(1, 6))
        trie.extend(stream[pos : pos + step])
        pos += step
        seen = stream[:pos]
        for n in range(1, 6):
            for gram in itertools.product(range(vocab), repeat=n) if vocab ** n <= 64 else []:
                brute = sum(1 for i in range(len(seen) - n + 1) if tuple(seen[i : i + n]) == gram)
                assert trie.count(gram) == brute
    assert trie.tokens == stream and len(trie) == 300 and trie.root[0] == 300
    with pytest.raises(ValueError, match="max_ngram"):
        trie.count([0] * 6)


# ---------------------------------------------------------------------------------------------
# fused trees
# ---------------------------------------------------------------------------------------------
FLAT = dict(input_scale=1.0, input_depth_damp=1.0, input_match_damp=1.0, datastore_depth_damp=1.0, datastore_match_damp=1.0)


def test_input_tree_literal():
    """Prefix [5, 6] occurs 3 times, twice with a continuation: 7 5 and 8 5 -> p = 1/2 each."""
    cfg = SSSDConfig(max_prefix_len=2, min_prefix_len=2, max_depth=2, node_budget=10, use_datastore=False, **FLAT)
    d = SSSDDrafter(cfg)
    tree = d.draft(d.new_state([5, 6, 7, 5, 6, 8, 5, 6]))
    assert tree.tokens.tolist() == [7, 8, 5, 5]
    assert tree.parents.tolist() == [-1, -1, 0, 1]
    assert tree.depths.tolist() == [1, 1, 2, 2]
    assert torch.allclose(tree.scores, torch.tensor([0.5, 0.5, 0.5, 0.5]))
    # input scaling and depth damping: score = p * 0.5 * 0.8 ** (depth - 1)
    d2 = SSSDDrafter(SSSDConfig(**{**cfg.__dict__, "input_scale": 0.5, "input_depth_damp": 0.8}))
    assert torch.allclose(d2.draft(d2.new_state([5, 6, 7, 5, 6, 8, 5, 6])).scores, torch.tensor([0.25, 0.25, 0.2, 0.2]))
    # budget 3 keeps the best 3, still a tree
    assert d.draft(d.new_state([5, 6, 7, 5, 6, 8, 5, 6]), node_budget=3).parents.tolist() == [-1, -1, 0]


def test_datastore_tree_literal_and_match_damping():
    ds = Datastore.from_documents([[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 9]])
    cfg = SSSDConfig(max_prefix_len=2, min_prefix_len=1, max_depth=2, node_budget=10, use_input=False, **FLAT)
    d = SSSDDrafter(cfg, ds)
    tree = d.draft(d.new_state([4, 5, 6]))
    assert tree.tokens.tolist() == [7, 9, 1, 2]
    assert tree.parents.tolist() == [-1, -1, 0, 0]
    assert torch.allclose(tree.scores, torch.tensor([2 / 3, 1 / 3, 1 / 3, 1 / 3]))
    # a match one token shorter than P is damped once: context [..., 6] matches [6] only via L=1
    damped = SSSDDrafter(SSSDConfig(**{**cfg.__dict__, "datastore_match_damp": 0.5}), ds)
    t1 = damped.draft(damped.new_state([3, 6]))
    assert t1.tokens.tolist()[:2] == [7, 9] and torch.allclose(t1.scores[:2], torch.tensor([1 / 3, 1 / 6]))


def test_fusion_max_and_sum_literal():
    a = [((1,), 0.6), ((1, 2), 0.3)]
    b = [((1,), 0.2), ((3,), 0.5), ((1, 4), 0.25)]
    assert fuse_candidates([a, b], 10, "max") == [((1,), 0.6), ((3,), 0.5), ((1, 2), 0.3), ((1, 4), 0.25)]
    got = fuse_candidates([a, b], 10, "sum")
    assert [p for p, _ in got] == [(1,), (3,), (1, 2), (1, 4)] and got[0][1] == pytest.approx(0.8)
    assert fuse_candidates([a, b], 2, "max") == [((1,), 0.6), ((3,), 0.5)]
    assert fuse_candidates([a, b], 10, "max", min_score=0.4) == [((1,), 0.6), ((3,), 0.5)]


def _assert_valid_tree(tree: SSSDTree, budget: int, max_depth: int) -> None:
    n = len(tree)
    assert n <= budget
    parents, tokens, depths = tree.parents.tolist(), tree.tokens.tolist(), tree.depths.tolist()
    paths = []
    for i in range(n):
        assert -1 <= parents[i] < i  # ancestor-closed, parents listed first
        assert depths[i] == (1 if parents[i] < 0 else depths[parents[i]] + 1) <= max_depth
        paths.append((paths[parents[i]] if parents[i] >= 0 else ()) + (tokens[i],))
    assert len(set(paths)) == n  # no duplicate siblings
    assert all(a >= b for a, b in zip(tree.scores.tolist(), tree.scores.tolist()[1:]))  # best-first


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_fused_trees_are_ancestor_closed_and_within_budget(combine):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5, rng.integers(5, 60)).tolist() for _ in range(100)]
    ds = Datastore.from_documents(docs)
    for budget, depth, scale in [(1, 3, 0.5), (7, 4, 2.0), (25, 6, 1.0), (60, 8, 0.3)]:
        cfg = SSSDConfig(max_prefix_len=4, max_depth=depth, node_budget=budget, max_samples=20, min_continuations=10,
                         input_scale=scale, input_depth_damp=0.8, datastore_match_damp=0.7, combine=combine)
        d = SSSDDrafter(cfg, ds)
        for _ in range(15):
            ctx = rng.integers(0, 5, rng.integers(1, 80)).tolist()
            tree = d.draft(d.new_state(ctx))
            _assert_valid_tree(tree, budget, depth)
            if len(ctx) > 10:
                assert len(tree) == budget  # small vocabulary: there are always enough candidates
    assert len(d.draft(d.new_state([99]))) == 0  # unseen token: empty tree


def test_draft_batch_equals_per_sequence_drafts_with_and_without_threads():
    rng = np.random.default_rng(1)
    ds = Datastore.from_documents([rng.integers(0, 8, 50).tolist() for _ in range(50)])
    cfg = SSSDConfig(max_prefix_len=3, max_depth=4, node_budget=12)
    states_src = [rng.integers(0, 8, rng.integers(1, 40)).tolist() for _ in range(9)]
    single = SSSDDrafter(cfg, ds)
    ref = [single.draft(single.new_state(c)) for c in states_src]
    for drafter in (single, SSSDDrafter(cfg, ds, num_threads=3)):
        got = drafter.draft_batch([drafter.new_state(c) for c in states_src], node_budget=[12] * 9)
        for a, b in zip(ref, got):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.scores, b.scores)
    contract = ref[0].contract()
    assert set(contract) == {"tokens", "parents", "draft_probs", "dist_index"} and contract["tokens"].dtype == torch.long


def test_a_state_kept_up_to_date_drafts_as_a_fresh_one():
    """SSSDState.append keeps the datastore ranges current: after commits, drafting from the grown state
    equals drafting from a new state over the same context (trees, scores), at every step."""
    rng = np.random.default_rng(2)
    ds = Datastore.from_documents([rng.integers(0, 6, 40).tolist() for _ in range(40)])
    d = SSSDDrafter(SSSDConfig(max_prefix_len=3, max_depth=4, node_budget=10), ds)
    state = d.new_state([1, 2])
    assert state.ranges is not None and len(state.ranges) == 2
    for _ in range(20):
        state.append(int(t) for t in rng.integers(0, 7, int(rng.integers(1, 4))))  # a generator, as the engine's commits
        a, b = d.draft(state), d.draft(d.new_state(list(state.tokens)))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.scores, b.scores)
    assert SSSDDrafter(SSSDConfig(), None).new_state([1, 2]).ranges is None  # input only: nothing to keep
    bare = SSSDState(InputTrie(3 + 4, list(state.tokens)))  # made by hand, no ranges: searched afresh
    a, b = d.draft(bare), d.draft(state)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.scores, b.scores)


def test_config_validation_names_bad_fields():
    with pytest.raises(ValueError, match="input_depth_damp") as err:
        SSSDConfig(input_depth_damp=1.5, combine="mean").validate()
    assert "combine" in str(err.value)


# ---------------------------------------------------------------------------------------------
# membership rule
# ---------------------------------------------------------------------------------------------
V = 3


def _toy_target(seed: int = 0) -> torch.Tensor:
    """p(x | ..., a, b) = table[a, b]: a second-order Markov "target" over V tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, V, generator=g) * 0.6, dim=-1)


def _probs_for_tree(table: torch.Tensor, ctx: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    rows = [table[ctx[-2], ctx[-1]]]
    paths: list[list[int]] = []
    for tok, par in zip(tokens, parents):
        paths.append((paths[par] if par >= 0 else []) + [tok])
        seq = ctx + paths[-1]
        rows.append(table[seq[-2], seq[-1]])
    return torch.stack(rows)


def _random_tree(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    n = int(rng.integers(0, 7))
    parents = [int(rng.integers(-1, i)) for i in range(n)]
    return rng.integers(0, V, n).tolist(), parents  # duplicate siblings allowed


def _generate(rule, table, rng, gen, length: int) -> list[int]:
    ctx = [0, 1]
    while len(ctx) < 2 + length:
        tokens, parents = _random_tree(rng)
        probs = _probs_for_tree(table, ctx, tokens, parents)
        ctx += rule(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), probs, gen)
    return ctx[2 : 2 + length]


def test_membership_rule_is_lossless_chi_square():
    """First 3 tokens over 27 cells vs the target's exact joint law; a biased rule must fail the same test."""
    table = _toy_target()
    exact = np.zeros(V**3)
    for a, b, c in itertools.product(range(V), repeat=3):
        exact[a * 9 + b * 3 + c] = float(table[0, 1, a] * table[1, a, b] * table[a, b, c])
    assert exact.min() * 4000 > 30  # every cell expects enough counts for the chi-square approximation
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)

    def ok_rule(tokens, parents, probs, g):
        return membership_accept(tokens, parents, probs, generator=g).tokens

    def biased_rule(tokens, parents, probs, g):  # on a miss, emits a child's token instead of the sample
        def nxt(node):
            x = int(torch.multinomial(probs[node + 1], 1, generator=g))
            kids = [t for t, p in zip(tokens.tolist(), parents.tolist()) if p == node]
            return x if (x in kids or not kids) else kids[0]
        return membership_walk(tokens.tolist(), parents.tolist(), nxt).tokens

    for rule, should_pass, trials in ((ok_rule, True, 4000), (biased_rule, False, 1500)):
        counts = np.zeros(V**3)
        for _ in range(trials):
            a, b, c = _generate(rule, table, rng, gen, 3)
            counts[a * 9 + b * 3 + c] += 1
        p = chi_square_pvalue(counts, exact * trials)
        assert (p > 1e-3) if should_pass else (p < 1e-6), (rule.__name__, p)


def test_membership_greedy_equals_plain_greedy_and_literal_walk():
    table = _toy_target(1)
    plain = [0, 1]
    for _ in range(30):
        plain.append(int(torch.argmax(table[plain[-2], plain[-1]])))
    rng = np.random.default_rng(2)
    ctx, forwards = [0, 1], 0
    while len(ctx) < 32:
        tokens, parents = _random_tree(rng)
        if rng.random() < 0.5:  # half the time, put the true greedy continuation in the tree
            tokens, parents = tokens + plain[len(ctx) : len(ctx) + 3], parents + [-1, len(tokens), len(tokens) + 1]
            tokens, parents = tokens[: len(parents)], parents[: len(tokens)]
        probs = _probs_for_tree(table, ctx, tokens, parents)
        res = membership_accept(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), probs, greedy=True)
        assert len(res.tokens) == len(res.accepted_nodes) + 1
        ctx += res.tokens
        forwards += 1
    assert ctx[:32] == plain[:32] and forwards < 30  # some drafts were accepted
    # literal: root -> 4 accepted (node 1), then 6 accepted (node 3), then 9 is the bonus
    choose = {-1: 4, 1: 6, 3: 9}
    res = membership_walk([5, 4, 6, 6], [-1, -1, 0, 1], choose.__getitem__)
    assert res.accepted_nodes == [1, 3] and res.tokens == [4, 6, 9]
    with pytest.raises(ValueError, match="parents"):
        membership_accept(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"\[n \+ 1, v\]"):
        membership_accept(torch.tensor([1]), torch.tensor([-1]), torch.ones(1, 4))


# ---------------------------------------------------------------------------------------------
# simulation
# ---------------------------------------------------------------------------------------------
def test_simulate_greedy_reconstructs_continuations_and_counts():
    rng = np.random.default_rng(3)
    seqs = []
    for _ in range(7):
        motif = rng.integers(0, 50, 6).tolist()
        full = motif * 8 + rng.integers(0, 50, 5).tolist()
        seqs.append((full[:9], full[9:]))
    d = SSSDDrafter(SSSDConfig(node_budget=8, use_datastore=False))
    res = simulate_greedy(d, seqs, batch_size=3)
    total = sum(len(c) for _, c in seqs)
    assert res.emitted == total and sum(res.accept_hist) == res.steps
    assert sum((k + 1) * h for k, h in enumerate(res.accept_hist)) == total
    assert res.tau == pytest.approx(total / res.steps) and res.tau > 3  # repeated motifs are found in the input
    # an independent reference: longest tree path equal to the continuation, found by listing every path
    ref_steps, ref_hist = 0, [0] * len(res.accept_hist)
    for ctx, cont in seqs:
        state, p = d.new_state(ctx), 0
        while p < len(cont):
            tree = d.draft(state)
            paths = []
            for tok, par in zip(tree.tokens.tolist(), tree.parents.tolist()):
                paths.append((paths[par] if par >= 0 else []) + [tok])
            k = max([len(q) for q in paths if q == cont[p : p + len(q)]], default=0)
            take = min(k + 1, len(cont) - p)
            state.append(cont[p : p + take])
            p += take
            ref_steps += 1
            ref_hist[take - 1] += 1
    assert (res.steps, res.accept_hist) == (ref_steps, ref_hist)
    # with an empty tree every step emits exactly one token
    none = simulate_greedy(SSSDDrafter(SSSDConfig(node_budget=0, use_datastore=False)), seqs)
    assert none.tau == 1.0 and none.steps == total


# ---------------------------------------------------------------------------------------------
# planner
# ---------------------------------------------------------------------------------------------
def _roofline(b: int, s: int) -> float:
    """Forward seconds: flat while b * s <= 64 tokens (memory-bound), then 1 ms per extra token."""
    return 0.010 + 0.001 * max(0, b * s - 64)


def _tau(n: int) -> float:
    return 1 + 2.5 * (1 - math.exp(-n / 10))


def test_planner_picks_the_argmax_of_a_synthetic_curve():
    grid = [1, 2, 4, 8, 16, 32, 64]  # includes every kink b * s = 64 of the batch sizes below
    table = {(b, s): _roofline(b, s) for b in (1, 4, 16) for s in grid}
    for b in (1, 4, 16):
        plan = plan_speculation_length(table, _tau, b, sizes=range(64))
        exact = {n: b * _tau(n) / _roofline(b, n + 1) for n in range(64)}
        assert plan.best_size == max(exact, key=exact.get)
        for n in (0, 5, 17, 63):
            assert plan.tokens_per_s[n] == pytest.approx(exact[n]) and plan.forward_seconds[n] == pytest.approx(_roofline(b, n + 1))
        assert plan.speedup == pytest.approx(exact[plan.best_size] / exact[0])
    assert plan_speculation_length(table, _tau, 1, sizes=range(64)).best_size == 63  # free until 64 tokens
    assert plan_speculation_length(table, _tau, 16, sizes=range(64)).best_size == 3  # b * (n + 1) = 64


def test_planner_with_a_measured_tau_table_ties_and_errors():
    table = {(2, 1): 1.0, (2, 5): 1.0, (2, 9): 2.0}
    tau = {4: 1.5, 8: 3.0, 20: 9.0}  # 20 + 1 lies outside the measured range: skipped
    plan = plan_speculation_length(table, tau, 2)
    assert plan.tokens_per_s == {0: 2.0, 4: 3.0, 8: 3.0}
    assert plan.best_size == 4  # tie -> the smaller tree
    with pytest.raises(ValueError, match="batch size 3"):
        plan_speculation_length(table, tau, 3)
    with pytest.raises(ValueError, match="s = 1"):
        plan_speculation_length({(2, 4): 1.0}, tau, 2)


def test_sssd_settings_have_one_home():
    """SSSDConfig holds the drafting defaults, SSSDEvalConfig (the one evaluation section: sssd.* and
    trainer.spec_eval.sssd.*) equals them, the hybrid proposer's node count is the verifier's own and the
    section's default; the YAML files are held equal here."""
    import dataclasses
    import inspect
    from pathlib import Path

    import yaml

    from drafttrain.config import SSSDEvalConfig
    from drafttrain.eval.in_training import drafter_eval
    from drafttrain.verify.hybrid import DEFAULT_EXTRA_NODES, HybridProposer
    from drafttrain.verify.methods.sssd import SSSDConfig, drafting_config
    from drafttrain.verify.proposers import proposer_for

    assert drafting_config(SSSDEvalConfig()) == SSSDConfig()
    conf = Path(__file__).resolve().parents[2] / "conf"
    evaluate = yaml.safe_load((conf / "evaluate.yaml").read_text())["sssd"]
    assert evaluate == dataclasses.asdict(SSSDEvalConfig())
    grid = yaml.safe_load((conf / "sssd_grid.yaml").read_text())["sssd"]
    assert grid and grid == {k: v for k, v in dataclasses.asdict(SSSDConfig()).items() if k in grid}
    trainer = yaml.safe_load((conf / "trainer" / "default.yaml").read_text())["spec_eval"]["sssd"]
    assert trainer == dataclasses.asdict(SSSDEvalConfig())
    assert SSSDEvalConfig.nodes == DEFAULT_EXTRA_NODES
    assert inspect.signature(HybridProposer).parameters["extra_nodes"].default == DEFAULT_EXTRA_NODES
    assert inspect.signature(proposer_for).parameters["sssd_nodes"].default == DEFAULT_EXTRA_NODES
    assert inspect.signature(drafter_eval).parameters["sssd_nodes"].default == DEFAULT_EXTRA_NODES
