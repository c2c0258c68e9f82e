"""Draft vocabulary: the target token ids a restricted-vocabulary drafter may propose (EAGLE-3 style)."""

from __future__ import annotations

import torch


def frequent_tokens(ds, n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``n`` most frequent answer tokens (loss_mask = 1) of a tokenized dataset.

    Ties and unseen ids are ordered by frequency over all tokens, then by id, so the result is
    deterministic and always has ``n`` distinct ids.

    Args:
        ds: rows with ``input_ids`` and ``loss_mask`` (lists or tensors).
        n: draft vocabulary size (<= vocab_size).
        vocab_size: the target's vocabulary size v.

    Returns:
        (ids [n] int64 sorted by decreasing frequency, coverage: fraction of answer tokens in ``ids``).
    """
    answer = torch.zeros(vocab_size, dtype=torch.float64)
    every = torch.zeros(vocab_size, dtype=torch.float64)
    for row in ds:
        ids = torch.as_tensor(row["input_ids"]).long()
        mask = torch.as_tensor(row["loss_mask"]).bool()
        every += torch.bincount(ids, minlength=vocab_size)[:vocab_size].double()
        answer += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size].double()
    # lexicographic key: answer count, then all-token count, then smaller id first
    key = answer * (every.max() + 1) + every
    order = sorted(range(vocab_size), key=lambda i: (-key[i].item(), i))[:n]
    ids = torch.tensor(order, dtype=torch.long)
    coverage = float(answer[ids].sum() / answer.sum().clamp_min(1))
    return ids, coverage
