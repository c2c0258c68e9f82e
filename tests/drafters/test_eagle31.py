"""EAGLE-3.1: the EAGLE-3 network with ``fc_norm`` (one RMSNorm per target layer before fc) and ``norm_output``
(the next drafting step reads norm(h)), as vLLM 0.32's ``llama_eagle3`` computes them.

Why: a variant whose training pass and inference drafting disagree (norm applied twice, or fed back pre-norm
in one and post-norm in the other) trains a drafter the engines then run differently, silently.
"""

from __future__ import annotations

import pytest
import torch

from test_eagle3 import D, K, NEW, _engine_prompts, batch_for, make, make_parallel, rollout, vocab_with_target_argmax

VARIANTS = [{"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}]


def _randomised(dr):
    with torch.no_grad():  # every weight random, norms away from 1 (a norm applied twice then shows)
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return dr.eval()


@pytest.mark.parametrize("flags", VARIANTS, ids=lambda f: "+".join(f))
def test_ttt_steps_equal_autoregressive_rollout(tiny_target, flags):
    """The training-time test's step k at row j equals inference drafting from item j (the TTT invariant),
    with the variant's norms in both."""
    dr = _randomised(make(tiny_target, draft_vocab_size=300, **flags))
    batch = batch_for(tiny_target, dr)
    vocab_with_target_argmax(dr, batch, tiny_target)
    ids, feats, lengths = batch["input_ids"], batch["features"], batch["lengths"]
    with torch.no_grad():
        hs = dr.ttt_hidden(ids, feats)
        checked = 0
        for i in range(ids.shape[0]):
            t = int(lengths[i]) - 1
            for j in range(0, t, 3):
                steps = min(K, t - j)
                ref = rollout(dr, ids[i], feats[i], j, [int(ids[i, j + k + 1]) for k in range(1, steps)])
                for k in range(steps):
                    torch.testing.assert_close(dr.vocab_logits(hs[k][i, j]), ref[k], atol=1e-5, rtol=0)
                    checked += 1
    assert checked >= 10


def test_each_flag_changes_the_network(tiny_target):
    """The flags compute something: fc_norm adds trained norms (fc_norm.{i}.weight) that change g; norm_output
    changes what step 2 reads (same weights, other chain logits)."""
    base = _randomised(make(tiny_target, draft_vocab_size=0))
    with_norm = make(tiny_target, draft_vocab_size=0, fc_norm=True)
    assert sorted(n for n in with_norm.state_dict() if n.startswith("fc_norm.")) == [f"fc_norm.{i}.weight" for i in range(3)]
    assert with_norm.serving_tensor_names()[:4] == ["fc.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    out = make(tiny_target, draft_vocab_size=0, norm_output=True)
    out.load_state_dict(base.state_dict())
    out.eval()
    g = torch.Generator().manual_seed(0)
    d = tiny_target.config.hidden_size
    ids = torch.randint(0, 1000, (1, 4), generator=g)
    feats = torch.randn(1, 4, len(base.feature_layer_ids) * d, generator=g)
    from transformers import DynamicCache

    with torch.no_grad():
        a, b = base.propose(ids, feats, DynamicCache()), out.propose(ids, feats, DynamicCache())
    torch.testing.assert_close(a[:, 0], b[:, 0])  # the first draft reads the target's features in both
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-3  # later drafts read h vs norm(h)
    assert base.serving_flags() == {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    assert out.serving_flags()["norm_output"] and with_norm.serving_flags()["fc_norm"]


def test_training_step_reaches_the_fc_norms(tiny_target):
    dr = make(tiny_target, draft_vocab_size=0, fc_norm=True, norm_output=True)
    batch = batch_for(tiny_target, dr)
    dr.train()
    dr(batch).loss.backward()
    for i in range(3):
        grad = dr.fc_norm[i].weight.grad
        assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("flags", VARIANTS[2:], ids=lambda f: "+".join(f))
def test_engine_greedy_equals_plain(tiny_target, flags):
    from drafttrain.verify import PlainProposer, SpecEngine, proposer_for

    prompts = _engine_prompts()
    e = make(tiny_target, draft_vocab_size=0, init_from_target_layer=True, **flags).eval()
    p = make_parallel(tiny_target, draft_vocab_size=0, init_from_target_layer=True, **flags).eval()
    ref = SpecEngine(tiny_target, PlainProposer(), batch_size=3, max_new_tokens=NEW, stop_token_ids=[-1]).run(prompts)
    want = [r.tokens for r in ref.results]
    for name, prop in {"chain": proposer_for(e), "tree": proposer_for(e, widths=[3, 2, 1], budget=7),
                       "parallel": proposer_for(p)}.items():  # fmt: skip
        run = SpecEngine(tiny_target, prop, batch_size=3, max_new_tokens=NEW, stop_token_ids=[-1]).run(prompts)
        assert [r.tokens for r in run.results] == want, name
    assert D >= 1
