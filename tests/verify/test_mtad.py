"""Tests of drafttrain.verify.methods.mtad: beam drafting vs brute force, joint-likelihood acceptance (longest
passing prefix, tau = 0 / tau >= 1, equality), bonus token, perplexity vs a step-by-step reference (< 5 s)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from drafttrain.verify.methods.mtad import (
    IS_LOSSLESS,
    beam_draft,
    gather_log_probs,
    mtad_accept,
    mtad_accept_length,
    output_log_probs,
    output_perplexity,
    passing_prefixes,
    perplexity,
)

V = 5


def markov_step(seed: int = 0, start: int = 0):
    """Toy drafter: log q(x | prefix) = table[last token] (start token before the first draft)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.log_softmax(torch.randn(V, V, generator=g) * 2, dim=-1)

    def step(prefixes: torch.Tensor) -> torch.Tensor:
        last = prefixes[:, -1] if prefixes.shape[1] else torch.full((prefixes.shape[0],), start)
        return table[last]

    def joint(seq) -> float:
        prev, total = start, 0.0
        for x in seq:
            total += float(table[prev, x])
            prev = x
        return total

    return step, joint


def test_deterministic_beam_search_is_exact_with_enough_beams_and_greedy_with_one():
    step, joint = markov_step()
    k = 3
    best = max(itertools.product(range(V), repeat=k), key=joint)
    draft = beam_draft(step, num_beams=V ** (k - 1), num_steps=k, sample=False)  # keeps every prefix
    assert tuple(draft.tokens.tolist()) == best
    assert draft.joint_log_q[-1].item() == pytest.approx(joint(best), abs=1e-5)
    assert draft.parents.tolist() == [-1, 0, 1] and not draft.is_lossless and IS_LOSSLESS is False
    # per-token draft log-probs are the drafter's conditionals along the chosen beam
    assert draft.draft_log_probs.tolist() == pytest.approx([joint(best[:1]), joint(best[:2]) - joint(best[:1]), joint(best) - joint(best[:2])], abs=1e-5)
    greedy = beam_draft(step, num_beams=1, num_steps=k, sample=False)
    seq = []
    for _ in range(k):
        seq.append(int(step(torch.tensor([seq], dtype=torch.long).reshape(1, len(seq))).argmax()))
    assert greedy.tokens.tolist() == seq


def test_beam_sampling_keeps_distinct_beams_with_their_joint_likelihoods():
    step, joint = markov_step(1)
    g = torch.Generator().manual_seed(0)
    draft = beam_draft(step, num_beams=4, num_steps=4, sample=True, generator=g)
    beams = [tuple(b) for b in draft.beams.tolist()]
    assert len(beams) == 4 and len(set(beams)) == 4
    for b, lp in zip(beams, draft.beam_log_probs.tolist()):
        assert lp == pytest.approx(joint(b), abs=1e-5)
    assert draft.beam_log_probs.tolist() == sorted(draft.beam_log_probs.tolist(), reverse=True)
    assert tuple(draft.tokens.tolist()) == beams[0]
    # first step: B = 8 > v candidates available -> only v beams
    assert beam_draft(step, num_beams=8, num_steps=1, sample=True, generator=g).beams.shape == (V, 1)
    with pytest.raises(ValueError, match="num_beams"):
        beam_draft(step, 0, 2)


def test_beam_sampling_follows_joint_likelihood_at_one_beam():
    """With B = 1 and K = 1, Eq. 2 is plain sampling from q: frequencies match q."""
    step, _ = markov_step(2)
    q = step(torch.zeros(1, 0, dtype=torch.long))[0].exp()
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(2000):
        counts[beam_draft(step, 1, 1, sample=True, generator=g).tokens[0]] += 1
    assert torch.allclose(counts / 2000, q, atol=0.035)  # ~3 standard deviations at p = 0.5


def lp(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs], dtype=torch.float64)


def test_longer_passing_prefix_is_accepted_after_a_failing_shorter_one():
    # per-token ratios p/q: 0.2, 4.0, 0.1 -> joint ratios P_i/Q_i: 0.2, 0.8, 0.08
    target = lp(0.1, 0.8, 0.05)
    draft = lp(0.5, 0.2, 0.5)
    assert passing_prefixes(target, draft, 0.5).tolist() == [False, True, False]
    assert mtad_accept_length(target, draft, 0.5).item() == 2
    assert mtad_accept_length(target, draft, 0.9).item() == 0
    assert mtad_accept_length(target, draft, 0.05).item() == 3
    # batched, with a leading batch axis
    both = mtad_accept_length(torch.stack([target, draft]), torch.stack([draft, target]), 0.5)
    assert both.tolist() == [2, 3]  # second row: ratios 5, 1.25, 12.5 -> min(1, .) = 1 everywhere


def test_tau_zero_accepts_everything_and_tau_one_or_more_nothing():
    target = lp(1e-9, 0.0, 0.3)  # the target even gives the second draft probability 0
    draft = lp(0.9, 0.9, 0.9)
    assert mtad_accept_length(target, draft, 0.0).item() == 3
    good = lp(0.9, 0.9, 0.9)  # P_i >= Q_i: ratio 1, still rejected at tau >= 1 (§5.2.2)
    for tau in (1.0, 1.5, 10.0):
        assert mtad_accept_length(good, draft, tau).item() == 0
    assert mtad_accept_length(good, draft, 0.999).item() == 3
    # equality passes for tau < 1: min(1, P/Q) = 0.5 exactly
    assert passing_prefixes(lp(0.25), lp(0.5), 0.5).tolist() == [True]
    assert passing_prefixes(lp(0.25), lp(0.5), 0.5000001).tolist() == [False]
    # 0/0 is ratio 0 (fails for tau > 0); P > 0 with Q = 0 is ratio +inf (passes)
    assert passing_prefixes(lp(0.0), lp(0.0), 0.1).tolist() == [False]
    assert passing_prefixes(lp(0.3), lp(0.0), 0.9).tolist() == [True]
    with pytest.raises(ValueError, match="tau"):
        passing_prefixes(good, draft, -0.1)
    with pytest.raises(ValueError, match="shapes"):
        passing_prefixes(good, draft[:2], 0.5)


def test_mtad_accept_bonus_token_row():
    k = 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, k + 1, V, generator=g)
    drafts = logits[:, :-1].argmax(-1)  # the target's favourite tokens
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # sequence 1's first draft is worse
    draft_lp = torch.full((2, k), math.log(0.999))  # a confident drafter
    accepted, bonus = mtad_accept(logits, drafts, draft_lp, tau=0.0, greedy=True)
    assert accepted.tolist() == [3, 3] and bonus.tolist() == logits[:, 3].argmax(-1).tolist()
    accepted, bonus = mtad_accept(logits, drafts, draft_lp, tau=1.0, greedy=True)
    assert accepted.tolist() == [0, 0] and bonus.tolist() == logits[:, 0].argmax(-1).tolist()
    # at a middle tau: the expected lengths from an independent computation
    tlp = gather_log_probs(logits[:, :-1], drafts)
    expected = []
    for row in range(2):
        ok = [min(0.0, float(tlp[row, :i].sum() - draft_lp[row, :i].sum())) >= math.log(0.3) for i in range(1, k + 1)]
        expected.append(max([i + 1 for i, o in enumerate(ok) if o], default=0))
    accepted, _ = mtad_accept(logits, drafts, draft_lp, tau=0.3, greedy=True)
    assert accepted.tolist() == expected
    one_hot = torch.full((1, 2, V), -1e9)
    one_hot[0, 1, 4] = 0.0
    _, sampled = mtad_accept(one_hot, torch.tensor([[2]]), torch.tensor([[0.0]]), tau=0.0, generator=g)
    assert sampled.tolist() == [4]  # sampled from row `accepted` = 1


def test_perplexity_matches_step_by_step_target(tiny_target):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (6,), generator=g).tolist()
    output = torch.randint(3, 1000, (5,), generator=g).tolist()
    got = output_log_probs(tiny_target, prompt, output)
    ref = []
    for j in range(len(output)):
        ids = torch.tensor([prompt + output[:j]])
        ref.append(torch.log_softmax(tiny_target.forward(ids).logits[0, -1], -1)[output[j]].item())
    assert got.tolist() == pytest.approx(ref, abs=1e-4)
    assert perplexity(got) == pytest.approx(math.exp(-sum(ref) / len(ref)), rel=1e-4)
    # token-weighted over sequences
    other = output_log_probs(tiny_target, prompt[:3], output[:2])
    assert output_perplexity(tiny_target, [prompt, prompt[:3]], [output, output[:2]]) == pytest.approx(
        math.exp(-(got.sum() + other.sum()).item() / 7), rel=1e-4
    )
    assert perplexity(torch.log(torch.tensor([0.5, 0.5]))) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="zero tokens"):
        perplexity([])
