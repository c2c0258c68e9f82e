"""Training-time acceptance metrics (docs/design.md, "Definitions"), as sums and counts that reduce across ranks.

- acc_k: top-1 accuracy at group position k (0 = anchor item, 1..K = mask slots).
- cond_acc_k: the same, counted only over groups whose positions < k were all correct.
- tau_sim: greedy chain estimate 1 + mean(L), L = number of leading correct positions of a group.

Every function returns *sums* (a dict of float tensors) so that the loop can all-reduce them and
divide once: averaging per-rank ratios would weight ranks instead of groups.
"""

from __future__ import annotations

import torch


def group_acceptance_sums(correct: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums behind acc_k, cond_acc_k and tau_sim for a set of parallel groups.

    Args:
        correct: [g, K+1] bool, top-1 == label at each group position.
        valid: [g, K+1] bool, the position has a label. A group counts for tau_sim when its position 0
            is valid; L stops at the first wrong or unlabelled position.

    Returns:
        dict of float tensors: ``acc_num``/``acc_den`` [K+1], ``cond_num``/``cond_den`` [K+1],
        ``tau_len_sum`` and ``tau_groups`` (scalars).

    Example: correct = [[1, 1, 0]], valid all True -> L = 2, tau_sim = 3.
    """
    correct = correct & valid
    prefix_ok = torch.cumprod(correct.long(), dim=1).bool()  # [g, K+1] all positions <= k correct
    before_ok = torch.ones_like(prefix_ok)
    before_ok[:, 1:] = prefix_ok[:, :-1]  # all positions < k correct
    counted = valid[:, 0]
    lead = prefix_ok.long().sum(dim=1)  # [g] L
    return {
        "acc_num": (correct & valid).float().sum(0),
        "acc_den": valid.float().sum(0),
        "cond_num": (correct & valid & before_ok).float().sum(0),
        "cond_den": (valid & before_ok).float().sum(0),
        "tau_len_sum": lead[counted].float().sum(),
        "tau_groups": counted.float().sum(),
    }


def empty_group_sums(num_positions: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The sums of :func:`group_acceptance_sums` over no group (a batch without any labelled group), on
    ``device``: the step's, so :func:`merge_sums` and the all-reduce meet them beside the other steps' sums.

    Returns:
        ``acc_num``/``acc_den``/``cond_num``/``cond_den`` [num_positions] and ``tau_len_sum``/``tau_groups`` []
        float32 zeros.
    """
    z = torch.zeros(num_positions, device=device)
    return {"acc_num": z, "acc_den": z.clone(), "cond_num": z.clone(), "cond_den": z.clone(),
            "tau_len_sum": torch.zeros((), device=device), "tau_groups": torch.zeros((), device=device)}  # fmt: skip


def merge_sums(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Element-wise sum of two sum dicts (``a`` may be None)."""
    if a is None:
        return {k: v.clone() for k, v in b.items()}
    return {k: a[k] + b[k] for k in a}


def finalize(sums: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
    """Turn (already reduced) sums into named metrics: ``{prefix}/acc_k``, ``cond_acc_k``, ``tau_sim``,
    ``loss_k`` (when ``ce_sum``/``ce_count`` are present: mean hard CE at position k), ``kl_k`` (when
    ``kl_sum``/``kl_count`` are present: EAGLE-3's mean KL at TTT step k), ``reg_loss_k``
    (when ``reg_sum``/``reg_count`` are present: EAGLE's mean feature regression loss at position k), and
    on-policy training's ``policy_groups`` (groups labelled by the target) and ``policy_label_agree`` (of the
    labelled positions whose earlier drafts all equal the offline labels, the share whose on-policy label
    equals the offline one)."""
    out: dict[str, float] = {}
    if "acc_num" in sums:
        for k in range(sums["acc_num"].numel()):
            if sums["acc_den"][k] > 0:
                out[f"{prefix}/acc_{k}"] = float(sums["acc_num"][k] / sums["acc_den"][k])
            if sums["cond_den"][k] > 0:
                out[f"{prefix}/cond_acc_{k}"] = float(sums["cond_num"][k] / sums["cond_den"][k])
        if sums["tau_groups"] > 0:
            out[f"{prefix}/tau_sim"] = 1.0 + float(sums["tau_len_sum"] / sums["tau_groups"])
    if "ce_sum" in sums:
        for k in range(sums["ce_sum"].numel()):
            if sums["ce_count"][k] > 0:
                out[f"{prefix}/loss_{k}"] = float(sums["ce_sum"][k] / sums["ce_count"][k])
    if "kl_sum" in sums:
        for k in range(sums["kl_sum"].numel()):
            if sums["kl_count"][k] > 0:
                out[f"{prefix}/kl_{k}"] = float(sums["kl_sum"][k] / sums["kl_count"][k])
    if "reg_sum" in sums:
        for k in range(sums["reg_sum"].numel()):
            if sums["reg_count"][k] > 0:
                out[f"{prefix}/reg_loss_{k}"] = float(sums["reg_sum"][k] / sums["reg_count"][k])
    if "policy_groups" in sums:  # on-policy training (drafttrain.drafters.groups.label_own_drafts)
        out[f"{prefix}/policy_groups"] = float(sums["policy_groups"])
        if sums["policy_agree_den"] > 0:
            out[f"{prefix}/policy_label_agree"] = float(sums["policy_agree_num"] / sums["policy_agree_den"])
    return out
