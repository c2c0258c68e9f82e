"""DFlash (drafttrain/drafters/dflash.py): the block layout against a literal mask and a per-block reference loop,
the training pass against inference drafting, greedy equality through the engine, and the recipe's real CLI.

The literal below was written by hand from the DFlash paper's block attention (bidirectional within a block,
the context up to the anchor, never another block), not printed from the code.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from drafttrain import layout as L
from drafttrain.drafters import build_drafter
from drafttrain.drafters.dflash import default_target_layer_ids
from drafttrain.verify.engine import SpecEngine
from drafttrain.verify.proposers import proposer_for
from helpers import compose_dict, make_batch

IGN = L.IGNORE_INDEX


def test_block_layout_literal():
    """T = 3 items, B = 3 (K = 2 masks after the given token), anchors [0, 1]."""
    labels = torch.tensor([10, 11, 12])  # y_0, y_1, y_2
    lay = L.build_group_layout(labels, torch.tensor([0, 1]), 2, block=True)
    # slots: u0 u1 u2 | b1@0 b2@0 b3@0 | b1@1 b2@1 b3@1
    assert lay.slot_kind.tolist() == [0, 0, 0, 1, 2, 3, 1, 2, 3]
    assert lay.position_ids.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]
    # kind 1 holds x_{a+1} (given); kind j >= 2 is labelled with x_{a+j} = y_{a+j-2}
    assert lay.labels.tolist() == [10, 11, 12, IGN, 10, 11, IGN, 11, 12]
    want = torch.tensor([
        # u0 u1 u2 b1 b2 b3 b1 b2 b3
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # u0
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # u1
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # u2
        [1, 0, 0, 1, 1, 1, 0, 0, 0],  # b1@0: context <= 0, its whole block
        [1, 0, 0, 1, 1, 1, 0, 0, 0],  # b2@0
        [1, 0, 0, 1, 1, 1, 0, 0, 0],  # b3@0
        [1, 1, 0, 0, 0, 0, 1, 1, 1],  # b1@1: context <= 1, its whole block
        [1, 1, 0, 0, 0, 0, 1, 1, 1],  # b2@1
        [1, 1, 0, 0, 0, 0, 1, 1, 1],  # b3@1
    ], dtype=torch.bool)  # fmt: skip
    assert torch.equal(lay.allowed, want)


@pytest.mark.parametrize("seed", range(4))
def test_block_layout_equals_a_per_block_loop(seed):
    """Random sizes: every entry of the block layout from a plain loop over blocks and slots."""
    g = torch.Generator().manual_seed(seed)
    t = int(torch.randint(2, 12, (1,), generator=g))
    bsz = int(torch.randint(2, 6, (1,), generator=g))
    labels = torch.randint(0, 50, (t,), generator=g).masked_fill(torch.rand(t, generator=g) < 0.3, IGN)
    anchors = torch.randperm(t, generator=g)[: max(1, t // 2)].sort().values
    lay = L.build_group_layout(labels, anchors, bsz - 1, block=True)
    slots = [("item", i, 0) for i in range(t)] + [("blk", int(a), j) for a in anchors for j in range(1, bsz + 1)]
    assert lay.num_slots == len(slots)
    for r, (kr, ar, jr) in enumerate(slots):
        pos = ar if kr == "item" else ar + jr
        assert int(lay.position_ids[r]) == pos
        if kr == "item":
            want_label = int(labels[ar])
        else:
            idx = ar + jr - 2
            want_label = IGN if jr == 1 or idx >= t else int(labels[idx])
        assert int(lay.labels[r]) == want_label
        for c, (kc, ac, jc) in enumerate(slots):
            if kr == "item":
                ok = kc == "item" and ac <= ar
            else:
                ok = (kc == "item" and ac <= ar) or (kc == "blk" and ac == ar)
            assert bool(lay.allowed[r, c]) == ok, (r, c)


def test_a_mask_mutation_fails_the_literal():
    """The literal test can fail: a causal block (ParallelSpec's rule) differs from DFlash's."""
    labels = torch.tensor([10, 11, 12])
    causal = L.build_group_layout(labels, torch.tensor([0, 1]), 3, block=False)
    block = L.build_group_layout(labels, torch.tensor([0, 1]), 2, block=True)
    assert causal.num_slots == block.num_slots and not torch.equal(causal.allowed, block.allowed)


def test_default_target_layers():
    assert default_target_layer_ids(30, 3) == (2, 15, 28)
    assert default_target_layer_ids(2, 3) == (1,)
    assert default_target_layer_ids(36, 5) == (2, 10, 18, 26, 34)


@pytest.fixture(scope="module")
def deep():
    import test_families as TF

    return TF.family_target("qwen3", layers=8)


def _drafter(target, **cfg):
    torch.manual_seed(0)
    dr = build_drafter("dflash", {"block_size": 4, "num_layers": 2, "init_from_target_layer": False, **cfg}, target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)  # off the init symmetry
    return dr.eval()


def _batch(target, dr):
    import test_families as TF

    return TF._batch_for(target, dr)


def test_training_pass_equals_inference_per_block(deep):
    """The outputs of every block in the one training pass equal `propose` run on that block's context
    alone (items <= a, then the block): the layout is the inference computation, block by block."""
    dr = _drafter(deep)
    batch = _batch(deep, dr)
    kinds, anchors, lab, h = dr.block_hidden(batch)
    logits = dr.full_vocab_logits(dr.vocab_logits(h))
    bsz = dr.block_size
    checked = 0
    for i in range(batch["input_ids"].shape[0]):
        n = int((kinds[i] > 0).sum()) // bsz
        for blk in range(n):
            a = int(anchors[i, blk * bsz])
            ids = batch["input_ids"][i : i + 1, 1 : a + 2]  # next ids x_1..x_{a+1} of items 0..a
            feats = batch["features"][i : i + 1, : a + 1]
            ref = dr.propose(ids, feats, DynamicCache())  # [1, B - 1, v]
            got = logits[i, blk * bsz + 1 : (blk + 1) * bsz]
            torch.testing.assert_close(got, ref[0], atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked >= 10


def test_incremental_context_cache_equals_one_pass(deep):
    """Items appended over several `propose` calls (the engine's steps) give the same drafts as one call."""
    dr = _drafter(deep)
    batch = _batch(deep, dr)
    ids, feats = batch["input_ids"][:1, 1:10], batch["features"][:1, :9]
    one = dr.propose(ids, feats, DynamicCache())
    cache = DynamicCache()
    dr.propose(ids[:, :4], feats[:, :4], cache)
    dr.propose(ids[:, 4:7], feats[:, 4:7], cache)
    steps = dr.propose(ids[:, 7:], feats[:, 7:], cache)
    torch.testing.assert_close(steps, one, atol=2e-5, rtol=1e-4)


def test_loss_is_the_position_decayed_cross_entropy(deep):
    """Eq. 4 by a loop: per drafted slot k, mean CE over the blocks, weighted exp(-(k-1)/gamma), summed."""
    import math

    dr = _drafter(deep, loss_decay_gamma=2.0)
    batch = _batch(deep, dr)
    out = dr.training_loss(batch)
    kinds, _, lab, h = dr.block_hidden(batch)
    logits = dr.vocab_logits(h)
    total = 0.0
    for k in range(1, dr.block_size):
        sel = (kinds == k + 1) & (lab != IGN)
        ce = torch.nn.functional.cross_entropy(logits[sel], lab[sel])
        total += math.exp(-(k - 1) / 2.0) * float(ce.detach())
    assert abs(float(out.loss) - total) < 1e-4 * max(1.0, total)
    out.loss.backward()
    assert dr.fc.weight.grad is not None and dr.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_engine_greedy_equal(deep, batch_size):
    """DFlash drafts through the engine (B - 1 per pass; a tree from the per-position top-k) and every
    output equals the target's plain greedy decoding, at batch 1, 3 and 16, unpadded."""
    import test_families as TF

    dr = _drafter(deep, block_size=5)
    prompts = TF._prompts(deep, 5)
    for widths in (None, [2, 2, 1]):
        run = SpecEngine(deep, proposer_for(dr, widths=widths), batch_size=batch_size, max_new_tokens=12,
                         mode="unpadded", stop_token_ids=[]).run(prompts)  # fmt: skip
        plain = deep.generate(prompts, 12, stop_token_ids=[], return_features=False)
        assert [r.tokens for r in run.results] == [p["tokens"][len(q):] for p, q in zip(plain, prompts)]


def test_a_trained_dflash_drafter_gets_drafts_accepted(tiny_target):
    """Trained for a few dozen steps on the tiny target's own greedy output (it repeats one token), DFlash's
    drafts are accepted by the engine: the drafted positions are the ones verification checks."""
    from drafttrain.eval.driver import plain_greedy
    from reference_decoding import speculative_greedy

    torch.manual_seed(0)
    dr = build_drafter("dflash", {"block_size": 4, "num_layers": 1, "init_from_target_layer": False}, tiny_target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, tiny_target.config.vocab_size, (5,), generator=g).tolist() for _ in range(4)]
    rows = [plain_greedy(tiny_target, p, 20)[0] for p in prompts]
    ids = torch.tensor([p + r for p, r in zip(prompts, rows)])
    lengths = torch.full((ids.shape[0],), ids.shape[1])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    feats = tiny_target.forward(ids, with_logits=False, feature_layers=dr.feature_layers).features[:, :-1]
    batch = {"input_ids": ids, "loss_mask": loss_mask, "lengths": lengths, "features": feats}
    opt = torch.optim.Adam([p for p in dr.parameters() if p.requires_grad], lr=3e-3)
    dr.train()
    for _ in range(40):
        opt.zero_grad()
        dr.training_loss(batch, torch.Generator().manual_seed(0)).loss.backward()
        opt.step()
    dr.eval()
    r = speculative_greedy(tiny_target, dr, prompts[0], 20)
    assert r.tokens == rows[0] and sum(r.accept_lengths) > 0


@pytest.mark.slow
def test_dflash_recipe_train_run(tmp_path):
    """`+recipe=dflash target=tiny trainer.max_steps=3`: trains, checkpoints, evaluates greedy-equal."""
    from drafttrain import train as T

    metrics = T.run(compose_dict("train", ["+recipe=dflash", "target=tiny", "trainer.max_steps=3",
                                           "trainer.progress=false", "trainer.num_threads=1", "logging.wandb=false",
                                           "trainer.mixed_precision=no", f"output_dir={tmp_path}",
                                           f"data.cache_dir={tmp_path / 'data'}"]))  # fmt: skip
    assert metrics["step"] == 3 and metrics["eval/greedy_equal"] is True
    assert (tmp_path / "drafter" / "drafter.safetensors").is_file()
