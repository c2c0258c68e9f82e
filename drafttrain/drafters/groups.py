"""Parallel groups of a training layout as [g, P] slot tables, and the two objectives that act on whole groups:
on-policy labels for the drafter's own drafts, and Spec-AUF's cut after a group's first miss.

A group is an anchor item a and the P - 1 slots that draft after it (ParallelSpec: the anchor item and its
K [MASK] slots, P = K + 1; DFlash: the B - 1 drafted slots of a block). Group position k guesses the token
x_{a+k+2} (the item label y_{a+k}). A drafter that trains on such groups hands this module its hidden states
and the dense per-slot tables of its batch ([b, s]: labels, the target's post-norm features whose LM head is
each slot's label distribution, and whether the label can be drafted), and gets them back relabelled.

**On-policy labels** (:func:`label_own_drafts`): the drafter drafts every group from its own logits (argmax,
or sampled at a temperature), and the frozen target labels the drafts: position k's label becomes the
target's distribution after x_0..x_{a+1} followed by the drafts d_0..d_{k-1} (one target forward for the whole
batch, through the group-wise layout: ``objective.labeller``). Position 0's label is the offline one (its
context holds no draft). Where every earlier draft equals the offline label and the rows are the target's
own greedy output, the on-policy label equals the offline one; the function counts how often it does
(``policy_agree_*``), which says how much of the on-policy signal is new.

**Spec-AUF's cut** (:func:`cut_weights`): a group's positions after its first predicted miss get
``objective.cut_weight`` (:func:`drafttrain.losses.after_first_miss`).

Shape letters: b batch, s layout slots, g groups, P group positions, K = P - 1, d hidden, N draft vocabulary.
"""

from __future__ import annotations

import torch

from drafttrain.drafters.base import DraftGroups, Objective
from drafttrain.drafters.target_argmax import full_vocab_argmax
from drafttrain.losses import after_first_miss


def choose_groups(row: torch.Tensor, per_row: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """At most ``per_row`` groups of every batch row, drawn at random: [g] row ids -> [g] bool.

    Args:
        row: [g] int64 batch row of each group.
        per_row: groups kept per row (0 = all).
        generator: CPU torch RNG for the draw (deterministic given its seed).
    """
    keep = torch.ones_like(row, dtype=torch.bool)
    if per_row <= 0 or row.numel() == 0:
        return keep
    keys = torch.rand(row.numel(), generator=generator).to(row.device)
    for r in row.unique():
        idx = torch.nonzero(row == r).flatten()
        if idx.numel() > per_row:
            drop = idx[keys[idx].argsort()[per_row:]]
            keep[drop] = False
    return keep


def pick_drafts(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draft ids from the drafter's logits: argmax (temperature 0) or a sample of softmax(logits / T).

    Args:
        logits: [..., N] float logits over the draft vocabulary.
        temperature: T >= 0.
        generator: CPU torch RNG for the samples.

    Returns:
        [...] int64 draft ids.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1]).cpu()
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1]).to(logits.device)


@torch.no_grad()
def label_own_drafts(drafter, hidden: torch.Tensor, row: torch.Tensor, slots: torch.Tensor, anchor: torch.Tensor,
                     labels: torch.Tensor, valid: torch.Tensor, final: torch.Tensor, scored: torch.Tensor,
                     objective: Objective, generator: torch.Generator | None = None,
                     logits_fn=None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Replace the labels of positions 1..P-1 of (a sample of) the groups by the target's labels of the
    drafter's own drafts (module docstring), in place.

    Args:
        drafter: the drafter (its ``vocab_logits``, ``draft_token_ids``, ``t2d`` and shared LM head).
        hidden: [b, s, d] the drafter's hidden states over the layout (read detached).
        row: [g] int64 batch row of each group; slots: [g, P] int64 the layout slot of each group position.
        anchor: [g] int64 anchor item of each group.
        labels: [b, s] int64 target-id labels (-100 = none), relabelled in place.
        valid: [b, s] bool, the slot has a label (unchanged: on-policy labels only replace existing ones).
        final: [b, s, d] the target's post-norm features of each slot's label distribution, replaced in place.
        scored: [b, s] bool, the label's full-vocabulary argmax is a draft id, replaced in place.
        objective: its ``labeller``, ``temperature`` and ``groups_per_row``.
        generator: CPU torch RNG (group sample, sampled drafts).
        logits_fn: hidden [.., d] -> draft-vocabulary logits [.., N] (default ``drafter.vocab_logits``).

    Returns:
        sums: ``policy_groups`` (groups labelled), ``policy_agree_num`` / ``policy_agree_den`` (labelled
        positions whose earlier drafts all equal the offline labels: how many of them keep the offline label).
    """
    dev = labels.device
    zero = torch.zeros((), device=dev)
    p = slots.shape[1]
    if row.numel() == 0 or p < 2:
        return {"policy_groups": zero, "policy_agree_num": zero.clone(), "policy_agree_den": zero.clone()}
    k = p - 1
    chosen = choose_groups(row, objective.groups_per_row, generator)
    chosen &= valid[row[:, None], slots[:, 1:]].any(1)  # only groups with a label to replace
    r, sl, a = row[chosen], slots[chosen], anchor[chosen]
    g = r.numel()
    if g == 0:
        return {"policy_groups": zero, "policy_agree_num": zero.clone(), "policy_agree_den": zero.clone()}
    logits_fn = logits_fn or drafter.vocab_logits
    lg = logits_fn(hidden[r[:, None], sl].detach())  # [g, P, N]
    drafts = drafter.draft_token_ids.to(dev)[pick_drafts(lg, objective.temperature, generator)]  # [g, P] target ids
    feats = objective.labeller(DraftGroups(row=r, anchor=a, drafts=drafts[:, :k]))  # [g, K, d]
    d = feats.shape[-1]
    top = full_vocab_argmax(drafter.shared.lm_head, feats.reshape(-1, d).to(final.dtype)).view(g, k)  # [g, K]
    tgt = sl[:, 1:]  # [g, K] the slots of positions 1..K
    v = valid[r[:, None], tgt]
    old = labels[r[:, None], tgt]
    same = drafts[:, :k] == labels[r[:, None], sl[:, :k]]  # draft j == offline label of position j
    prefix_ok = torch.cumprod(same.long(), dim=1).bool()  # drafts 0..j-1 all equal: position j+1's context is offline
    agree_den = (v & prefix_ok).float().sum()
    agree_num = (v & prefix_ok & (top == old)).float().sum()
    labels[r[:, None], tgt] = torch.where(v, top, old)
    final[r[:, None], tgt] = torch.where(v[..., None], feats.to(final.dtype), final[r[:, None], tgt])
    scored[r[:, None], tgt] = torch.where(v, drafter.t2d.to(dev)[top], scored[r[:, None], tgt])
    return {"policy_groups": torch.tensor(float(g), device=dev), "policy_agree_num": agree_num,
            "policy_agree_den": agree_den}  # fmt: skip


def cut_weights(row: torch.Tensor, slots: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor,
                scored: torch.Tensor, cut_weight: float) -> torch.Tensor:  # fmt: skip
    """Spec-AUF's per-slot weights over a layout: ``cut_weight`` at a group's positions after its first predicted
    miss (:func:`drafttrain.losses.after_first_miss`), 1 elsewhere (slots in no group too).

    Args:
        row: [g] int64; slots: [g, P] int64 (the group tables).
        correct, valid, scored: [b, s] bool per slot (argmax == label, has a label, label can be drafted).
        cut_weight: weight of the cut slots.

    Returns:
        [b, s] float32 weights.
    """
    w = torch.ones(correct.shape, dtype=torch.float32, device=correct.device)
    if row.numel():
        rr = row[:, None]
        cut = after_first_miss(correct[rr, slots], valid[rr, slots], scored[rr, slots])
        w[rr, slots] = torch.where(cut, torch.full_like(w[rr, slots], float(cut_weight)), w[rr, slots])
    return w


def parallel_group_slots(slot_kind: torch.Tensor, slot_anchor: torch.Tensor, num_items: torch.Tensor,
                         k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The group tables of ParallelSpec's batch layout (items first, then K mask slots per anchor).

    Args:
        slot_kind, slot_anchor: [b, s] int64 (:class:`~drafttrain.layout.BatchLayout`); num_items: [b] int64 t.
        k: K mask slots per group.

    Returns:
        (row [g] int64, slots [g, K + 1] int64): slot 0 is the anchor item (its slot index is the item index),
        slot j the group's mask slot j.
    """
    rows, tables = [], []
    for i in range(slot_kind.shape[0]):
        t = int(num_items[i])
        n = int((slot_kind[i] > 0).sum()) // k if k else 0
        if n == 0:
            continue
        masks = torch.arange(t, t + n * k, device=slot_kind.device).view(n, k)
        anchors = slot_anchor[i, t : t + n * k : k]
        tables.append(torch.cat([anchors[:, None], masks], dim=1))
        rows.append(torch.full((n,), i, dtype=torch.long, device=slot_kind.device))
    if not rows:
        return (torch.zeros(0, dtype=torch.long, device=slot_kind.device),
                torch.zeros((0, k + 1), dtype=torch.long, device=slot_kind.device))  # fmt: skip
    return torch.cat(rows), torch.cat(tables)
