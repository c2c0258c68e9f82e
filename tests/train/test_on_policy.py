"""On-policy labels: the frozen target labels every group's drafts in one forward through the group-wise layout.

The one-pass states must equal a separate target forward over each anchor's prefix + its drafted
continuation (fp32, tight tolerance) on a tiny target of every family; the literal mask of a small case is
asserted; a mutation of the rule (a group that sees another group's drafts) must break the equality.
"""

from __future__ import annotations

import pytest
import torch

import drafttrain.layout as layout_mod
from drafttrain.drafters.base import DraftGroups
from drafttrain.strategies.on_policy import label_drafts, labelling_layout
from test_families import DECODED, family_target

K = 3


def _groups(target, seed: int = 0):
    """Two rows of random tokens, three groups (two in row 0, one in row 1), random drafts."""
    g = torch.Generator().manual_seed(seed)
    v = target.config.vocab_size
    lengths = torch.tensor([12, 9])
    ids = torch.randint(3, v, (2, 12), generator=g)
    ids[1, 9:] = 0
    groups = DraftGroups(row=torch.tensor([0, 1, 0]), anchor=torch.tensor([6, 3, 1]),
                         drafts=torch.randint(3, v, (3, K), generator=g))  # fmt: skip
    return ids, lengths, groups


def _separate(target, ids, groups) -> torch.Tensor:
    """The reference: one plain causal target forward per group over x_0..x_{a+1}, d_0..d_{K-1}."""
    out = []
    for r, a, d in zip(groups.row.tolist(), groups.anchor.tolist(), groups.drafts):
        seq = torch.cat([ids[r, : a + 2], d])[None]
        hidden = target.forward(seq, with_logits=False).hidden[0]  # [a + 2 + K, d]
        out.append(hidden[a + 2 :])  # the states at d_0..d_{K-1}
    return torch.stack(out)


@pytest.mark.parametrize("family", DECODED)
def test_one_pass_labels_equal_a_separate_forward_per_group(family):
    target = family_target(family)
    ids, lengths, groups = _groups(target)
    got = label_drafts(target, ids, lengths, groups)
    want = _separate(target, ids, groups)
    assert got.shape == (3, K, target.config.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_group_that_sees_another_groups_drafts_breaks_the_equality(monkeypatch):
    """Mutation: let mask slots see every group's slots (the paper's 'ignore [MASK] tokens from previous
    parallel groups' left out); the one-pass labels then differ from the separate forwards."""
    target = family_target("llama")
    ids, lengths, groups = _groups(target)
    rule = layout_mod.group_rule

    def leaky(q_kind, q_anchor, q_group, k_kind, k_anchor, k_group, block=False):
        return rule(q_kind, q_anchor, q_group, k_kind, k_anchor, k_group, block) | ((q_kind > 0) & (k_kind > 0))

    monkeypatch.setattr(layout_mod, "group_rule", leaky)
    got = label_drafts(target, ids, lengths, groups)
    want = _separate(target, ids, groups)
    assert not torch.allclose(got[0], want[0], atol=1e-3)  # row 0 has two groups: each now sees the other's


def test_labelling_layout_literal_mask():
    """3 tokens, one group at anchor item 0 (its context ends at token 1), K = 2: the docstring's example."""
    tokens, pos, allowed = labelling_layout(3, torch.tensor([0]), torch.tensor([[7, 8]]))
    assert tokens.tolist() == [-1, -1, -1, 7, 8]
    assert pos.tolist() == [0, 1, 2, 2, 3]
    assert allowed.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    # two groups: group 2's slots never see group 1's
    _, pos2, allowed2 = labelling_layout(4, torch.tensor([0, 1]), torch.tensor([[7, 8], [9, 10]]))
    assert pos2.tolist() == [0, 1, 2, 3, 2, 3, 3, 4]
    assert not allowed2[6:, 4:6].any() and not allowed2[4:6, 6:].any()
    assert allowed2[6:, :3].all() and not allowed2[6:, 3].any()  # anchor token 2: sees x_0..x_2, not x_3


def test_label_drafts_refuses_an_anchor_past_the_row():
    target = family_target("llama")
    ids, lengths, _ = _groups(target)
    bad = DraftGroups(row=torch.tensor([1]), anchor=torch.tensor([8]), drafts=torch.ones(1, K, dtype=torch.long))
    with pytest.raises(ValueError, match="row 1: anchor 8 needs 10 tokens, the row has 9"):
        label_drafts(target, ids, lengths, bad)
