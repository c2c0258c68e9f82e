"""``trainer.strategy=on_policy|mixed``: the drafter learns from its own drafts, labelled by the frozen target in
one forward through ParallelSpec's group-wise layout.

At every step the current drafter drafts its groups (every anchor a of the training layout, or
``trainer.on_policy.groups_per_row`` of them per row: K + 1 tokens d_0..d_K from the anchor's context, greedy
or sampled at ``trainer.on_policy.temperature``); :func:`label_drafts` runs the target ONCE over the batch, each
row's tokens followed by every labelled group's drafts d_0..d_{K-1} as a parallel group: group slot j of
anchor a holds d_{j-1} at token position a + 1 + j and sees the row's tokens <= a + 1 and slots 1..j of its own
group only (:func:`drafttrain.layout.group_rule`, the rule of the drafter's own training layout, with the
row's tokens as items). The target's post-norm state at slot j is its state after x_0..x_{a+1}, d_0..d_{j-1},
so its LM head is the target's distribution for group position j: the label. The drafter is then trained
on those labels with ``loss.divergence`` (forward KL by default) and its recipe's position weights
(:mod:`drafttrain.drafters.groups`). Correctness (tested): the one-pass states equal a separate target
forward over each anchor's prefix + its drafted continuation, on a tiny target of every family.

Which drafters: those declaring ``"on_policy"`` in ``Drafter.objectives`` (the parallel drafters and DFlash);
validation refuses the others by name with the drafter's ``objective_refusal``.

``mixed``: each micro-batch is on-policy with probability share(step) (``trainer.on_policy.share`` at step 0,
``share_end`` at ``trainer.max_steps``, linear), drawn from (seed, step, micro-batch): the same on resume and
across process counts.

Cost: the labelling forward runs the target over every labelled row's tokens (up to its last labelled
anchor) plus K slots per labelled group, with no KV cache to reuse: per step about one teacher-forced target
forward over the batch, which offline training (stored features) never pays. ``train/label_seconds``
reports it per logged window.
"""

from __future__ import annotations

import time

import torch

from dataclasses import dataclass

from drafttrain import layout as L
from drafttrain.config import GE0, UNIT
from drafttrain.drafters.base import DraftGroups, LossOutput
from drafttrain.strategies.base import TrainingStrategy


@dataclass
class OnPolicyConfig:
    """``trainer.on_policy``: the keys of ``trainer.strategy=on_policy|mixed`` (both strategies read this section)."""

    temperature: float = 0.0  # 0 = greedy drafts (argmax); > 0 = drafts sampled at this temperature
    groups_per_row: int = 8  # parallel groups per training row whose drafts the target labels each step (0 = all)
    share: float = 1.0  # mixed: the share of micro-batches trained on-policy at the first step (on_policy: 1)
    share_end: float | None = None  # mixed: the share at trainer.max_steps, linear in between (null = share throughout)

    numeric_ranges = dict(temperature=GE0, groups_per_row=GE0, share=UNIT, share_end=UNIT)


@torch.no_grad()
def labelling_layout(num_tokens: int, anchors: torch.Tensor, drafts: torch.Tensor):
    """The target's input for one row's labelling pass: its tokens, then every group's drafts.

    Args:
        num_tokens: n, the row's tokens x_0..x_{n-1} kept (n > max anchor + 1).
        anchors: [g] int64 sorted distinct anchor items a (the group's last context token is x_{a+1}).
        drafts: [g, K] int64 the drafts d_0..d_{K-1} of each group, in ``anchors`` order.

    Returns:
        (slot_tokens [s] int64 with s = n + g*K: the row's token ids are left as -1 for the caller to fill,
        position_ids [s] int64, allowed [s, s] bool): :func:`drafttrain.layout.build_group_layout` with the
        tokens as items and anchor token positions a + 1, i.e. group slot j of anchor a at position a + 1 + j,
        seeing tokens <= a + 1 and its own group's slots 1..j.

    Example (n = 3, one group at anchor item 0, so anchor token 1, K = 2); rows are queries::

        slot     x0 x1 x2 d0 d1      position
        x0        1  0  0  0  0      0
        x1        1  1  0  0  0      1
        x2        1  1  1  0  0      2
        d0        1  1  0  1  0      2
        d1        1  1  0  1  1      3
    """
    k = drafts.shape[1]
    lay = L.build_group_layout(torch.zeros(num_tokens, dtype=torch.long, device=anchors.device), anchors + 1, k)
    tokens = torch.cat([torch.full((num_tokens,), -1, dtype=torch.long, device=anchors.device), drafts.reshape(-1)])
    return tokens, lay.position_ids, lay.allowed


@torch.no_grad()
def label_drafts(target, input_ids: torch.Tensor, lengths: torch.Tensor, groups: DraftGroups) -> torch.Tensor:
    """The frozen target's post-norm hidden states at every group's drafted positions, all groups of the batch
    in one target forward (module docstring).

    Args:
        target: the frozen :class:`~drafttrain.target.Target` (its public forward with a 4D additive mask and
            explicit position ids; fp32, autocast off).
        input_ids: [b, L] int64 the batch's right-padded rows; lengths: [b] their lengths.
        groups: rows, anchor items a (a + 1 < the row's length) and drafts [g, K] (target ids).

    Returns:
        [g, K, d] float32: row j - 1 of group g is the target's state after x_0..x_{a+1}, d_0..d_{j-1}; its LM
        head gives the target's distribution of the token at position a + 1 + j (the label of group position j).

    Raises:
        ValueError: an anchor whose context x_{a+1} lies past its row's length, or two groups of one row at
            the same anchor.
    """
    g, k = groups.drafts.shape
    d = target.config.hidden_size
    dev = input_ids.device
    out = torch.zeros((g, k, d), dtype=torch.float32, device=dev)
    if g == 0 or k == 0:
        return out
    seqs = []  # (batch row, group indices in anchor order, n tokens, tokens, positions, allowed)
    for r in groups.row.unique().tolist():
        gi = torch.nonzero(groups.row == r).flatten()
        gi = gi[groups.anchor[gi].argsort()]
        anchors = groups.anchor[gi]
        if anchors.unique().numel() != anchors.numel():
            raise ValueError(f"row {r}: two groups share an anchor ({anchors.tolist()})")
        n = int(anchors.max()) + 2  # tokens x_0..x_{a+1} of the last anchor
        if n > int(lengths[r]):
            raise ValueError(f"row {r}: anchor {int(anchors.max())} needs {n} tokens, the row has {int(lengths[r])}")
        tokens, pos, allowed = labelling_layout(n, anchors, groups.drafts[gi])
        tokens[:n] = input_ids[r, :n]
        seqs.append((gi, n, tokens, pos, allowed))
    s_max = max(t.numel() for _, _, t, _, _ in seqs)
    b = len(seqs)
    ids = torch.zeros((b, s_max), dtype=torch.long, device=dev)
    pos = torch.zeros((b, s_max), dtype=torch.long, device=dev)
    allowed = torch.eye(s_max, dtype=torch.bool, device=dev).repeat(b, 1, 1)  # padding slots see themselves only
    for i, (_, _, t, p, a) in enumerate(seqs):
        s = t.numel()
        ids[i, :s], pos[i, :s] = t, p
        allowed[i, :s, :s] = a
    dtype = target.lm_head.weight.dtype
    with torch.autocast(device_type=dev.type, enabled=False):
        hidden = target.forward(ids, attention_mask=L.additive_mask(allowed, dtype)[:, None], position_ids=pos,
                                with_logits=False).hidden  # [b, s, d]
    for i, (gi, n, _, _, _) in enumerate(seqs):
        out[gi] = hidden[i, n : n + gi.numel() * k].float().view(gi.numel(), k, d)
    return out


class OnPolicyStrategy(TrainingStrategy):
    """Every micro-batch on-policy: the drafter's own drafts, labelled by the target (module docstring)."""

    name = "on_policy"
    requires = {"on_policy": "cannot train on its own drafts"}
    config = OnPolicyConfig
    config_section = "on_policy"

    def __init__(self, c, target, feature_layers):
        super().__init__(c, target, feature_layers)
        self._label_seconds, self._labelled = 0.0, 0

    def on_policy_share(self, step: int) -> float:
        """The probability that micro-batches of optimizer step ``step`` are on-policy (1 here)."""
        return 1.0

    def _coin(self, step: int, micro: int) -> bool:
        share = self.on_policy_share(step)
        if share >= 1.0:
            return True
        if share <= 0.0:
            return False
        gen = torch.Generator().manual_seed(self.c.seed * 7_368_787 + step * 2_003 + micro * 17 + 5)
        return bool(torch.rand((), generator=gen) < share)

    #: the metric sums an on-policy micro-batch adds (zeros on an offline one, so that every micro-batch and
    #: every rank reduce the same keys)
    POLICY_SUMS = ("policy_groups", "policy_agree_num", "policy_agree_den")

    def loss(self, drafter, batch, generator, step: int, micro: int) -> LossOutput:
        if not self._coin(step, micro):
            out = drafter(batch, generator, self.objective())
            dev = out.loss.device
            out.sums.update({k: torch.zeros((), device=dev) for k in self.POLICY_SUMS})
            return out
        ids, lengths = batch["input_ids"], batch["lengths"]

        def labeller(groups: DraftGroups) -> torch.Tensor:
            t0 = time.perf_counter()
            out = label_drafts(self.target, ids, lengths, groups)
            self._label_seconds += time.perf_counter() - t0
            return out

        op = self.options
        self._labelled += 1
        return drafter(batch, generator, self.objective(labeller=labeller, temperature=op.temperature,
                                                        groups_per_row=op.groups_per_row))  # fmt: skip

    def window_metrics(self) -> dict[str, float]:
        out = {"train/label_seconds": self._label_seconds, "train/on_policy_micro_batches": float(self._labelled)}
        self._label_seconds, self._labelled = 0.0, 0
        return out


class MixedStrategy(OnPolicyStrategy):
    """A share of the micro-batches on-policy, the rest offline: share(step) from ``trainer.on_policy.share`` to
    ``share_end`` over ``trainer.max_steps`` (linear; constant when ``share_end`` is null)."""

    name = "mixed"

    def on_policy_share(self, step: int) -> float:
        op = self.options
        if op.share_end is None:
            return float(op.share)
        frac = min(1.0, step / max(1, self.c.trainer.max_steps))
        return float(op.share) + (float(op.share_end) - float(op.share)) * frac
