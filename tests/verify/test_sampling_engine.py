"""Speculative sampling is lossless through the *engine*, not only through the rules.

``tests/verify/test_acceptance.py`` checks the acceptance rules as pure functions. This file checks what a
user gets: the tokens :class:`~drafttrain.verify.engine.SpecEngine` emits, with a real (random)
ParallelSpec drafter proposing chains and trees, at T = 0.7, at T = 1 with top-p 0.9 and at T = 0.7
with top-k 6 then top-p 0.9 (MTAD App. F's warping, k scaled to the toy vocabulary), for every row of a batch, against the exact distribution of plain sampling from the target.

A toy target (a 2-layer Llama with a 16-token vocabulary, weights drawn large enough that its
distributions are far from uniform) makes the exact law of the first three emitted tokens
computable: P(x1, x2, x3) = prod_t process_logits(target(prompt, x_<t))[x_t]. Two prompts of
different lengths alternate in the queue, so the rows of every batch sit at different cache offsets
and each prompt's rows are tested on their own. The statistic is Pearson's chi-square over the
cells with expected count >= 5 (the rest pooled), plus: no token outside the support of the
processed distribution (top-p) may ever be emitted.

Why it exists: replacing the target-side transform of ``accept()`` (``process_logits``) by a plain
softmax passed the whole suite before this test. With that mutation::

    sed -i 's/speculative_sampling_tree(tree, process_logits(target_logits, params)/speculative_sampling_tree(tree, torch.softmax(target_logits.float(), -1)/' drafttrain/verify/acceptance.py

all six cases fail (T = 0.7: chi-square p ~ 1e-10; top-p 0.9: ~37 sequences emit a token outside
the nucleus; top-k 6 + top-p 0.9: 60-67 do). The seeds are fixed, so the test is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain.verify.acceptance import SamplingParams, process_logits
from drafttrain.verify.engine import SpecEngine
from drafttrain.verify.proposers import ParallelSpecProposer

V = 16  # toy vocabulary
NEW = 3  # tokens emitted per sequence: the prefill's first token and two from verification steps
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]
COPIES = 250  # sequences per prompt (the mutation below fails at p < 1e-10 with these)


@pytest.fixture(scope="module")
def toy():
    """(target, drafter): a 16-token toy Llama target and a random ParallelSpec drafter (K = 2) on it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafttrain.drafters import build_drafter
    from drafttrain.target import Target

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # large weights: peaked, context-dependent distributions (norms stay 1)
                p.normal_(0.0, 0.5, generator=g)
    target = Target(model)
    torch.manual_seed(2)
    drafter = build_drafter("parallelspec", {"num_mask_tokens": 2, "init_from_target_layer": False}, target)
    return target, drafter.eval()


def exact_law(target, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V, V] P(x1, x2, x3) of plain sampling from the target after ``prompt``."""
    x = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2] every (x1, x2)
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), x], dim=1)  # [V*V, P + 2]
    logits = target.forward(ids).logits  # [V*V, P + 2, V]
    p = process_logits(logits[:, -3:], params).double()  # [V*V, 3, V]: after prompt, after x1, after x2
    p1 = p[0, 0]  # [V]
    p2 = p[::V, 1]  # [V(x1), V]: row x1 * V holds x = (x1, 0)
    p3 = p[:, 2].reshape(V, V, V)  # [x1, x2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells with expected < 5 pooled)."""
    counts, probs = counts.flatten().double(), probs.flatten()
    n = counts.sum()
    exp = n * probs
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0))), df


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.0, 0.9), SamplingParams(0.7, 0.9, top_k=6)],
                         ids=["T0.7", "T1-topp0.9", "T0.7-topk6-topp0.9"])  # fmt: skip
def test_engine_samples_the_target_distribution(toy, shape, params):
    target, drafter = toy
    if shape == "chain":
        prop, mode = ParallelSpecProposer(drafter), "unpadded"  # K + 1 = 3 drafts, one per depth
    else:
        prop, mode = ParallelSpecProposer(drafter, widths=[3, 2, 2], budget=8), "padded"
    queue = [PROMPTS[i % 2] for i in range(2 * COPIES)]
    run = SpecEngine(target, prop, batch_size=64, max_new_tokens=NEW, mode=mode, sampling=params, seed=11,
                     stop_token_ids=[]).run(queue)  # fmt: skip
    accepted = sum(sum(r.accept_lengths) for r in run.results)
    assert accepted > 0.2 * len(queue), "the drafter's drafts must be accepted often enough to test acceptance"
    if shape == "tree":
        assert run.stats.tree_nodes > run.stats.seq_steps * 3  # really a tree (more nodes than a chain)
    for k, prompt in enumerate(PROMPTS):
        law = exact_law(target, prompt, params)
        counts = torch.zeros(V, V, V)
        for r in run.results:
            if r.index % 2 == k:
                assert len(r.tokens) == NEW
                counts[tuple(r.tokens)] += 1
        outside = int(counts[law == 0].sum())
        assert outside == 0, f"{outside} sequences emitted a token outside the top-k/top-p support"
        p, df = chi_square_p(counts, law)
        assert df >= 5
        assert p > 1e-3, f"prompt {k}: emitted (x1, x2, x3) differ from plain sampling (chi-square p = {p:.2e}, df {df})"
