"""Tests of drafttrain.layout: the group-wise parallel layout, anchors, labels and masks (pure, < 3 s).

The literals below were written by hand from docs/design.md, "Definitions", not printed from the code:
- item i has position i and attends to items <= i;
- mask slot j (1..K) of anchor a has position a + j, attends to items <= a and to mask slots 1..j of
  the same anchor only;
- labels: item i -> y_i, mask slot j of anchor a -> y_{a+j}, -100 past the end.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from drafttrain import layout as L

IGN = L.IGNORE_INDEX


# ---------------------------------------------------------------- plain-loop references


def reference_layout(labels: list[int], anchors: list[int], k: int) -> dict[str, list]:
    """docs/design.md, "Definitions", written as nested loops over slots (no tensor tricks)."""
    t = len(labels)
    slots = [(0, i) for i in range(t)]  # (kind, anchor): kind 0 = item i
    for a in anchors:
        for j in range(1, k + 1):
            slots.append((j, a))
    kind = [s[0] for s in slots]
    anchor = [s[1] for s in slots]
    position = [a + j for (j, a) in slots]
    lab = []
    for j, a in slots:
        idx = a + j
        lab.append(labels[idx] if idx < t else IGN)
    allowed = []
    for qj, qa in slots:
        row = []
        for kj, ka in slots:
            if kj == 0:  # key is item ka
                ok = ka <= qa  # items attend items <= i; mask slots attend items <= their anchor
            elif qj == 0:  # an item never sees a mask slot
                ok = False
            else:  # mask slot sees mask slots 1..j of its own anchor
                ok = ka == qa and kj <= qj
            row.append(int(ok))
        allowed.append(row)
    return {"slot_kind": kind, "slot_anchor": anchor, "position_ids": position, "labels": lab, "allowed": allowed}


def reference_candidates(labels: list[int], k: int) -> list[int]:
    """Anchors a whose group has at least one mask-slot label: some y_{a+j} != -100, j = 1..K."""
    t = len(labels)
    return [a for a in range(t) if any(a + j < t and labels[a + j] != IGN for j in range(1, k + 1))]


# ---------------------------------------------------------------- literal layout


def test_literal_layout_t4_k2_all_anchors():
    """The worked example of the module docstring (T = 4, K = 2, every item an anchor), written out in
    full: this is the matrix the paper's group mask must reduce to, so any change in it is a change of
    the training objective."""
    y = torch.tensor([10, 11, 12, 13])
    lay = L.build_group_layout(y, torch.arange(4), num_mask_tokens=2)

    #                       u0 u1 u2 u3 m1@0 m2@0 m1@1 m2@1 m1@2 m2@2 m1@3 m2@3
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 1, 2, 2, 3, 3, 4, 4, 5]
    assert lay.labels.tolist() == [10, 11, 12, 13, 11, 12, 12, 13, 13, IGN, IGN, IGN]
    assert lay.slot_kind.tolist() == [0, 0, 0, 0, 1, 2, 1, 2, 1, 2, 1, 2]
    assert lay.slot_anchor.tolist() == [0, 1, 2, 3, 0, 0, 1, 1, 2, 2, 3, 3]
    assert lay.anchors.tolist() == [0, 1, 2, 3]
    assert lay.num_slots == 12
    expected = [
        # u0 u1 u2 u3 | m1@0 m2@0 | m1@1 m2@1 | m1@2 m2@2 | m1@3 m2@3
        [1, 0, 0, 0,    0, 0,       0, 0,       0, 0,       0, 0],  # u0
        [1, 1, 0, 0,    0, 0,       0, 0,       0, 0,       0, 0],  # u1
        [1, 1, 1, 0,    0, 0,       0, 0,       0, 0,       0, 0],  # u2
        [1, 1, 1, 1,    0, 0,       0, 0,       0, 0,       0, 0],  # u3
        [1, 0, 0, 0,    1, 0,       0, 0,       0, 0,       0, 0],  # m1@0
        [1, 0, 0, 0,    1, 1,       0, 0,       0, 0,       0, 0],  # m2@0
        [1, 1, 0, 0,    0, 0,       1, 0,       0, 0,       0, 0],  # m1@1
        [1, 1, 0, 0,    0, 0,       1, 1,       0, 0,       0, 0],  # m2@1
        [1, 1, 1, 0,    0, 0,       0, 0,       1, 0,       0, 0],  # m1@2
        [1, 1, 1, 0,    0, 0,       0, 0,       1, 1,       0, 0],  # m2@2
        [1, 1, 1, 1,    0, 0,       0, 0,       0, 0,       1, 0],  # m1@3
        [1, 1, 1, 1,    0, 0,       0, 0,       0, 0,       1, 1],  # m2@3
    ]  # fmt: skip
    assert lay.allowed.dtype == torch.bool
    assert lay.allowed.int().tolist() == expected


def test_literal_docstring_example_t3_k1():
    """The docstring example of build_group_layout (T = 3, K = 1, anchors [0, 1]) is true."""
    lay = L.build_group_layout(torch.tensor([7, 8, 9]), torch.tensor([0, 1]), num_mask_tokens=1)
    #        u0 u1 u2 m1@0 m1@1
    expected = [
        [1, 0, 0, 0, 0],  # u0
        [1, 1, 0, 0, 0],  # u1
        [1, 1, 1, 0, 0],  # u2
        [1, 0, 0, 1, 0],  # m1@0
        [1, 1, 0, 0, 1],  # m1@1
    ]
    assert lay.allowed.int().tolist() == expected
    assert lay.position_ids.tolist() == [0, 1, 2, 1, 2]
    assert lay.labels.tolist() == [7, 8, 9, 8, 9]


# ---------------------------------------------------------------- plain-loop reference


def test_layout_matches_plain_loop_reference():
    """~50 random cases (T 1..20, K 0..5, random anchor subsets, labels with -100): the vectorised
    layout equals the definition written as loops."""
    rng = random.Random(1234)
    for case in range(50):
        t = rng.randint(1, 20)
        k = rng.randint(0, 5)
        labels = [rng.randrange(100) if rng.random() > 0.3 else IGN for _ in range(t)]
        anchors = sorted(rng.sample(range(t), rng.randint(0, t)))
        lay = L.build_group_layout(torch.tensor(labels), torch.tensor(anchors, dtype=torch.long), k)
        ref = reference_layout(labels, anchors, k)
        msg = f"case {case}: t={t} k={k} anchors={anchors} labels={labels}"
        assert lay.num_slots == t + len(anchors) * k, msg
        for name in ("slot_kind", "slot_anchor", "position_ids", "labels"):
            assert getattr(lay, name).tolist() == ref[name], f"{name}: {msg}"
        assert lay.allowed.int().tolist() == ref["allowed"], f"allowed: {msg}"


def test_layout_rejects_out_of_range_anchor():
    with pytest.raises(ValueError):
        L.build_group_layout(torch.tensor([1, 2, 3]), torch.tensor([3]), 2)


# ---------------------------------------------------------------- anchors


def _random_labels(rng: random.Random, t: int) -> torch.Tensor:
    return torch.tensor([rng.randrange(100) if rng.random() > 0.4 else IGN for _ in range(t)], dtype=torch.long)


def test_select_anchors_ratio_one_is_exactly_the_candidates():
    """ratio 1 keeps every anchor whose group has a mask-slot label and nothing else (groups without
    one would only cost compute), including sequences shorter than the group (T < K)."""
    rng = random.Random(7)
    checked = 0
    for _ in range(80):
        t = rng.randint(1, 20)
        k = rng.randint(0, 5)
        labels = _random_labels(rng, t)
        got = L.select_anchors(labels, k, 1.0)
        assert got.dtype == torch.long
        assert got.tolist() == reference_candidates(labels.tolist(), k), (t, k, labels.tolist())
        checked += 1
    assert checked > 40
    # literal: y = [-100, -100, 5, -100, -100, 6], K = 2 -> anchors whose y_{a+1} or y_{a+2} is set
    y = torch.tensor([IGN, IGN, 5, IGN, IGN, 6])
    assert L.select_anchors(y, 2).tolist() == [0, 1, 3, 4]
    assert L.select_anchors(y, 0).tolist() == []


def test_select_anchors_short_sequence_shorter_than_k():
    """Regression: a sequence shorter than the group (t = 2 items, K = 3) raised RuntimeError (negative
    slice end); it still has anchor 0 (y_1 is a label)."""
    assert L.select_anchors(torch.tensor([10, 11]), 3).tolist() == [0]


def test_select_anchors_subsample():
    """ratio r keeps ceil(r * n) candidates, sorted, a subset; the same generator seed gives the same
    anchors (resume replays the same batches)."""
    rng = random.Random(3)
    for _ in range(20):
        t = rng.randint(5, 30)
        labels = _random_labels(rng, t)
        cands = reference_candidates(labels.tolist(), 4)
        for ratio in (0.5, 0.25, 0.9):
            got = L.select_anchors(labels, 4, ratio, torch.Generator().manual_seed(11)).tolist()
            assert len(got) == (math.ceil(ratio * len(cands)) if cands else 0)
            assert got == sorted(got) and set(got) <= set(cands)
            again = L.select_anchors(labels, 4, ratio, torch.Generator().manual_seed(11)).tolist()
            assert again == got
    # 7 candidates at ratio 0.5 -> ceil(3.5) = 4
    y = torch.arange(8) + 100
    assert len(L.select_anchors(y, 1, 0.5, torch.Generator().manual_seed(0))) == 4


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5])
def test_select_anchors_invalid_ratio(ratio):
    with pytest.raises(ValueError):
        L.select_anchors(torch.tensor([1, 2, 3]), 2, ratio)


def test_select_anchors_negative_k():
    with pytest.raises(ValueError):
        L.select_anchors(torch.tensor([1, 2, 3]), -1)


# ---------------------------------------------------------------- item labels


def test_item_labels_docstring_example():
    """Item i reads (x_{i+1}, f_i) and must guess x_{i+2}: an off-by-one here trains the wrong token."""
    got = L.item_labels(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 1, 1]))
    assert got.tolist() == [7, 8, IGN]
    assert got.dtype == torch.long


def test_item_labels_loss_mask_and_edges():
    assert L.item_labels(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 1, 1, 0, 1])).tolist() == [7, IGN, 9, IGN]
    one = L.item_labels(torch.tensor([5]), torch.tensor([1]))
    assert one.shape == (0,)  # L = 1: no item
    assert L.item_labels(torch.tensor([5, 6]), torch.tensor([1, 1])).tolist() == [IGN]  # L = 2: one item, no x_2


# ---------------------------------------------------------------- inference layout


def test_inference_layout_rows_equal_training_rows():
    """Inference drafting (n new items after p cached ones, then K masks) sees exactly what the
    training layout shows the last item's group: same positions, same allowed rows."""
    for n in range(1, 6):
        for k in range(0, 5):
            for p in range(0, 5):
                pos, mask = L.inference_layout(num_items=n, num_mask_tokens=k, dtype=torch.float32, past=p)
                q = n + k
                assert pos.shape == (1, q) and mask.shape == (1, 1, q, p + q)
                t = p + n
                lay = L.build_group_layout(torch.arange(t) + 100, torch.tensor([t - 1]), k)
                # training slots: items 0..t-1 then the K mask slots of anchor t-1 (kv order of inference)
                train_rows = lay.allowed[p:]  # the new items and the mask slots
                assert torch.equal(mask[0, 0] == 0, train_rows), (n, k, p)
                assert pos[0].tolist() == lay.position_ids[p:].tolist(), (n, k, p)


def test_inference_layout_literal():
    """n = 2 new items after p = 1 cached item, K = 2 (hand-derived)."""
    pos, mask = L.inference_layout(num_items=2, num_mask_tokens=2, dtype=torch.float32, past=1)
    assert pos.tolist() == [[1, 2, 3, 4]]
    #    c0 u1 u2 m1 m2
    expected = [
        [1, 1, 0, 0, 0],  # u1
        [1, 1, 1, 0, 0],  # u2
        [1, 1, 1, 1, 0],  # m1
        [1, 1, 1, 1, 1],  # m2
    ]
    assert (mask[0, 0] == 0).int().tolist() == expected


# ---------------------------------------------------------------- collation, additive mask


def test_collate_layouts_padding():
    """Padding slots attend only to themselves (no all-masked row: NaN under eager), real slots never
    attend to padding, and padding carries label -100 / kind -1."""
    long = L.build_group_layout(torch.tensor([10, 11, 12, 13]), torch.tensor([0, 2]), 2)  # 8 slots
    short = L.build_group_layout(torch.tensor([20, IGN]), torch.tensor([0]), 1)  # 3 slots
    b = L.collate_layouts([long, short], dtype=torch.float32)
    assert b.attention_mask.shape == (2, 1, 8, 8)
    allowed = b.attention_mask[:, 0] == 0
    assert torch.equal(allowed[0], long.allowed)
    assert torch.equal(allowed[1, :3, :3], short.allowed)
    # short: slots 0..2 real, 3..7 padding
    #          u0 u1 m1@0 p  p  p  p  p
    expected_short = [
        [1, 0, 0, 0, 0, 0, 0, 0],  # u0
        [1, 1, 0, 0, 0, 0, 0, 0],  # u1
        [1, 0, 1, 0, 0, 0, 0, 0],  # m1@0
        [0, 0, 0, 1, 0, 0, 0, 0],  # pad
        [0, 0, 0, 0, 1, 0, 0, 0],  # pad
        [0, 0, 0, 0, 0, 1, 0, 0],  # pad
        [0, 0, 0, 0, 0, 0, 1, 0],  # pad
        [0, 0, 0, 0, 0, 0, 0, 1],  # pad
    ]
    assert allowed[1].int().tolist() == expected_short
    assert b.labels[1].tolist() == [20, IGN, IGN] + [IGN] * 5
    assert b.slot_kind[1].tolist() == [0, 0, 1] + [-1] * 5
    assert b.position_ids[1, :3].tolist() == [0, 1, 1]
    assert b.labels[0].tolist() == long.labels.tolist()
    assert b.num_items.tolist() == [4, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_additive_mask_values(dtype):
    """0 where allowed, finfo(dtype).min elsewhere, built in the model dtype (a float32 min cast to bf16
    would be -inf and give NaN on fully masked rows)."""
    allowed = torch.tensor([[True, False], [True, True]])
    m = L.additive_mask(allowed, dtype)
    assert m.dtype == dtype
    lo = torch.finfo(dtype).min
    assert m.tolist() == [[0.0, lo], [0.0, 0.0]]
    assert torch.isfinite(m).all()


# ---------------------------------------------------------------- EAGLE-3 training-time test (TTT)


def reference_ttt_allowed(t: int, k: int) -> list[list[int]]:
    """EAGLE-3's TTT rule as loops over (step, position) slots: (s, j) sees step-0 keys at positions <= j
    and its own position's keys of steps 1..s."""
    slots = [(s, j) for s in range(k) for j in range(t)]
    return [[int((ks == 0 and kj <= qj) or (1 <= ks <= qs and kj == qj)) for ks, kj in slots] for qs, qj in slots]


def test_ttt_mask_literal_t3_k3():
    """The docstring matrix, written by hand."""
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]  # fmt: skip
    assert L.ttt_mask(3, 3).int().tolist() == expected
    assert L.ttt_mask(2, 1).int().tolist() == [[1, 0], [1, 1]]  # one step: plain causal


@pytest.mark.parametrize("t, k", [(1, 1), (1, 4), (4, 2), (5, 7), (7, 3)])
def test_ttt_mask_matches_plain_loop(t, k):
    assert L.ttt_mask(t, k).int().tolist() == reference_ttt_allowed(t, k)


def test_ttt_step_layout_rows_and_positions():
    """Step k: rows k*t.. of the full matrix over keys of steps 0..k, positions j + k; the same as the
    EAGLE chain rollout from every item as anchor (two independent constructions of one rule)."""
    t, k = 4, 3
    full = L.ttt_mask(t, k + 1)
    for step in range(k + 1):
        pos, mask = L.ttt_step_layout(t, step, torch.float32)
        assert pos.tolist() == [[j + step for j in range(t)]]
        assert mask.shape == (1, 1, t, (step + 1) * t)
        assert torch.equal(mask[0, 0] == 0, full[step * t : (step + 1) * t, : (step + 1) * t])
        if step:
            rpos, rmask = L.chain_rollout_layout(torch.arange(t)[None], t, step, torch.float32)
            assert torch.equal(rpos, pos) and torch.equal(rmask, mask)
    with pytest.raises(ValueError):
        L.ttt_mask(0, 2)
    with pytest.raises(ValueError):
        L.ttt_step_layout(3, -1, torch.float32)


def test_forward_kl_is_soft_ce_minus_entropy():
    """EAGLE-3's per-step term: KL(p || q) >= 0, zero iff the distributions agree, soft CE - H(p)."""
    from drafttrain.losses import forward_kl, soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    q, p = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    kl = forward_kl(q, p)
    pp = torch.softmax(p, -1)
    ref = (pp * (pp.log() - torch.log_softmax(q, -1))).sum(-1)
    torch.testing.assert_close(kl, ref)
    torch.testing.assert_close(kl, soft_cross_entropy(q, p) + (pp * pp.log()).sum(-1))
    assert (kl > 0).all() and forward_kl(p, p).abs().max() < 1e-6
