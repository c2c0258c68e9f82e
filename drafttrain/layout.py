"""ParallelSpec's group-wise parallel layout and its attention masks, as pure functions.

Source: ParallelSpec (Xiao et al.), section 4.1 "Group-wise Parallel Training", Figures 2-3; the layout
is defined in docs/design.md, "Definitions". A parallel group is an anchor item followed by K [MASK] slots.
The paper interleaves ``[x_t, MASK_1..MASK_K]`` groups and masks out "[MASK] tokens from previous
parallel groups"; here the T context items come first and the mask slots of every anchor follow, so
the context is computed once and only the K * |A| slots are extra:

    slot:      0   1   2   3 | 4     5     6     7     8     9     10    11
    input:     u0  u1  u2  u3| m1@0  m2@0  m1@1  m2@1  m1@2  m2@2  m1@3  m2@3
    position:  0   1   2   3 | 1     2     2     3     3     4     4     5
    label:     y0  y1  y2  y3| y1    y2    y2    y3    y3    y4    y4    y5

(T = 4, K = 2, every position an anchor; ``m_j@a`` is mask slot j of anchor a.)

- item i has position id i and attends causally to items <= i;
- mask slot j of anchor a has position id a + j, attends to items <= a and to mask slots 1..j of the
  same anchor, never to another anchor's slots;
- labels: item i -> y_i; mask slot j of anchor a -> y_{a+j}; -100 past the end.

Invariant (tested): the drafter's outputs at the mask slots of anchor a equal its outputs when run at
inference on items <= a followed by the K mask inputs at positions a+1..a+K.

Shape letters: b batch, t context items, k mask tokens (K), n anchors, s = t + n*k layout slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class GroupLayout:
    """One sequence's group-wise layout (all tensors on the same device).

    Attributes:
        anchors: [n] int64, anchor item indices in increasing order.
        slot_kind: [s] int64, 0 for a context item, j in 1..K for mask slot j.
        slot_anchor: [s] int64, the item index for items; the anchor for mask slots.
        position_ids: [s] int64, i for item i; a + j for mask slot j of anchor a.
        labels: [s] int64, y_i for items; y_{a+j} for mask slots; -100 where unavailable.
        allowed: [s, s] bool, True where query slot (row) may attend to key slot (column).
    """

    anchors: torch.Tensor
    slot_kind: torch.Tensor
    slot_anchor: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    allowed: torch.Tensor
    slot_group: torch.Tensor | None = None
    block: bool = False

    @property
    def num_slots(self) -> int:
        return int(self.slot_kind.numel())


def group_rule(q_kind, q_anchor, q_group, k_kind, k_anchor, k_group, block: bool = False) -> torch.Tensor:
    """The attention rule of the group-wise layout: the one source of its dense masks (:func:`build_group_layout`,
    :func:`collate_layouts`, DFlash's batch layout) and of its flex block masks (:mod:`drafttrain.attention`).

    Every argument broadcasts (dense: [s, 1] queries against [1, s] keys; flex: scalars per (query, key)).
    A slot is (kind, anchor, group): kind 0 = context item, j >= 1 = mask slot j (a DFlash block's kind j),
    -1 = padding; anchor = the item index (items) or the group's anchor; group = the group's index in the
    sequence (-1 for items and padding).

    Args:
        q_kind, q_anchor, q_group: int64 tensors of the query slots.
        k_kind, k_anchor, k_group: int64 tensors of the key slots.
        block: DFlash's blocks (mask slots of a group see each other both ways) instead of ParallelSpec's groups.

    Returns:
        bool tensor of the broadcast shape: every real slot sees the items up to its anchor; a mask slot
        also sees mask slots 1..j of its own group (all of them with ``block``); padding sees nothing here
        (the collators give a padding query its own key, so no row is fully masked).
    """
    see_items = (k_kind == 0) & (k_anchor <= q_anchor) & (q_kind >= 0)
    see_masks = (q_group == k_group) & (q_group >= 0) & (q_kind > 0) & (k_kind > 0)
    if not block:
        see_masks = see_masks & (k_kind <= q_kind)
    return see_items | see_masks


def ttt_rule(q_step, q_pos, k_step, k_pos) -> torch.Tensor:
    """The attention rule of EAGLE-3's training-time test: the one source of :func:`ttt_mask`,
    :func:`ttt_step_layout` and the flex block masks of :func:`drafttrain.attention.ttt_block_mask`.

    Slot (step k, position j). A query (k, j) sees the step-0 keys at positions <= j and its own keys of
    steps 1..k at position j. Arguments broadcast (int64 tensors or ints); returns bool.
    """
    return ((k_step == 0) & (k_pos <= q_pos)) | ((k_step >= 1) & (k_step <= q_step) & (k_pos == q_pos))


def select_anchors(
    labels: torch.Tensor,
    num_mask_tokens: int,
    ratio: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose the anchors of the parallel groups.

    Candidates are the items a whose group has at least one mask-slot label (some y_{a+j} != -100,
    j in 1..K); groups without one add nothing to the loss. ``ratio`` = 1 keeps every candidate; a
    smaller ratio keeps ``ceil(ratio * #candidates)`` of them at random (the anchor subsampling of
    docs/design.md that trades coverage for compute).

    Args:
        labels: [t] int64 item labels y_0..y_{t-1} (-100 = no label).
        num_mask_tokens: K >= 0.
        ratio: fraction of candidates kept, in (0, 1].
        generator: torch RNG for the subsample (deterministic given its seed).

    Returns:
        [n] int64 sorted anchor indices.

    Raises:
        ValueError: ratio outside (0, 1] or K < 0.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"anchor ratio must be in (0, 1], got {ratio}")
    if num_mask_tokens < 0:
        raise ValueError(f"num_mask_tokens must be >= 0, got {num_mask_tokens}")
    t = labels.numel()
    if num_mask_tokens == 0 or t == 0:
        return torch.zeros(0, dtype=torch.long, device=labels.device)
    valid = labels != IGNORE_INDEX  # [t]
    has_label = torch.zeros(t, dtype=torch.bool, device=labels.device)
    for j in range(1, min(num_mask_tokens, t - 1) + 1):
        has_label[: t - j] |= valid[j:]  # anchor a sees y_{a+j}
    candidates = torch.nonzero(has_label).flatten()
    return subsample(candidates, ratio, generator)


def subsample(candidates: torch.Tensor, ratio: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Keep ``ceil(ratio * n)`` of n sorted candidate indices at random (all of them when ratio = 1), sorted.

    Args:
        candidates: [n] int64 sorted indices.
        ratio: fraction kept, in (0, 1].
        generator: torch RNG (CPU) for the draw.

    Returns:
        [n'] int64 sorted subset (n' >= 1 when n >= 1).

    Raises:
        ValueError: ratio outside (0, 1].
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"anchor ratio must be in (0, 1], got {ratio}")
    if ratio < 1.0 and candidates.numel() > 0:
        keep = max(1, math.ceil(round(ratio * candidates.numel(), 6)))  # round: 0.07 * 100 is 7.000000000000001
        perm = torch.randperm(candidates.numel(), generator=generator, device="cpu")[:keep]
        candidates = candidates[perm.to(candidates.device)].sort().values
    return candidates


def build_group_layout(labels: torch.Tensor, anchors: torch.Tensor, num_mask_tokens: int,
                       block: bool = False) -> GroupLayout:  # fmt: skip
    """Build the group-wise layout of one sequence of t items (docs/design.md, "Definitions").

    Args:
        labels: [t] int64 item labels y_i (-100 where there is none).
        anchors: [n] int64 anchor indices (each in [0, t)), e.g. from :func:`select_anchors`.
        num_mask_tokens: K.
        block: DFlash's block instead of ParallelSpec's group (DFlash, Chen et al. 2026, section 3: a block of
            B = K + 1 positions drafted by denoising, attended bidirectionally). The group of anchor a is then
            K + 1 slots of kinds 1..K+1: kind 1 holds the token x_{a+1} (the bonus token at inference), kinds
            2..K+1 the [MASK] inputs; slot kind j sits at position a + j (as ParallelSpec's) and is labelled
            with the token *at* its position, x_{a+j} = y_{a+j-2} (kind 1: none, the token is given). Every
            slot of a block sees the items <= a (the context's features, which the block reads as keys only)
            and every slot of its own block, in both directions; never another block.

    Returns:
        :class:`GroupLayout` with s = t + n*K slots (``block``: t + n*(K+1)).

    Example (T = 3, K = 1, anchors [0, 1]); rows are queries, 1 = may attend::

        slots  u0 u1 u2 m1@0 m1@1
        u0      1  0  0   0    0
        u1      1  1  0   0    0
        u2      1  1  1   0    0
        m1@0    1  0  0   1    0
        m1@1    1  1  0   0    1
    """
    device = labels.device
    t = labels.numel()
    k = num_mask_tokens
    n = anchors.numel()
    if n and (int(anchors.min()) < 0 or int(anchors.max()) >= t):
        raise ValueError(f"anchors must lie in [0, {t}), got {anchors.tolist()}")
    g = k + 1 if block else k  # slots per group
    items = torch.arange(t, device=device)
    j = torch.arange(1, g + 1, device=device)  # [g]
    mask_anchor = anchors[:, None].expand(n, g).reshape(-1)  # [n*g]
    mask_kind = j[None, :].expand(n, g).reshape(-1)  # [n*g]
    slot_kind = torch.cat([torch.zeros(t, dtype=torch.long, device=device), mask_kind])  # [s]
    slot_anchor = torch.cat([items, mask_anchor])  # [s]
    position_ids = slot_anchor + slot_kind  # [s]: i for items, a + j for mask slots

    # y index: i for items, a + j for ParallelSpec's mask slots; a + j - 2 for a block's (its own position's
    # token), none for a block's kind-1 slot (the given token)
    target_index = slot_anchor + slot_kind - (2 * (slot_kind > 0).long() if block else 0)
    padded = torch.cat([labels, torch.full((g + 1,), IGNORE_INDEX, dtype=labels.dtype, device=device)])
    slot_labels = padded[target_index.clamp_min(0)]
    if block:
        slot_labels = slot_labels.masked_fill(slot_kind == 1, IGNORE_INDEX)

    # group index of every slot (-1 for items); the mask is the rule of group_rule (flex masks read the same)
    slot_group = torch.cat([torch.full((t,), -1, dtype=torch.long, device=device),
                            torch.arange(n, device=device).repeat_interleave(g)])  # fmt: skip
    allowed = group_rule(slot_kind[:, None], slot_anchor[:, None], slot_group[:, None],
                         slot_kind[None, :], slot_anchor[None, :], slot_group[None, :], block)  # fmt: skip
    return GroupLayout(anchors, slot_kind, slot_anchor, position_ids, slot_labels, allowed, slot_group, block)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean allowed matrix into the additive float mask transformers expects.

    Args:
        allowed: [..., q, kv] bool.
        dtype: the model's floating dtype (build the mask in it: a float32 min cast to bf16 is -inf).

    Returns:
        [..., q, kv] ``dtype``: 0 where allowed, ``torch.finfo(dtype).min`` elsewhere. (Boolean masks
        are silently wrong with eager attention: docs/design.md, "Platform notes".)
    """
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


@dataclass
class BatchLayout:
    """A batch of group layouts right-padded to the longest (tensors [b, ...]).

    Attributes:
        slot_kind, slot_anchor, position_ids, labels: [b, s] int64 (padding: kind -1, label -100).
        attention_mask: [b, 1, s, s] additive float mask, or None when collated with ``dense=False`` (then
            :func:`drafttrain.attention.group_block_mask` builds the flex block mask from the slots).
        num_items: [b] int64 t per sequence.
        slot_group: [b, s] int64 group index of every slot (-1 for items and padding).
        block: DFlash's blocks (:func:`group_rule`).
    """

    slot_kind: torch.Tensor
    slot_anchor: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    num_items: torch.Tensor
    slot_group: torch.Tensor | None = None
    block: bool = False

    def allowed(self) -> torch.Tensor:
        """[b, s, s] bool: :func:`group_rule` over the padded slots, plus each padding slot's own key."""
        kind, anchor, group = self.slot_kind, self.slot_anchor, self.slot_group
        rule = group_rule(kind[:, :, None], anchor[:, :, None], group[:, :, None],
                          kind[:, None, :], anchor[:, None, :], group[:, None, :], self.block)  # fmt: skip
        eye = torch.eye(kind.shape[1], dtype=torch.bool, device=kind.device)
        return rule | (eye & (kind < 0)[:, :, None])


def collate_layouts(layouts: list[GroupLayout], dtype: torch.dtype, dense: bool = True) -> BatchLayout:
    """Right-pad per-sequence layouts to one batch.

    Padding slots attend only to themselves (no fully masked row, which would give NaN under eager),
    are never attended to by real slots, and carry label -100 and kind -1. The mask is
    :meth:`BatchLayout.allowed` (:func:`group_rule` over the padded slots).

    Args:
        layouts: one :class:`GroupLayout` per sequence (all with ``slot_group``, the same ``block``).
        dtype: dtype of the additive mask (the drafter's compute dtype).
        dense: build the [b, 1, s, s] additive mask (b * s * s * dtype bytes); False leaves it None for
            a flex block mask (:func:`drafttrain.attention.group_block_mask`).

    Returns:
        :class:`BatchLayout` with s = max slots over the batch.
    """
    b = len(layouts)
    s = max(lay.num_slots for lay in layouts)
    device = layouts[0].labels.device
    kind = torch.full((b, s), -1, dtype=torch.long, device=device)
    anchor = torch.zeros((b, s), dtype=torch.long, device=device)
    pos = torch.zeros((b, s), dtype=torch.long, device=device)
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long, device=device)
    group = torch.full((b, s), -1, dtype=torch.long, device=device)
    num_items = torch.zeros(b, dtype=torch.long, device=device)
    for i, lay in enumerate(layouts):
        n = lay.num_slots
        kind[i, :n] = lay.slot_kind
        anchor[i, :n] = lay.slot_anchor
        pos[i, :n] = lay.position_ids
        labels[i, :n] = lay.labels
        group[i, :n] = lay.slot_group
        num_items[i] = int((lay.slot_kind == 0).sum())
    out = BatchLayout(kind, anchor, pos, labels, None, num_items, group, bool(layouts[0].block))
    if dense:
        out.attention_mask = additive_mask(out.allowed(), dtype)[:, None]
    return out


def item_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Labels of the drafter items of one sequence: y_i = x_{i+2} where the loss mask is on.

    Item i combines the target feature f_i with the embedding of x_{i+1} (docs/design.md, "Definitions"), so a
    sequence of L tokens has t = L - 1 items and item i must guess x_{i+2}.

    Args:
        input_ids: [L] int64 token ids x_0..x_{L-1}.
        loss_mask: [L] int (1 = the token is one the drafter should learn to propose).

    Returns:
        [L - 1] int64: x_{i+2} where ``loss_mask[i+2]`` is 1, else -100 (always -100 for the last item).

    Example::

        x = [5, 6, 7, 8], mask = [0, 0, 1, 1]  ->  labels = [7, 8, -100]
    """
    L = input_ids.numel()
    labels = torch.full((max(L - 1, 0),), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    if L >= 3:
        nxt = input_ids[2:].long()
        labels[: L - 2] = torch.where(loss_mask[2:].bool(), nxt, torch.full_like(nxt, IGNORE_INDEX))
    return labels


def batch_item_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """:func:`item_labels` of every sequence of a right-padded batch: [b, L] -> [b, L - 1] (-100 past each length).

    Args:
        input_ids: [b, L] int64 right-padded token ids; loss_mask: [b, L]; lengths: [b] real lengths.
    """
    b, length = input_ids.shape
    out = torch.full((b, max(length - 1, 0)), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    for i in range(b):
        n = int(lengths[i])
        y = item_labels(input_ids[i, :n], loss_mask[i, :n])
        out[i, : y.numel()] = y
    return out


def inference_layout(num_items: int, num_mask_tokens: int, dtype: torch.dtype, past: int = 0,
                     device: torch.device | str = "cpu"):
    """Position ids and additive mask of one inference drafting step (ParallelSpec Fig. 2 left).

    The drafter sees ``num_items`` new context items (after ``past`` cached ones) followed by the K
    mask inputs; items are causal, mask slot j sees all items and mask slots 1..j, so every row equals
    the corresponding row of the training layout for the last item as anchor.

    Args:
        num_items: new items in this call (>= 1).
        num_mask_tokens: K.
        dtype: mask dtype.
        past: items already in the drafter's KV cache.
        device: where both tensors are built (the drafter's: no host-to-device copy per step).

    Returns:
        (position_ids [1, q] int64, attention_mask [1, 1, q, past + q] additive float), q = num_items + K.
    """
    q = num_items + num_mask_tokens
    last = past + num_items - 1  # anchor position
    item_pos = torch.arange(past, past + num_items, device=device)
    mask_pos = last + torch.arange(1, num_mask_tokens + 1, device=device)
    position_ids = torch.cat([item_pos, mask_pos])[None]
    kv = past + q
    allowed = torch.zeros(q, kv, dtype=torch.bool, device=device)
    allowed[:, :past] = True
    allowed[:num_items, past : past + num_items] = torch.ones(num_items, num_items, dtype=torch.bool,
                                                              device=device).tril()  # fmt: skip
    allowed[num_items:, past : past + num_items] = True
    allowed[num_items:, past + num_items :] = torch.ones(num_mask_tokens, num_mask_tokens, dtype=torch.bool,
                                                         device=device).tril()  # fmt: skip
    return position_ids, additive_mask(allowed, dtype)[None, None]


def shifted_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """The next ``depth`` item labels of every item: out[..., i, j] = labels[..., i + j] (-100 past the end).

    A chain drafted from item i guesses y_i, y_{i+1}, ..., y_{i+depth-1} (y_i = x_{i+2}): Medusa head
    j + 1 on f_i (Cai et al. 2024: head k predicts x_{t+k+1}) and step j of an EAGLE chain from item i.

    Args:
        labels: [..., t] int64 item labels (:func:`item_labels`, right-padded with -100).
        depth: chain length >= 1.

    Returns:
        [..., t, depth] int64.

    Example::

        labels = [7, 8, -100], depth = 2  ->  [[7, 8], [8, -100], [-100, -100]]
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    t = labels.shape[-1]
    pad = torch.full((*labels.shape[:-1], depth - 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    padded = torch.cat([labels, pad], dim=-1)  # [..., t + depth - 1]
    return padded.unfold(-1, depth, 1)[..., :t, :]  # [..., t, depth]


def chain_rollout_layout(anchors: torch.Tensor, num_items: int, step: int, dtype: torch.dtype):
    """Positions and mask of step j of a batched greedy-chain rollout from every anchor (EAGLE metrics).

    The drafter's KV cache holds the t context items of every sequence (one teacher-forced pass) and
    then, for steps 1..j-1, one slot per anchor (n per step, anchor order). Step j adds one more slot per
    anchor: the item (draft token of step j-1, predicted feature of step j-1). Slot r of step j:
    position a_r + j; attends to items <= a_r and to the slots of anchor r at steps 1..j, never to
    another anchor's slots: exactly what inference drafting from a_r sees after j - 1 chain steps
    (so the rollout's outputs equal :meth:`EagleDrafter.propose`'s, tested). Padding anchors (-1) see
    only their own slots (no fully masked row).

    Args:
        anchors: [b, n] int64 anchor items, right-padded with -1.
        num_items: t, items in the cache before the rollout (the padded batch length).
        step: j >= 1.
        dtype: mask dtype.

    Returns:
        (position_ids [b, n] int64, attention_mask [b, 1, n, t + j*n] additive float).

    Example (b = 1, t = 3, anchors [0, 2], j = 2); columns: items u0 u1 u2, step-1 slots s1@0 s1@2,
    step-2 slots s2@0 s2@2::

                u0 u1 u2 s1@0 s1@2 s2@0 s2@2
        s2@0     1  0  0   1    0    1    0
        s2@2     1  1  1   0    1    0    1
    """
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    b, n = anchors.shape
    device = anchors.device
    cols = torch.arange(num_items, device=device)
    see_items = (cols[None, None, :] <= anchors[:, :, None]) & (anchors[:, :, None] >= 0)  # [b, n, t]
    own = torch.eye(n, dtype=torch.bool, device=device)  # slot r of every step belongs to anchor r
    see_slots = own.repeat(1, step)[None].expand(b, n, n * step)  # [b, n, j*n]
    allowed = torch.cat([see_items, see_slots], dim=-1)
    position_ids = (anchors.clamp_min(0) + step).masked_fill(anchors < 0, 0)
    return position_ids, additive_mask(allowed, dtype)[:, None]


def ttt_mask(num_items: int, num_steps: int) -> torch.Tensor:
    """Allowed matrix of EAGLE-3's training-time test (TTT) unrolled over ``num_steps`` steps (Li et al.
    2025, "EAGLE-3", section 3.2 and Fig. 6).

    Step 0 is the teacher-forced pass over the t items; step k >= 1 adds one more query per position j
    (row j of step k = the chain drafted from item j, at depth k: fed the token x_{j+k+1} and the
    drafter's own output hidden state of step k - 1 at row j). Slot (k, j) sits at index k * t + j and
    has RoPE position j + k (:func:`ttt_step_layout`). A query (k, j) attends to

    - the step-0 keys at positions 0..j (the real context of its chain's anchor), and
    - its own keys of steps 1..k at position j (its chain's earlier speculative items, itself included),

    never to another position's speculative keys: exactly what inference drafting from item j sees after
    k - 1 chain steps (tested against an autoregressive rollout). Example (t = 3, K = 3 steps; rows are
    queries (step, position), 1 = may attend)::

                 s0:0 s0:1 s0:2 | s1:0 s1:1 s1:2 | s2:0 s2:1 s2:2
        s0:0       1    0    0  |   0    0    0  |   0    0    0
        s0:1       1    1    0  |   0    0    0  |   0    0    0
        s0:2       1    1    1  |   0    0    0  |   0    0    0
        s1:0       1    0    0  |   1    0    0  |   0    0    0
        s1:1       1    1    0  |   0    1    0  |   0    0    0
        s1:2       1    1    1  |   0    0    1  |   0    0    0
        s2:0       1    0    0  |   1    0    0  |   1    0    0
        s2:1       1    1    0  |   0    1    0  |   0    1    0
        s2:2       1    1    1  |   0    0    1  |   0    0    1

    Args:
        num_items: t >= 1.
        num_steps: K >= 1 (step 0 included).

    Returns:
        [K * t, K * t] bool.

    Raises:
        ValueError: t < 1 or K < 1.
    """
    if num_items < 1 or num_steps < 1:
        raise ValueError(f"need num_items >= 1 and num_steps >= 1, got {num_items}, {num_steps}")
    idx = torch.arange(num_items * num_steps)
    step, pos = idx // num_items, idx % num_items  # slot (k, j) sits at k * t + j
    return ttt_rule(step[:, None], pos[:, None], step[None, :], pos[None, :])


def ttt_step_layout(num_items: int, step: int, dtype: torch.dtype, dense: bool = True,
                    device: torch.device | str = "cpu"):
    """Position ids and additive mask of TTT step k, run after steps 0..k-1 with their keys in a KV cache.

    The rows of :func:`ttt_mask` for step k (queries (k, 0..t-1)) against the keys of steps 0..k (the
    cache holds steps 0..k-1 in step order, t keys each, then this step's t keys). Shared by every
    sequence of a right-padded batch: a real row j only sees keys at positions <= j, never padding.

    Args:
        num_items: t (the padded batch length of the items).
        step: k >= 0 (0 = the teacher-forced causal pass).
        dtype: mask dtype.
        dense: build the mask; False returns None in its place (the flex block mask of the same rows is
            :func:`drafttrain.attention.ttt_block_mask`).
        device: where the tensors are built (the drafter's: no host-to-device copy per step).

    Returns:
        (position_ids [1, t] int64 = j + k, attention_mask [1, 1, t, (k + 1) * t] additive float, or None).

    Raises:
        ValueError: t < 1 or k < 0.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if num_items < 1:
        raise ValueError(f"need num_items >= 1, got {num_items}")
    position_ids = torch.arange(num_items, device=device)[None] + step
    if not dense:
        return position_ids, None
    q = torch.arange(num_items, device=device)
    kv = torch.arange((step + 1) * num_items, device=device)
    allowed = ttt_rule(step, q[:, None], (kv // num_items)[None, :], (kv % num_items)[None, :])  # [t, (k + 1) * t]
    return position_ids, additive_mask(allowed, dtype)[None, None]
