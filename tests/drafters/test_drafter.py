"""Tests of the ParallelSpec drafter, its loss (Eq. 3) and its training metrics on the tiny target (< 20 s)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from drafttrain import layout as L
from drafttrain.drafters import Drafter
from drafttrain.losses import group_position_weights, parallel_group_loss
from drafttrain.metrics import finalize, group_acceptance_sums
from helpers import assert_same_logits, make_batch

K = 3
# first training loss of the fixed-seed tiny setup in test_first_loss_golden (computed once, 2026-11)
GOLDEN_FIRST_LOSS = 31.950471878051758


@pytest.fixture(scope="module")
def batch(tiny_target):
    return make_batch(tiny_target)


def _groups(lay: L.BatchLayout, i: int) -> dict[int, list[int]]:
    """anchor a -> slot indices [item a, mask 1..K of a] of sequence i (found by scanning the slots)."""
    out: dict[int, list[int]] = {}
    for s in range(lay.slot_kind.shape[1]):
        if int(lay.slot_kind[i, s]) > 0:
            a = int(lay.slot_anchor[i, s])
            out.setdefault(a, [a]).append(s)
    return out


# ---------------------------------------------------------------- training / inference equivalence


@pytest.mark.parametrize(
    "init_from_target_layer, anchor_ratio", [(False, 1.0), (True, 1.0), (False, 0.5), (True, 0.5)]
)
def test_training_layout_equals_inference(tiny_target, make_drafter, batch, init_from_target_layer, anchor_ratio):
    """THE invariant of the group-wise layout: the drafter's outputs at anchor a's [item, masks] slots in
    the training layout equal its inference outputs (propose on items <= a + K masks). If this breaks,
    the drafter is trained on a view of the context that it never gets at inference."""
    dr = make_drafter(init_from_target_layer=init_from_target_layer, anchor_ratio=anchor_ratio)
    dr.eval()
    ids, feats = batch["input_ids"], batch["features"]
    next_ids = ids[:, 1:]  # item i reads x_{i+1}
    t = next_ids.shape[1]
    with torch.no_grad():
        items = dr.items(next_ids, feats[:, :t])
        lay = dr.layouts(batch, torch.Generator().manual_seed(5))
        hidden = dr.forward_layout(items, lay)  # [b, s, d]
    checked = 0
    for i in range(ids.shape[0]):
        groups = _groups(lay, i)
        n_items = int(batch["lengths"][i]) - 1
        cands = L.select_anchors(L.item_labels(ids[i, : n_items + 1], batch["loss_mask"][i, : n_items + 1]), K)
        expected_n = len(cands) if anchor_ratio == 1.0 else math.ceil(anchor_ratio * len(cands))
        assert len(groups) == expected_n > 0
        for a, slots in groups.items():
            assert len(slots) == K + 1
            want = dr.logits(hidden[i, slots])  # [K+1, v]
            got = dr.propose(next_ids[i : i + 1, : a + 1], feats[i : i + 1, : a + 1], DynamicCache())[0]
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"seq {i} anchor {a}")
            checked += 1
    assert checked >= 8


def test_incremental_drafting_equals_one_shot(tiny_target, make_drafter, batch):
    """Drafting after a verification step feeds only the new items into the same cache: the result must
    equal drafting from scratch, and the mask slots must not stay in the cache."""
    dr = make_drafter()
    dr.eval()
    next_ids, feats = batch["input_ids"][:1, 1:], batch["features"][:1]
    n, m = 12, 7
    cache = DynamicCache()
    first = dr.propose(next_ids[:, :m], feats[:, :m], cache)
    assert cache.get_seq_length() == m
    second = dr.propose(next_ids[:, m:n], feats[:, m:n], cache)
    assert cache.get_seq_length() == n
    third = dr.propose(next_ids[:, n : n + 1], feats[:, n : n + 1], cache)  # one item (a bonus token only)
    assert cache.get_seq_length() == n + 1
    torch.testing.assert_close(first, dr.propose(next_ids[:, :m], feats[:, :m], DynamicCache()), atol=1e-5, rtol=0)
    torch.testing.assert_close(second, dr.propose(next_ids[:, :n], feats[:, :n], DynamicCache()), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        third, dr.propose(next_ids[:, : n + 1], feats[:, : n + 1], DynamicCache()), atol=1e-5, rtol=0
    )
    assert second.shape == (1, K + 1, tiny_target.config.vocab_size) and second.dtype == torch.float32


# ---------------------------------------------------------------- parameters, frozen target


def test_parameter_count_and_frozen_target(tiny_target, make_drafter, batch):
    """Only fc, one decoder layer and the K mask vectors are trained; the target's embedding, norm and
    LM head are shared by reference and must be neither optimised nor saved with the drafter."""
    dr = make_drafter(init_from_target_layer=True)
    d = tiny_target.config.hidden_size
    layer = sum(p.numel() for p in tiny_target.last_layer.parameters())
    # Llama layer, d = 64, 4 heads (hd 16), 2 kv heads, mlp 128: q,o 64*64; k,v 64*32; 3 mlp 64*128; 2 norms
    assert layer == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    n_trainable = sum(p.numel() for p in dr.parameters() if p.requires_grad)
    assert n_trainable == (2 * d * d + d) + layer + K * d
    assert n_trainable == sum(p.numel() for p in dr.parameters())

    target_ptrs = {p.data_ptr() for p in tiny_target.model.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in dr.parameters()}  # a copy of the layer, not shared
    sd = dr.state_dict()
    assert not [k for k in sd if "embed_tokens" in k or "lm_head" in k or k.startswith("norm")]
    assert {name for name, _ in dr.named_parameters()} <= set(sd)
    assert not target_ptrs & {v.data_ptr() for v in sd.values()}  # nothing saved is a target tensor

    dr.train()
    dr.zero_grad()
    out = dr(batch, torch.Generator().manual_seed(0))
    out.loss.backward()
    assert all(p.grad is None for p in tiny_target.model.parameters())
    assert all(not p.requires_grad for p in tiny_target.model.parameters())
    for name, p in dr.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------- checkpoint round trip


def test_save_load_round_trip(tiny_target, make_drafter, batch, tmp_path):
    """A saved drafter reloads (without the training config) to the same weights and drafts."""
    dr = make_drafter(seed=3, loss_decay=0.7)
    dr.save_pretrained(tmp_path / "ck")
    back = Drafter.from_pretrained(tmp_path / "ck", tiny_target)
    assert type(back) is type(dr)
    assert back.config == dr.config and back.num_mask_tokens == K
    sd, sd2 = dr.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    dr.eval(), back.eval()
    args = (batch["input_ids"][:1, 1:9], batch["features"][:1, :8])
    assert_same_logits(back.propose(*args, DynamicCache()), dr.propose(*args, DynamicCache()))  # tensors: bitwise, above


def test_from_pretrained_empty_dir(tiny_target, tmp_path):
    with pytest.raises(FileNotFoundError):
        Drafter.from_pretrained(tmp_path, tiny_target)


# ---------------------------------------------------------------- loss (Eq. 3)


def test_group_position_weights():
    assert group_position_weights(2, 0.8) == pytest.approx([1.0, 0.8, 0.64], rel=1e-12)
    assert group_position_weights(0, 0.8) == [1.0]


def test_parallel_group_loss_by_hand():
    """Eq. 3 as written: per-position mean CE (plain-loop log-softmax), weighted sum; a position with no
    labelled slot adds 0 (not NaN)."""
    g = torch.Generator().manual_seed(0)
    v = 7
    logits = torch.randn(6, v, generator=g)
    labels = torch.tensor([0, 3, 6, 2, 2, 5])
    position = torch.tensor([0, 1, 0, 1, 3, 0])  # K = 3; position 2 has no slot
    weights = [1.0, 0.5, 0.25, 0.125]
    loss, ce_sum, count = parallel_group_loss(logits, labels, position, weights)

    per_pos: dict[int, list[float]] = {}
    for r in range(6):
        row = logits[r].tolist()
        lse = math.log(sum(math.exp(x) for x in row))
        per_pos.setdefault(int(position[r]), []).append(lse - row[int(labels[r])])
    want = sum(weights[k] * sum(ces) / len(ces) for k, ces in per_pos.items())
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert count.tolist() == [3, 2, 0, 1]
    assert ce_sum[2] == 0
    for k, ces in per_pos.items():
        assert float(ce_sum[k]) == pytest.approx(sum(ces), rel=1e-5)
    assert not ce_sum.requires_grad


# ---------------------------------------------------------------- metrics


def test_group_acceptance_sums_literal():
    """acc_k / cond_acc_k / tau_sim on a hand-computed example.

    rows (correct at positions 0,1,2):  [1,1,0] -> L=2,  [1,0,1] -> L=1,  [0,1,1] -> L=0
    acc = [2/3, 2/3, 2/3]; cond_acc_0 = 2/3, cond_acc_1 = 1/2 (rows 0,1 had position 0 right),
    cond_acc_2 = 0/1 (only row 0 had positions 0,1 right); tau_sim = 1 + (2+1+0)/3 = 2.
    """
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    valid = torch.ones(3, 3, dtype=torch.bool)
    s = group_acceptance_sums(correct, valid)
    assert s["acc_num"].tolist() == [2, 2, 2] and s["acc_den"].tolist() == [3, 3, 3]
    assert s["cond_num"].tolist() == [2, 1, 0] and s["cond_den"].tolist() == [3, 2, 1]
    assert float(s["tau_len_sum"]) == 3 and float(s["tau_groups"]) == 3
    m = finalize(s, "train")
    assert m["train/tau_sim"] == pytest.approx(2.0)
    assert [m[f"train/acc_{k}"] for k in range(3)] == pytest.approx([2 / 3] * 3)
    assert [m[f"train/cond_acc_{k}"] for k in range(3)] == pytest.approx([2 / 3, 1 / 2, 0.0])


def test_group_acceptance_sums_unlabelled_positions():
    """L stops at an unlabelled position; a group whose anchor has no label is not counted for tau_sim.

    rows: [1,1,1] valid [1,1,0] -> L=2;  [1,1,1] valid [0,1,1] -> not counted;  [1,0,1] valid all -> L=1
    """
    correct = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    s = group_acceptance_sums(correct, valid)
    assert float(s["tau_groups"]) == 2 and float(s["tau_len_sum"]) == 3
    assert s["acc_num"].tolist() == [2, 2, 2] and s["acc_den"].tolist() == [2, 3, 2]
    m = finalize(s, "train")
    assert m["train/tau_sim"] == pytest.approx(2.5)


def test_finalize_names():
    s = group_acceptance_sums(torch.tensor([[1, 0]], dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool))
    s["ce_sum"], s["ce_count"] = torch.tensor([2.0, 3.0]), torch.tensor([1.0, 2.0])
    m = finalize(s, "train")
    assert set(m) == {"train/acc_0", "train/acc_1", "train/cond_acc_0", "train/cond_acc_1", "train/tau_sim",
                      "train/loss_0", "train/loss_1"}  # fmt: skip
    assert m["train/loss_1"] == pytest.approx(1.5) and m["train/cond_acc_1"] == 0.0
    assert set(finalize(s, "eval")) == {k.replace("train/", "eval/") for k in m}


def test_training_sums_match_per_group_recount(tiny_target, make_drafter, batch):
    """The drafter gathers each group's [anchor item, mask 1..K] slots out of the padded batch layout;
    recount the same statistics group by group from the layout's logits and compare."""
    dr = make_drafter()
    dr.eval()
    with torch.no_grad():
        out = dr(batch, torch.Generator().manual_seed(0))
        items = dr.items(batch["input_ids"][:, 1:], batch["features"])
        lay = dr.layouts(batch, torch.Generator().manual_seed(0))
        logits = dr.logits(dr.forward_layout(items, lay))  # [b, s, v]
    rows_c, rows_v = [], []
    for i in range(lay.labels.shape[0]):
        for a, slots in _groups(lay, i).items():
            lab = lay.labels[i, slots]
            rows_v.append([int(x) != L.IGNORE_INDEX for x in lab])
            rows_c.append([int(logits[i, s].argmax()) == int(lab[j]) for j, s in enumerate(slots)])
    ref = group_acceptance_sums(torch.tensor(rows_c), torch.tensor(rows_v))
    for k, v in ref.items():
        assert torch.equal(out.sums[k].float(), v.float()), k
    assert float(out.sums["ce_count"].sum()) == float((lay.labels != L.IGNORE_INDEX).sum())


# ---------------------------------------------------------------- golden value


def test_first_loss_golden(tiny_target, make_drafter):
    """The first loss of a fixed-seed tiny setup (seed-0 drafter, K = 3, random batch) is a stored
    value, so an accidental change of the loss, layout, labels or init is caught."""
    dr = make_drafter(seed=0)
    dr.train()
    loss = float(dr(make_batch(tiny_target, seed=1), torch.Generator().manual_seed(0)).loss.detach())
    assert loss == pytest.approx(GOLDEN_FIRST_LOSS, rel=1e-4)
