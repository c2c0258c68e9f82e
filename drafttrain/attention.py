"""Block-sparse (flex) attention masks of the training layouts, from the rules the dense masks come from.

Two ways to mask the same layout (``trainer.attention``):

- ``dense`` (the reference and the fallback): a [b, 1, q, kv] additive float mask for SDPA/eager, built from
  the boolean rule of the layout (:func:`drafttrain.layout.group_rule`, :func:`drafttrain.layout.ttt_rule`);
  b * q * kv * 4 bytes in fp32 (2 in bf16), and SDPA computes every masked-out score.
- ``flex``: a ``torch.nn.attention.flex_attention`` ``BlockMask`` whose ``mask_mod`` calls the *same* rule
  on the query's and the key's slot, so the two can only differ through the kernel. Only the blocks
  (128 x 128 by default) holding an allowed entry are computed; the mask itself is O(b * q * kv / 128^2).

The transformers decoder layers take a ``BlockMask`` as their ``attention_mask`` through transformers'
public ``AttentionInterface``: :func:`flex_attention_forward` is registered as ``"drafttrain_flex"`` and
:func:`implementation_for` sets a layer's ``_attn_implementation`` to it for one call (nothing of a modeling
file is copied or patched). DFlash's own attention calls the same function. It runs
``torch.compile``'d flex attention on CUDA (the block-sparse kernel) and eager flex attention on CPU
(PyTorch's reference: every score computed, then masked; :data:`COMPILE_ON_CPU` switches to the compiled CPU
kernel, as the layout benchmark does).

Platform: PyTorch's flex attention has no backward on CPU (``NotImplementedError`` for any input that
requires grad), so on CPU flex runs forward only (tests compare it with dense under ``torch.no_grad``);
training with ``trainer.attention=flex`` needs CUDA (:func:`check_mode`).

Shape letters: b batch, s layout slots, t items, q queries, kv keys.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from drafttrain import layout as L

MODES = ("dense", "flex")
FLEX = "drafttrain_flex"  # the name flex_attention_forward is registered under in transformers' AttentionInterface
COMPILE_ON_CPU = False  # CPU: eager flex attention (tests) unless set (scripts/bench_layout.py: the compiled kernel)
_compiled: dict[str, Callable] = {}


def check_mode(mode: str, device: torch.device | str, training: bool = True) -> None:
    """Fail early on an attention mode the device cannot run.

    Raises:
        ValueError: ``mode`` not in :data:`MODES`, or ``flex`` for training on a CPU device (flex attention
            has no backward there).
    """
    if mode not in MODES:
        raise ValueError(f"attention must be one of {'|'.join(MODES)}, got {mode!r}")
    if mode == "flex" and training and torch.device(device).type == "cpu":
        raise ValueError("trainer.attention=flex needs a CUDA device: PyTorch's flex attention has no backward on "
                         "CPU (use trainer.attention=dense there)")  # fmt: skip


def is_block_mask(mask) -> bool:
    """True for a flex ``BlockMask`` (False for a dense tensor mask or None)."""
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def block_mask(mask_mod: Callable, batch: int | None, q_len: int, kv_len: int, device) -> "BlockMask":  # noqa: F821
    """``create_block_mask`` over every head (the layouts mask no head differently).

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` tensor.
        batch: b, or None when the mask is the same for every sequence.
        q_len, kv_len: query and key lengths.
        device: where the mask (and the attention) lives.

    Returns:
        a ``BlockMask`` of shape [b or 1, 1, q_len, kv_len].
    """
    from torch.nn.attention.flex_attention import create_block_mask

    # off CPU the mask is built compiled: eager creation evaluates mask_mod on the full [q, kv] grid
    # (int64 intermediates of q x kv entries), the memory the block mask exists to avoid
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device,
                             _compile=torch.device(device).type != "cpu")  # fmt: skip


def group_mask_mod(lay: L.BatchLayout) -> Callable:
    """The ``mask_mod`` of a batch's group-wise layout: :meth:`drafttrain.layout.BatchLayout.allowed` entry by entry
    (:func:`drafttrain.layout.group_rule` on the slots, plus each padding slot's own key)."""
    kind, anchor, group, block = lay.slot_kind, lay.slot_anchor, lay.slot_group, lay.block

    def mask_mod(b, h, q, kv):
        qk = kind[b, q]
        rule = L.group_rule(qk, anchor[b, q], group[b, q], kind[b, kv], anchor[b, kv], group[b, kv], block)
        return rule | ((qk < 0) & (q == kv))

    return mask_mod


def group_block_mask(lay: L.BatchLayout) -> "BlockMask":  # noqa: F821
    """The flex block mask of a collated group-wise layout (:func:`drafttrain.layout.collate_layouts`,
    ``dense=False``): [b, 1, s, s], on the layout's device."""
    b, s = lay.slot_kind.shape
    return block_mask(group_mask_mod(lay), b, s, s, lay.slot_kind.device)


def layout_mask(lay: L.BatchLayout, dtype: torch.dtype):
    """The mask a decoder layer gets for a collated layout: its dense additive mask in ``dtype`` when it has
    one, else its flex block mask (:func:`group_block_mask`)."""
    if lay.attention_mask is not None:
        return lay.attention_mask.to(dtype)
    return group_block_mask(lay)


def ttt_mask_mod(num_items: int, step: int) -> Callable:
    """The ``mask_mod`` of TTT step k (:func:`drafttrain.layout.ttt_step_layout`'s rows): query j against the
    keys of steps 0..k, key c = (c // t, c % t)."""

    def mask_mod(b, h, q, kv):
        return L.ttt_rule(step, q, kv // num_items, kv % num_items)

    return mask_mod


def ttt_block_mask(num_items: int, step: int, device) -> "BlockMask":  # noqa: F821
    """The flex block mask of TTT step k: [1, 1, t, (k + 1) * t] (shared by every sequence of the batch)."""
    return block_mask(ttt_mask_mod(num_items, step), None, num_items, (step + 1) * num_items, device)


def block_layout_mask_mod(item_kind, q_kind, q_anchor, q_group) -> Callable:
    """The ``mask_mod`` of DFlash's batch layout: queries = the block slots [b, Q]; keys = the t items
    (``item_kind`` [b, t]: 0 real, -1 padding; an item's anchor is its index) then the Q block slots.
    :func:`drafttrain.layout.group_rule` with ``block=True``, plus a padding query's own key."""
    t = item_kind.shape[1]

    def mask_mod(b, h, q, kv):
        is_item = kv < t
        ki = kv.clamp(max=t - 1)
        kq = (kv - t).clamp(min=0)
        k_kind = torch.where(is_item, item_kind[b, ki], q_kind[b, kq])
        k_anchor = torch.where(is_item, ki, q_anchor[b, kq])
        k_group = torch.where(is_item, -1, q_group[b, kq])
        qk = q_kind[b, q]
        rule = L.group_rule(qk, q_anchor[b, q], q_group[b, q], k_kind, k_anchor, k_group, True)
        return rule | ((qk < 0) & (kv == q + t))

    return mask_mod


def flex_attention_forward(module, query, key, value, attention_mask, scaling: float | None = None, **kwargs):
    """transformers' attention-function signature over a ``BlockMask``: query [b, h, q, hd], key/value
    [b, h_kv, kv, hd] -> ([b, q, h, hd], None). Compiled flex attention off CPU, eager on CPU (module docstring).

    Raises:
        TypeError: ``attention_mask`` is not a ``BlockMask``.
        NotImplementedError: (PyTorch) on CPU with inputs that require grad.
    """
    from torch.nn.attention.flex_attention import flex_attention

    if not is_block_mask(attention_mask):
        raise TypeError(f"drafttrain_flex needs a BlockMask, got {type(attention_mask).__name__}")
    h, h_kv = query.shape[1], key.shape[1]
    if h != h_kv and (h & (h - 1)) != 0:  # flex's grouped heads want a power-of-two query head count
        key = key.repeat_interleave(h // h_kv, dim=1)
        value = value.repeat_interleave(h // h_kv, dim=1)
    fn = flex_attention
    if query.device.type != "cpu" or COMPILE_ON_CPU:
        fn = _compiled.setdefault("flex", torch.compile(flex_attention))
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FLEX, flex_attention_forward)


@contextmanager
def implementation_for(config, mask):
    """Run a transformers attention module whose ``config`` is given with :func:`flex_attention_forward` while
    ``mask`` is a ``BlockMask`` (its own implementation, sdpa or eager, otherwise); restored on exit."""
    if not is_block_mask(mask):
        yield
        return
    _register()
    old = config._attn_implementation
    config._attn_implementation = FLEX
    try:
        yield
    finally:
        config._attn_implementation = old


def flex_attend(module, q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention of q [b, h, q, hd] over k/v [b, h_kv, kv, hd] with a ``BlockMask`` through
    :func:`flex_attention_forward` (the function the decoder layers call).

    Returns:
        [b, h, q, hd] (the layout ``scaled_dot_product_attention`` returns).
    """
    out, _ = flex_attention_forward(module, q, k, v, mask, scaling=scale)  # [b, q, h, hd]
    return out.transpose(1, 2)


def dense_mask_bytes(batch: int, q_len: int, kv_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a dense additive mask [b, 1, q, kv] in ``dtype`` (4 bytes fp32, 2 bf16): b * q * kv * size."""
    return int(batch) * int(q_len) * int(kv_len) * torch.empty((), dtype=dtype).element_size()
