"""The per-row memo of the target's full-vocabulary argmax (drafttrain.drafters.target_argmax)."""

import torch

from drafttrain.drafters.target_argmax import TargetArgmaxMemo, full_vocab_argmax
from helpers import make_batch


def _final(target, batch):
    return batch["features"][..., : target.config.hidden_size]


def test_memo_equals_the_plain_argmax_and_is_computed_once_per_row(tiny_target):
    batch = make_batch(tiny_target, lengths=(14, 9, 11), prompt=(4, 3, 2))
    final = _final(tiny_target, batch)
    memo = TargetArgmaxMemo()
    first = memo(tiny_target.lm_head, batch["input_ids"], batch["lengths"], final)
    for i, n in enumerate(batch["lengths"].tolist()):
        plain = full_vocab_argmax(tiny_target.lm_head, final[i, : n - 1])
        assert torch.equal(first[i, : n - 1], plain)
        assert not first[i, n - 1 :].any()  # padding stays 0
    assert (memo.hits, memo.misses) == (0, 3)
    again = memo(tiny_target.lm_head, batch["input_ids"], batch["lengths"], final)
    assert torch.equal(again, first) and (memo.hits, memo.misses) == (3, 3)
    # the same rows in another order and batch width hit the same entries
    order = torch.tensor([2, 0])
    sub = {k: v[order] for k, v in batch.items()}
    assert torch.equal(memo(tiny_target.lm_head, sub["input_ids"], sub["lengths"], _final(tiny_target, sub)),
                       first[order]) and memo.hits == 5  # fmt: skip


def test_other_features_for_the_same_ids_miss(tiny_target):
    """The key holds the features' checksum: the same tokens with other features (another target, noise)
    are computed afresh, never read from an entry of other features."""
    batch = make_batch(tiny_target, lengths=(10,), prompt=(2,))
    final = _final(tiny_target, batch)
    memo = TargetArgmaxMemo()
    memo(tiny_target.lm_head, batch["input_ids"], batch["lengths"], final)
    other = final + 0.5 * torch.randn_like(final)
    out = memo(tiny_target.lm_head, batch["input_ids"], batch["lengths"], other)
    assert memo.misses == 2 and memo.hits == 0
    assert torch.equal(out[0, :9], full_vocab_argmax(tiny_target.lm_head, other[0, :9]))


def test_eagle3_losses_are_unchanged_by_the_memo(tiny_target):
    """The training loss of eagle3 and parallelspec_eagle3 with a restricted vocabulary: the same value on
    the memo's first (computing) and second (reading) call, and on a drafter whose memo holds nothing."""
    from drafters.test_eagle3 import batch_for, make, vocab_with_target_argmax

    from drafttrain.drafters import build_drafter

    for recipe in ("eagle3", "parallelspec_eagle3"):
        torch.manual_seed(0)
        dr = (make(tiny_target, draft_vocab_size=300) if recipe == "eagle3" else
              build_drafter(recipe, {"draft_vocab_size": 300, "init_from_target_layer": False}, tiny_target))  # fmt: skip
        dr.eval()
        batch = batch_for(tiny_target, dr)
        vocab_with_target_argmax(dr, batch, tiny_target)  # about half the argmax tokens out of the vocabulary
        losses = [float(dr.training_loss(batch).loss.detach()) for _ in range(2)]
        memo = dr.__dict__["_target_argmax_memo"]
        assert memo.misses == 2 and memo.hits == 2
        dr.__dict__.pop("_target_argmax_memo")
        assert losses[0] == losses[1] == float(dr.training_loss(batch).loss.detach())
