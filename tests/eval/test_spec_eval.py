"""Tests of drafttrain.eval.spec: greedy chain speculative decoding is lossless and counts τ right (< 30 s).

Two targets: the tiny random target as loaded (its greedy output repeats one token, so it cannot
catch an off-by-one in the token bookkeeping) and a "varied" copy whose 2-D weights are redrawn with
std 0.3, whose greedy continuations change at every step.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.drafters.base import DrafterSpec
from drafttrain.eval.driver import plain_greedy
from reference_decoding import evaluate_prompts, speculative_greedy

K = 3
PROMPT_LENGTHS = (3, 11, 30)


@pytest.fixture(scope="module", params=["tiny", "varied"])
def target(request, tiny_target, varied_target):
    return tiny_target if request.param == "tiny" else varied_target


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def random_drafter(make_drafter):
    return make_drafter(seed=0).eval()


class OracleDrafter:
    """Knows the target's greedy continuation of each prompt and drafts from it (no model).

    ``correct(step)`` says how many leading drafts of a step are right (the rest are true token + 1, so
    surely wrong). It also checks the items it is given: next_ids must be x_{N-n+1..N} and the features
    the target's f_{N-n..N-1} of the true sequence, N = items seen so far in this prompt.
    It declares itself (``spec``, ``feature_layers``, ``draft_depth``) as a drafter of the library does.
    """

    spec = DrafterSpec(drafting="parallel")  # reads the final post-norm state of every new item
    feature_layers = (-1,)
    draft_depth = K + 1

    def eval(self):
        return self

    def __init__(self, target: Target, prompts: list[list[int]], horizon: int, correct=lambda step: K + 1):
        self.vocab = target.config.vocab_size
        self.correct = correct
        self.seqs = []
        for p in prompts:
            full = target.generate_greedy([p], horizon + K + 2, stop_token_id=-1, return_features=False)[0]["tokens"]
            feats = target.features(torch.tensor([full]))[0]  # [len, d]
            self.seqs.append((full, feats))
        self._cache = None
        self.chosen: list[int] = []

    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        n = next_ids.shape[1]
        if cache is not self._cache:  # a new prompt: find it from its items x_1..x_n
            self._cache, self.n_items, self.step = cache, 0, 0
            match = [s for s in self.seqs if s[0][1 : n + 1] == next_ids[0].tolist()]
            assert match, "first items are not prompt[1:] + first token"
            self.full, self.feats = match[0]
        lo, self.n_items = self.n_items, self.n_items + n
        N = self.n_items
        assert next_ids[0].tolist() == self.full[lo + 1 : N + 1], "items carry the wrong tokens"
        torch.testing.assert_close(features[0].float(), self.feats[lo:N].float(), atol=1e-4, rtol=1e-4)
        r = self.correct(self.step)
        self.chosen.append(r)
        self.step += 1
        true = self.full[N + 1 : N + K + 2]  # x_{N+1} .. x_{N+K+1}
        draft = [tok if j < r else (tok + 1) % self.vocab for j, tok in enumerate(true)]
        logits = torch.full((1, K + 1, self.vocab), -10.0)
        logits[0, torch.arange(K + 1), torch.tensor(draft)] = 10.0  # one-hot
        return logits


# ---------------------------------------------------------------- losslessness


def test_speculative_equals_plain_greedy_and_hf_generate(target, random_drafter, prompts):
    """Greedy acceptance must make speculative decoding output exactly the target's greedy output."""
    for p in prompts:
        ref, _ = plain_greedy(target, p, 40)
        assert len(ref) == 40 or ref[-1] == target.eos_token_id
        r = speculative_greedy(target, random_drafter, p, 40)
        assert r.tokens == ref, f"prompt length {len(p)}"
        ids = torch.tensor([p])
        hf = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
            eos_token_id=target.eos_token_id, pad_token_id=target.eos_token_id,
        )[0, len(p):].tolist()  # fmt: skip
        assert hf == ref, f"prompt length {len(p)}"
        assert r.target_forwards == len(r.accept_lengths) >= 1
        # every token after the prefill's first comes from a verification step (stop/cap truncate)
        assert r.emitted == len(r.tokens) - 1 <= sum(m + 1 for m in r.accept_lengths)


def test_oracle_drafter_accepts_everything(varied_target, prompts):
    """A drafter that is always right gets all K + 1 drafts + the bonus token accepted at every step
    (τ = K + 2): the acceptance rule is not too strict. The oracle also checks the (token, feature)
    items the loop hands the drafter after every verification step."""
    oracle = OracleDrafter(varied_target, prompts, horizon=60)
    for p in prompts:
        ref, _ = plain_greedy(varied_target, p, 60)
        r = speculative_greedy(varied_target, oracle, p, 60)
        assert r.tokens == ref
        assert r.accept_lengths == [K + 1] * r.target_forwards
        assert r.emitted / r.target_forwards > K + 1.5
        assert r.target_forwards == -(-(60 - 1) // (K + 2))  # ceil(59 / 5) = 12 steps after the prefill


def test_wrong_drafter_accepts_nothing(varied_target, prompts):
    """A drafter that is always wrong gets nothing accepted (τ = 1, one bonus token per step): the rule
    is not too lenient, and the output is still plain greedy."""
    wrong = OracleDrafter(varied_target, prompts, horizon=40, correct=lambda step: 0)
    for p in prompts:
        ref, _ = plain_greedy(varied_target, p, 40)
        r = speculative_greedy(varied_target, wrong, p, 40)
        assert r.tokens == ref
        assert r.emitted / r.target_forwards == 1.0
        assert set(r.accept_lengths) == {0} and r.target_forwards == 39


def test_partially_right_drafter_accepts_its_correct_prefix(varied_target, prompts):
    """Steps whose first r drafts are right (r cycling 0..K+1) accept exactly r: every accept length,
    and so every cache crop, is exercised, and the output stays plain greedy."""
    cycle = [2, 0, 4, 1, 3, 4, 0, 2]
    drafter = OracleDrafter(varied_target, prompts, horizon=60, correct=lambda step: cycle[step % len(cycle)])
    for p in prompts:
        ref, _ = plain_greedy(varied_target, p, 60)
        start = len(drafter.chosen)
        r = speculative_greedy(varied_target, drafter, p, 60)
        assert r.tokens == ref
        assert r.accept_lengths == drafter.chosen[start:]
        assert set(r.accept_lengths) == {0, 1, 2, 3, 4}


def test_stop_token_ends_output(varied_target, random_drafter, prompts):
    """A stop token in the continuation ends the output right after it, as in plain greedy."""
    p = prompts[1]
    cont, _ = plain_greedy(varied_target, p, 40, stop=-1)
    stop = cont[17]
    ref, _ = plain_greedy(varied_target, p, 40, stop=stop)
    assert ref[-1] == stop and len(ref) == cont.index(stop) + 1
    assert speculative_greedy(varied_target, random_drafter, p, 40, stop=stop).tokens == ref
    oracle = OracleDrafter(varied_target, [p], horizon=40)
    assert speculative_greedy(varied_target, oracle, p, 40, stop=stop).tokens == ref


def test_stop_inside_accepted_drafts_ends_decoding(varied_target, prompts):
    """Regression: a stop token accepted as a non-final draft was missed and decoding (and τ's counts)
    went on to max_new_tokens. With an oracle drafter and the stop token at generated index 2 (inside the first step's accepted
    drafts), decoding must end after that first verification step."""
    p = prompts[1]
    cont, _ = plain_greedy(varied_target, p, 40, stop=-1)
    stop = cont[2]
    assert stop not in cont[:2]
    oracle = OracleDrafter(varied_target, [p], horizon=40)
    r = speculative_greedy(varied_target, oracle, p, 40, stop=stop)
    assert r.tokens == cont[:3]
    assert r.target_forwards == 1


# ---------------------------------------------------------------- evaluate_prompts


def test_evaluate_prompts(varied_target, random_drafter, prompts):
    """The in-training evaluation: greedy_equal holds and the accept histogram has one entry per
    verification step."""
    steps = sum(speculative_greedy(varied_target, random_drafter, p, 24).target_forwards for p in prompts)
    out = evaluate_prompts(varied_target, random_drafter, prompts, 24, progress=False)
    assert out["greedy_equal"] is True and out["mismatches"] == []
    assert sum(out["accept_hist"].values()) == steps
    assert out["num_prompts"] == 3 and out["generated_tokens"] == 3 * 24
    # τ counts tokens from verification steps: all but each prompt's first (prefill) token
    assert out["tau"] == pytest.approx((out["generated_tokens"] - 3) / steps)

    oracle = OracleDrafter(varied_target, prompts, horizon=24)
    out = evaluate_prompts(varied_target, oracle, prompts, 24, progress=False)
    assert out["greedy_equal"] is True
    # 23 verified tokens per prompt in steps of K + 2 = 5: four full steps + one capped at 3
    assert list(out["accept_hist"]) == [K + 1] and out["tau"] == pytest.approx(23 / 5)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_batched_evaluation_matches_single_sequence(varied_target, random_drafter, prompts, batch_size):
    """The in-training evaluation through the batched verifier (trainer.spec_eval.batch_size) takes the
    same chain steps as the one-sequence-at-a-time reference: same outputs, τ and accept histogram."""
    from drafttrain.eval.in_training import drafter_eval

    ref = evaluate_prompts(varied_target, random_drafter, prompts, 24, progress=False)
    out = drafter_eval(varied_target, random_drafter, prompts, 24, batch_size=batch_size, progress=False)
    assert out["greedy_equal"] is True and out["batch_size"] == batch_size
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in ref["outputs"]]
    assert out["accept_hist"] == ref["accept_hist"]
    assert out["tau"] == pytest.approx(ref["tau"])
    assert out["generated_tokens"] == ref["generated_tokens"] == 3 * 24


def test_batched_evaluation_with_a_tree_stays_lossless(varied_target, random_drafter, prompts):
    """A draft tree (top-3 at depth 1) in the final evaluation: output still equals plain greedy, the chain
    numbers come along (also_chain) and equal the single-sequence chain evaluation, and the tree is
    verified at its full size (more nodes per step than the chain's K + 1)."""
    from drafttrain.eval.in_training import drafter_eval

    out = drafter_eval(varied_target, random_drafter, prompts, 24, batch_size=3, progress=False,
                                   tree_widths=[3, 1, 1, 1], tree_budget=6, also_chain=True)  # fmt: skip
    ref = evaluate_prompts(varied_target, random_drafter, prompts, 24, progress=False)
    assert out["greedy_equal"] is True
    assert out["tau_chain"] == pytest.approx(ref["tau"]) and out["accept_hist_chain"] == ref["accept_hist"]
    assert out["tree_nodes_per_step"] > K + 1 - 1e-9
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in ref["outputs"]]


def test_a_static_tree_shape_and_unbatched_drafting_in_the_training_evaluation(varied_target, random_drafter, prompts):
    """tree.choices (a static shape) and tree.batched_drafting=false, the keys once read by scripts.evaluate only,
    shape the training evaluation's tree too: lossless, the shape's nodes verified, and drafting one sequence at a
    time gives the batched drafting's outputs and τ."""
    from drafttrain.eval.in_training import drafter_eval

    choices = [[0], [1], [0, 0], [0, 0, 0]]  # 4 nodes: two candidates at depth 1, a chain below the first
    kw = dict(batch_size=3, progress=False, tree_choices=choices)
    batched = drafter_eval(varied_target, random_drafter, prompts, 24, **kw)
    one = drafter_eval(varied_target, random_drafter, prompts, 24, batched=False, **kw)
    ref = evaluate_prompts(varied_target, random_drafter, prompts, 24, progress=False)
    assert batched["greedy_equal"] and one["greedy_equal"]
    assert [o["tokens"] for o in batched["outputs"]] == [o["tokens"] for o in ref["outputs"]]
    assert one["tau"] == pytest.approx(batched["tau"]) and one["accept_hist"] == batched["accept_hist"]
    assert 1.0 < batched["tree_nodes_per_step"] <= len(choices) + 1e-9


def test_latency_subset_spreads_over_the_prompt_list():
    """The batch-1 latency prompts are spread evenly: with the main job's 16 MT-bench prompts (2 per category,
    in category order) 8 of them are one per category, not the first 4 categories twice."""
    from drafttrain.eval.in_training import latency_subset

    items = list(range(16))
    assert latency_subset(items, 8) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [i // 2 for i in latency_subset(items, 8)] == list(range(8))  # one per category
    assert latency_subset(items, 4) == [0, 4, 8, 12]
    assert latency_subset(items, 3) == [0, 5, 10]
    assert latency_subset(items, 16) == items and latency_subset(items, 40) == items
    assert latency_subset(items, 0) == []
    assert latency_subset(["a", "b", "c"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="k must be >= 0"):
        latency_subset(items, -1)


def test_drafter_alone_is_the_chain_without_sssd(varied_target, random_drafter, prompts):
    """also_alone: the drafter alone (its chain, no SSSD) decodes the prompts like the one-sequence chain
    reference, whether the main run is a tree (its own run) or already that chain (no extra run)."""
    from drafttrain.eval.in_training import drafter_eval

    ref = evaluate_prompts(varied_target, random_drafter, prompts, 24, progress=False)
    tree = drafter_eval(varied_target, random_drafter, prompts, 24, batch_size=3, progress=False,
                                    tree_widths=[3, 1, 1, 1], tree_budget=6, also_alone=True)  # fmt: skip
    assert tree["tau_alone"] == pytest.approx(ref["tau"]) and tree["accept_hist_alone"] == ref["accept_hist"]
    assert tree["greedy_equal"] is True
    chain = drafter_eval(varied_target, random_drafter, prompts, 24, batch_size=3, progress=False,
                                     also_alone=True)  # fmt: skip
    assert chain["tau_alone"] == chain["tau"] == pytest.approx(ref["tau"])
