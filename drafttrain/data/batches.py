"""Rows -> training batches, and the order rows are drawn in.

Data order is a pure function of (seed, global sample index) (:func:`sample_indices`), so a run resumed
from a checkpoint replays the same batches as an uninterrupted one, and 2 processes x 1 micro-batch see
exactly the samples of 1 process x 2 accumulated micro-batches (the loop, :mod:`drafttrain.train`,
assigns the global sample positions). Shape letters: b batch, L longest row, F feature width
(len(feature_layers) * d).
"""

from __future__ import annotations

import torch


def collate(rows: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad rows to one batch: input_ids/loss_mask [b, L], lengths [b], features [b, L-1, F] float32 if
    present (F = len(feature_layers) * d: the drafter's declared layers, concatenated).

    Row features may be float (any float dtype) or integers holding bfloat16 bit patterns (a feature
    cache stored with ``dtype=bfloat16``: Arrow has no bf16 type).
    """
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    L = int(lengths.max())
    b = len(rows)
    ids = torch.full((b, L), pad_id, dtype=torch.long)
    mask = torch.zeros((b, L), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"]).long()
        mask[i, :n] = torch.as_tensor(r["loss_mask"]).long()
    batch = {"input_ids": ids, "loss_mask": mask, "lengths": lengths}
    if "features" in rows[0]:
        d = rows[0]["features"].shape[-1]
        feats = torch.zeros((b, max(L - 1, 1), d), dtype=torch.float32)
        for i, r in enumerate(rows):
            f = torch.as_tensor(r["features"])
            if not f.is_floating_point():  # a bfloat16 feature cache stores bf16 bit patterns as int16
                f = f.to(torch.int16).view(torch.bfloat16)
            feats[i, : f.shape[0]] = f.float()
        batch["features"] = feats
    return batch


def epoch_order(n: int, seed: int, epoch: int, lengths: list[int] | None = None, group: int = 0) -> list[int]:
    """Row order of one epoch: a permutation drawn from ``seed`` and ``epoch``.

    With ``lengths`` and ``group`` > 1, every run of ``group`` consecutive rows of the permutation is
    sorted by length, so consecutive micro-batches hold sequences of similar length (less padding)
    while the epoch stays a random order at the scale of groups.
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1_000_003 * epoch)).tolist()
    if lengths is not None and group > 1:
        perm = [i for g in range(0, n, group) for i in sorted(perm[g : g + group], key=lambda r: (lengths[r], r))]
    return perm


def sample_indices(
    global_start: int, count: int, n: int, seed: int, lengths: list[int] | None = None, group: int = 0
) -> list[int]:
    """Dataset rows for global sample positions [global_start, global_start + count).

    The data position of a run is just its sample counter, so resume needs nothing but the step.
    """
    out, orders = [], {}
    for g in range(global_start, global_start + count):
        e = g // n
        if e not in orders:
            orders[e] = epoch_order(n, seed, e, lengths, group)
        out.append(orders[e][g % n])
    return out


def get_batch(ds, target, indices: list[int], device, feature_layers=None) -> dict[str, torch.Tensor]:
    """Collate rows and add the target's features of ``feature_layers`` (default the final post-norm state;
    [b, L-1, len(ids) * d]) when the dataset does not carry them."""
    batch = collate([ds[i] for i in indices])
    batch = {k: v.to(device) for k, v in batch.items()}
    if "features" not in batch:
        attn = (torch.arange(batch["input_ids"].shape[1], device=device)[None] < batch["lengths"][:, None]).long()
        feats = target.features(batch["input_ids"], attention_mask=attn, feature_layers=feature_layers)
        batch["features"] = feats[:, :-1].float()
    return batch
