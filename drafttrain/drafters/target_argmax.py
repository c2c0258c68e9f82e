"""The target's full-vocabulary argmax at every item position of a training row, computed once per row.

EAGLE-3's objective (and the ParallelSpec / P-EAGLE group loss built on it) leaves out every position
whose target argmax, LM head(f_p) over the *full* vocabulary, is not a draft-vocabulary id. That test
needs the whole [v, d] head at every position: on a 49,152-token head it is most of a training step's
arithmetic, and on a 151,936-token head far more than the drafter itself. The argmax depends only on the
row's target features, which are fixed for the run (the target is frozen and the features are stored),
so the training loop pays it once per row, in its first epoch, instead of once per step.

The memo is keyed by the row's token ids plus a checksum of its features (a float64 sum): the same ids
with other features (another target, noise added to the features) never hit an old entry. It holds
target ids (int32), not the in-vocabulary flags, so a new draft vocabulary needs no new entries.
"""

from __future__ import annotations

import hashlib

import torch

#: rows kept at most (int32 per position: 1M positions = 4 MB); beyond it new rows are computed every time
MAX_ROWS = 200_000
#: positions per LM-head matmul (bounds the [chunk, v] float32 logits: 256 x 151,936 = 156 MB)
CHUNK = 256


def full_vocab_argmax(lm_head: torch.nn.Module, final: torch.Tensor) -> torch.Tensor:
    """argmax_v LM head(f): [m, d] target post-norm features -> [m] int64 target ids (chunked over m)."""
    w = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    if not final.shape[0]:
        return torch.zeros(0, dtype=torch.long, device=final.device)
    return torch.cat([torch.nn.functional.linear(c.to(w.dtype), w, bias).argmax(-1) for c in final.split(CHUNK)])


class TargetArgmaxMemo:
    """Per-row memo of the target's full-vocabulary argmax at every item position.

    Call with the batch's ``input_ids`` [b, L] int64, ``lengths`` [b] and the target's post-norm features
    ``final`` [b, t, d] of items 0..t-1 (t = L - 1); returns [b, t] int64 target ids, the argmax of
    LM head(final[i, p]) for p < lengths[i] - 1 and 0 at padding. ``hits`` / ``misses`` count rows.
    """

    def __init__(self, max_rows: int = MAX_ROWS):
        self.max_rows = int(max_rows)
        self.rows: dict[bytes, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(ids: torch.Tensor, final: torch.Tensor) -> bytes:
        """The row's memo key: sha1 of its token ids and of its features' float64 sum."""
        h = hashlib.sha1(ids.detach().cpu().to(torch.int64).numpy().tobytes())
        h.update(repr(float(final.detach().double().sum())).encode())
        return h.digest()

    @torch.no_grad()
    def __call__(self, lm_head: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor,
                 final: torch.Tensor) -> torch.Tensor:  # fmt: skip
        b, t, _ = final.shape
        out = torch.zeros((b, t), dtype=torch.long, device=final.device)
        todo: list[tuple[int, int, bytes]] = []
        for i in range(b):
            n = min(int(lengths[i]) - 1, t)  # items with a feature
            if n <= 0:
                continue
            k = self.key(input_ids[i, : n + 1], final[i, :n])
            hit = self.rows.get(k)
            if hit is not None:
                out[i, :n] = hit.to(out.device, torch.long)
                self.hits += 1
            else:
                todo.append((i, n, k))
        if todo:
            self.misses += len(todo)
            top = full_vocab_argmax(lm_head, torch.cat([final[i, :n] for i, n, _ in todo]))
            at = 0
            for i, n, k in todo:
                out[i, :n] = top[at : at + n]
                if len(self.rows) < self.max_rows:
                    self.rows[k] = top[at : at + n].to("cpu", torch.int32)
                at += n
        return out


def memo_of(drafter) -> TargetArgmaxMemo:
    """The drafter's memo (kept in its ``__dict__``: no module state, never saved with the weights)."""
    memo = drafter.__dict__.get("_target_argmax_memo")
    if memo is None:
        memo = drafter.__dict__["_target_argmax_memo"] = TargetArgmaxMemo()
    return memo
