"""Flex (block-sparse) attention gives the dense masks' results for every training layout.

Why: ``trainer.attention=flex`` masks the group-wise layout (parallelspec, parallelspec_eagle,
parallelspec_eagle3), DFlash's blocks and EAGLE-3's training-time test with flex block masks built from the
same rules as the dense masks (drafttrain/attention.py). These tests hold the two paths equal:

- the block masks' ``mask_mod`` evaluated on the full grid equals the dense allowed matrix (exactly);
- each recipe's training loss on the tiny target, and the output of every attention call it makes, is the
  same under flex and dense (atol 1e-5, fp32);
- a flex mask with one entry flipped fails that comparison (the comparison can see a wrong mask).

On CPU flex attention has no backward (PyTorch raises NotImplementedError), so the losses are compared
under ``torch.no_grad``; the gradient comparison is a ``cuda`` test (run by scripts/device_check.sh).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_batch

from drafttrain import attention as A
from drafttrain import layout as L

RECIPES = {  # recipe -> small config (fresh init so the layer is not the target's)
    "parallelspec": {"num_mask_tokens": 3, "init_from_target_layer": False},
    "parallelspec_eagle": {"num_mask_tokens": 3, "init_from_target_layer": False},
    "parallelspec_eagle3": {"num_mask_tokens": 3, "init_from_target_layer": False},
    "eagle3": {"ttt_steps": 3, "init_from_target_layer": False},
    "dflash": {"block_size": 4, "num_layers": 2, "init_from_target_layer": False},
}
MASK_MODS = {  # recipe -> the attention module's mask_mod factory its flex path uses
    "parallelspec": "group_mask_mod", "parallelspec_eagle": "group_mask_mod", "parallelspec_eagle3": "group_mask_mod",
    "eagle3": "ttt_mask_mod", "dflash": "block_layout_mask_mod",
}  # fmt: skip
ATOL = 1e-5


def _batch(target, dr, device="cpu"):
    batch = make_batch(target)
    ids, lengths = batch["input_ids"], batch["lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    feats = target.forward(ids, attention_mask=attn, with_logits=False, feature_layers=tuple(dr.feature_layers)).features
    return {k: v.to(device) for k, v in {**batch, "features": feats[:, :-1]}.items()}


def _drafter(target, name, seed=0):
    from drafttrain.drafters import build_drafter

    torch.manual_seed(seed)
    return build_drafter(name, dict(RECIPES[name]), target).eval()


def _loss(dr, batch, mode):
    """(the training loss, the outputs of every attention module call of that pass) under ``mode``."""
    outs = []
    hooks = [m.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach()))
             for name, m in dr.named_modules() if name.endswith("self_attn")]  # fmt: skip
    if hasattr(dr, "_attend"):  # DFlash runs its layers' projections and attention itself
        real = dr._attend
        dr._attend = lambda *a: outs.append(real(*a).detach()) or outs[-1]
    dr.set_attention(mode)
    try:
        with torch.no_grad():
            return float(dr.training_loss(batch, torch.Generator().manual_seed(0)).loss), outs
    finally:
        dr.set_attention("dense")
        dr.__dict__.pop("_attend", None)
        for h in hooks:
            h.remove()


def _differ(a, b) -> list[str]:
    """What the flex pass ``a`` and the dense pass ``b`` disagree on beyond ATOL (empty = the same)."""
    (la, oa), (lb, ob) = a, b
    out = [f"loss {la} vs {lb}"] if abs(la - lb) > ATOL else []
    if len(oa) != len(ob) or not oa:
        return out + [f"{len(oa)} vs {len(ob)} attention calls"]
    return out + [f"attention call {i}: max diff {float((x - y).abs().max()):.2e}"
                  for i, (x, y) in enumerate(zip(oa, ob)) if not torch.allclose(x, y, atol=ATOL, rtol=0)]  # fmt: skip


# -- the masks themselves: mask_mod on the grid == the dense allowed matrix ------------------------------


def _grid(mask_mod, b, q, kv):
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(mask_mod, b, 1, q, kv, device="cpu")[:, 0]  # [b, q, kv] bool


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_group_mask_mod_equals_dense_allowed(block, seed):
    g = torch.Generator().manual_seed(seed)
    lays = []
    for t in (11, 6, 9):
        y = torch.randint(0, 50, (t,), generator=g)
        y[torch.rand(t, generator=g) < 0.3] = L.IGNORE_INDEX
        lays.append(L.build_group_layout(y, L.select_anchors(y, 3, 0.6, g), 3, block=block))
    dense = L.collate_layouts(lays, torch.float32)
    flex = L.collate_layouts(lays, torch.float32, dense=False)
    assert flex.attention_mask is None
    b, s = flex.slot_kind.shape
    assert torch.equal(_grid(A.group_mask_mod(flex), b, s, s), dense.attention_mask[:, 0] == 0)


@pytest.mark.parametrize("t,step", [(1, 0), (5, 0), (5, 3), (7, 6)])
def test_ttt_mask_mod_equals_dense_step_mask(t, step):
    _, mask = L.ttt_step_layout(t, step, torch.float32)
    assert torch.equal(_grid(A.ttt_mask_mod(t, step), 1, t, (step + 1) * t)[0], mask[0, 0] == 0)


def test_dflash_block_layout_mask_mod_equals_dense(tiny_target):
    dr = _drafter(tiny_target, "dflash")
    labels = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([12, 7, 10])
    for i, n in enumerate(lengths.tolist()):
        labels[i, n:] = L.IGNORE_INDEX
    kinds, anchors, _, _, mask = dr.batch_layout(labels, lengths)
    dr.set_attention("flex")
    try:
        kinds2, _, _, _, block = dr.batch_layout(labels, lengths)
    finally:
        dr.set_attention("dense")
    assert A.is_block_mask(block) and torch.equal(kinds, kinds2)
    b, q, kv = mask.shape[0], mask.shape[2], mask.shape[3]
    assert torch.equal(_grid(block.mask_mod, b, q, kv), mask[:, 0] == 0)


def test_block_mask_skips_blocks_of_a_long_layout():
    """At 8 x 128 items with K = 3 and every 4th item an anchor the block mask computes under half the blocks."""
    y = torch.arange(1024)
    lay = L.collate_layouts([L.build_group_layout(y, torch.arange(0, 1024, 4), 3)], torch.float32, dense=False)
    bm = A.group_block_mask(lay)
    assert bm.sparsity() > 50.0, bm.sparsity()


def test_dense_mask_bytes_formula():
    _, mask = L.ttt_step_layout(16, 6, torch.float32)
    assert A.dense_mask_bytes(1, 16, 7 * 16) == mask.numel() * mask.element_size()
    assert A.dense_mask_bytes(2, 4096, 7 * 4096, torch.bfloat16) == 2 * 4096 * 28672 * 2


def test_flex_training_on_cpu_fails_early(tiny_target):
    dr = _drafter(tiny_target, "parallelspec")
    with pytest.raises(ValueError, match="no backward on CPU"):
        dr.set_attention("flex", device="cpu")
    with pytest.raises(ValueError, match="dense\\|flex"):
        dr.set_attention("sparse")
    assert dr.attention == "dense"


# -- the losses: flex == dense for every recipe, and a flipped entry is caught --------------------------


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_flex_loss_equals_dense(tiny_target, name, monkeypatch):
    dr = _drafter(tiny_target, name)
    batch = _batch(tiny_target, dr)
    dense = _loss(dr, batch, "dense")
    built = []
    real = A.block_mask
    monkeypatch.setattr(A, "block_mask", lambda *a, **k: built.append(a[1:4]) or real(*a, **k))
    monkeypatch.setattr(L, "additive_mask", lambda *a, **k: pytest.fail("flex built a dense mask"))
    flex = _loss(dr, batch, "flex")
    assert built, "the flex path built no block mask"
    assert not _differ(flex, dense), (name, _differ(flex, dense))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_one_flipped_mask_entry_fails_the_comparison(tiny_target, name, monkeypatch):
    """The block mask with one entry flipped (query slot 5 of sequence 0 no longer sees item 0, which every
    real slot sees) fails the comparison above: the attention outputs of that row differ (the loss, a mean
    over every labelled slot, may move by less than the tolerance)."""
    dr = _drafter(tiny_target, name)
    batch = _batch(tiny_target, dr)
    dense = _loss(dr, batch, "dense")
    factory = getattr(A, MASK_MODS[name])

    def flipped(*args, **kwargs):
        mm = factory(*args, **kwargs)
        return lambda b, h, q, kv: mm(b, h, q, kv) ^ ((b == 0) & (q == 5) & (kv == 0))

    monkeypatch.setattr(A, MASK_MODS[name], flipped)
    flex = _loss(dr, batch, "flex")
    assert _differ(flex, dense), name


# -- CUDA: gradients and bf16 (scripts/device_check.sh runs these) ---------------------------------------

BF16_RTOL = 2e-2  # bf16 keeps 8 mantissa bits: the two kernels round differently in the softmax and the sums


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_loss_and_grads_equal_dense_on_cuda(name, dtype):
    from scripts.device_check import TINY, build_target

    target = build_target(TINY, "cuda", dtype)  # a tiny random Llama from a config: no tokenizer needed
    dr = _drafter(target, name).train()
    batch = _batch(target, dr, "cuda")
    out = {}
    for mode in ("dense", "flex"):
        dr.set_attention(mode, device="cuda")
        dr.zero_grad(set_to_none=True)
        loss = dr.training_loss(batch, torch.Generator().manual_seed(0)).loss
        loss.backward()
        out[mode] = (loss.detach().float(), [p.grad.detach().float().clone() for p in dr.parameters() if p.grad is not None])
    (ld, gd), (lf, gf) = out["dense"], out["flex"]
    if dtype == torch.float32:
        assert torch.allclose(lf, ld, atol=ATOL, rtol=0), (lf, ld)
        for a, b in zip(gf, gd):
            assert torch.allclose(a, b, atol=ATOL, rtol=1e-4)
    else:
        assert torch.allclose(lf, ld, rtol=BF16_RTOL, atol=1e-3), (lf, ld)
        for a, b in zip(gf, gd):
            assert (a - b).norm() <= BF16_RTOL * 5 * max(b.norm(), 1e-3)
