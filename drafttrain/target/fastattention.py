"""Decode attention on CPU: a few queries per sequence against its KV cache, grouped-query heads read once.

Why (measured, docs/benchmarks/decode_attention.md): a decoding step of b sequences (plain decoding,
the self-distillation generator at batch 64, the steps the speculation planner does not draft) attends
one query per sequence to its cached keys/values. That is a stream over the KV cache, 2 x b x h_kv x T
x hd floats a layer, and at b = 64, T ~ 300 it is as large as the layer's weights. torch's sdpa, as
transformers calls it for grouped-query attention (``pack_gqa``: [b, h_kv, group, hd] queries, or
``enable_gqa``), spends 2-3x that stream on the 2-core CPU. drafttrain's kernel
(``drafttrain/target/csrc/decode_attention.cpp``, AVX2 + FMA, built on first use like the linear kernel of
:mod:`drafttrain.target.fastlinear`) reads each key/value head once for all the query heads of its group. A
verification step is the same stream with a few more queries per sequence (the draft tree's nodes, each
with its own mask row); the kernel takes any number, the engine sends it the batched ones of up to
:data:`MAX_QUERIES` (beyond, its score pass is compute-bound and the grouped matmuls are faster).

Where it runs: :func:`drafttrain.verify.cache.ragged_attention`, the engine's attention, sends every
decoding step, every batched verification step of up to :data:`MAX_QUERIES` queries per sequence and
one sequence's tree (batch 1) of up to :data:`MAX_QUERIES_ONE` here (not a packed prefill, which keeps
sdpa's causal kernel; docs/benchmarks/decode_attention.md has the measurements) when :func:`usable`
says the tensors qualify (float32 CPU, head dim 16/32/64/128, no autograd, not inside
``torch.compile``); anything else keeps sdpa / the grouped matmuls as before. The backend:
``DRAFTTRAIN_DECODE_ATTENTION`` = ``auto`` (default: the kernel where it builds) | ``kernel`` | ``sdpa``
(torch's, as before), read once per process; :func:`use` switches it in-process (benchmarks, tests).
``DRAFTTRAIN_NO_KERNEL=1`` disables it with the linear kernel (:func:`drafttrain.target.fastlinear.host_reason`:
the host checks both kernels share).

Numerics: same fp32 inputs, scores (q . k) * scale + mask, torch's own softmax, weighted sum of values;
differs from sdpa by float reassociation only (~1e-7), and a query's output depends neither on its
batch nor on the other queries of its call (tested bitwise).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch

from drafttrain.target import fastlinear

BACKENDS = ("auto", "kernel", "sdpa")
HEAD_DIMS = (16, 32, 64, 128)
MAX_QUERIES = 2  # queries per sequence the engine sends here (root + one draft); more: the grouped matmuls, faster there
MAX_QUERIES_ONE = 8  # the same for one sequence's tree (batch 1, where the alternative is sdpa, not the grouped matmuls)
_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_forced: str | None = None  # set by use()


@functools.cache
def _module():
    """The built extension, or why it is unavailable (a str). Built once per machine, loaded once per process."""
    reason = fastlinear.host_reason()
    if reason is not None:
        return reason
    return fastlinear.build_extension("drafttrain_decode_attention", _SOURCE, "avx2",
                                      "sdpa (DRAFTTRAIN_DECODE_ATTENTION=sdpa skips the build)")


def available() -> bool:
    """True when the decode-attention kernel is built (or builds now) and loads here."""
    return not isinstance(_module(), str)


def unavailable_reason() -> str | None:
    """Why the decode-attention kernel cannot run here (None when it can)."""
    mod = _module()
    return mod if isinstance(mod, str) else None


@functools.cache
def _configured() -> str:
    mode = os.environ.get("DRAFTTRAIN_DECODE_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"DRAFTTRAIN_DECODE_ATTENTION must be one of {BACKENDS}, got {mode!r}")
    return mode


def backend() -> str:
    """The backend one-query attention uses now: ``kernel`` or ``sdpa``.

    Raises:
        ValueError: ``kernel`` was asked for (environment or :func:`use`) where it cannot run (the message
            says why), or an unknown name in ``DRAFTTRAIN_DECODE_ATTENTION``.
    """
    mode = _forced or _configured()
    if mode == "sdpa":
        return "sdpa"
    if available():
        return "kernel"
    if mode == "kernel":
        raise ValueError(f"decode attention kernel unavailable: {_module()}")
    return "sdpa"


@contextlib.contextmanager
def use(name: str):
    """Run the block with decode attention on ``name`` (``auto`` | ``kernel`` | ``sdpa``), then restore.

    Raises:
        ValueError: an unknown name, or ``kernel`` where it is unavailable.
    """
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"decode attention backend must be one of {BACKENDS}, got {name!r}")
    old, _forced = _forced, name
    try:
        backend()  # fail now, not inside a forward
        yield
    finally:
        _forced = old


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           max_queries: int | None = None) -> bool:
    """True when :func:`decode_attention` applies to these tensors and the backend is the kernel: 1 to
    ``max_queries`` (default :data:`MAX_QUERIES`) queries per sequence, float32 CPU, head dim in :data:`HEAD_DIMS`, query heads a
    multiple of key/value heads, a [b or 1, 1, q or 1, T] float32 mask or none, no autograd, not inside
    ``torch.compile``."""
    limit = MAX_QUERIES if max_queries is None else max_queries
    if query.dim() != 4 or key.dim() != 4 or not 1 <= query.shape[2] <= limit or query.shape[3] not in HEAD_DIMS:
        return False
    if torch.compiler.is_compiling() or backend() != "kernel":
        return False
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (query, key, value)):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    b, h = query.shape[0], query.shape[1]
    if key.shape[0] != b or key.shape[1] == 0 or h % key.shape[1] or key.shape[2] == 0 or value.shape != key.shape:
        return False
    if mask is not None:
        if mask.dtype != torch.float32 or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[3] != key.shape[2]:
            return False
        if mask.shape[2] not in (1, query.shape[2]):
            return False
        if mask.shape[0] not in (1, b):
            return False
    return True


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """softmax((q k^T) * scale + mask) v for a few queries per sequence, grouped-query heads read once.

    Args:
        query: [b, h, q, hd] float32 CPU.
        key, value: [b, h_kv, T, hd] float32 CPU (views into a larger cache are fine), h a multiple of h_kv.
        mask: [b or 1, 1, q or 1, T] additive float32 mask (0 / finfo.min; each query its own row), or None.
        scale: default hd ** -0.5.

    Returns:
        [b, h, q, hd] float32 (sdpa's layout).

    Raises:
        RuntimeError: shapes, dtypes or the head dim the kernel does not take (:func:`usable` checks first),
            or the kernel is unavailable (:func:`available`).
    """
    mod = _module()
    if isinstance(mod, str):
        raise RuntimeError(f"decode attention kernel unavailable: {mod}")
    hd = query.shape[-1]
    q = query if query.stride(-1) == 1 else query.contiguous()
    k = key if key.stride(-1) == 1 else key.contiguous()
    v = value if value.stride(-1) == 1 else value.contiguous()
    m = None if mask is None else (mask if mask.stride(-1) == 1 else mask.contiguous())
    return mod.decode_attention(q, k, v, m, float(hd**-0.5 if scale is None else scale))  # [b, h, q, hd]


__all__ = ["BACKENDS", "HEAD_DIMS", "MAX_QUERIES", "MAX_QUERIES_ONE", "available", "backend", "decode_attention", "unavailable_reason", "usable", "use"]
