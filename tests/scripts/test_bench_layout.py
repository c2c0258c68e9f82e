"""The naive K + 1-pass baseline of scripts/bench_layout.py computes exactly the group-wise layout's loss
and gradients, so the step-time ratio it reports compares two ways of computing the same thing (< 15 s)."""

from __future__ import annotations

import pytest
import torch

from drafttrain.drafters import build_drafter
from helpers import make_batch
from scripts.bench_layout import naive_loss


@pytest.mark.parametrize("anchor_ratio, kd, vocab", [(1.0, 0.0, 0), (0.5, 0.5, 2000)])
def test_naive_passes_equal_layout(tiny_target, anchor_ratio, kd, vocab):
    batch = make_batch(tiny_target, lengths=(15, 11, 6), prompt=(3, 2, 1))
    torch.manual_seed(0)
    cfg = {"num_mask_tokens": 3, "anchor_ratio": anchor_ratio, "kd_weight": kd, "draft_vocab_size": vocab,
           "init_from_target_layer": False}  # fmt: skip
    dr = build_drafter("parallelspec", cfg, tiny_target)
    if vocab:
        dr.set_draft_vocab(torch.cat([batch["input_ids"][:, 1:].flatten().unique(), torch.arange(3000, 6000)]).unique()[:vocab])
    dr.train()
    a = dr(batch, torch.Generator().manual_seed(4)).loss
    a.backward()
    grads = {n: p.grad.clone() for n, p in dr.named_parameters()}
    dr.zero_grad()
    b = naive_loss(dr, batch, torch.Generator().manual_seed(4))
    b.backward()
    assert float(b.detach()) == pytest.approx(float(a.detach()), rel=1e-5)
    for n, p in dr.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)
