"""Cheap verification on CPU: the frozen target's linear layers on oneDNN prepacked weights.

Why (measured, docs/benchmarks/forward_cost.md): on the CPU wheel of torch, ``F.linear`` goes to MKL
sgemm, whose small-M path makes a forward of 2-9 tokens cost 1.7-2.5x a one-token forward although
both read the same 538 MB of weights once (the memory roofline says ~1.0x). oneDNN's inner-product
primitive on a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``
+ ``torch.ops.mkldnn._linear_pointwise``, what ``torch.compile``'s freezing pass emits on CPU) has no
such penalty: a tree verification forward then costs about what a plain decoding step does, which is
what speculative decoding needs to pay (issue 16, PLATFORM.md "CPU matmul regime").

How: :func:`pack_linears` swaps every ``nn.Linear`` of a loaded, frozen model (the LM head included)
for a :class:`PackedLinear` from outside, the way quantization libraries do; no modeling file is
touched. A ``PackedLinear`` *is* an ``nn.Linear`` holding the very same ``weight`` / ``bias``
parameters (tied embeddings stay tied, ``state_dict`` is unchanged, drafters that share the target's
LM head by reference keep reading ``lm_head.weight``), plus a prepacked copy used only for inference:
whenever autograd needs the op (grad mode on and the input or weight requires grad), or the input is
not a float32 CPU tensor, it falls back to ``F.linear``. A weight changed in place (``load_state_dict``,
``.to``) is repacked on the next call. Cost: one more copy of the weights in memory (538 MB for
SmolLM2-135M).

Numerics: same fp32 weights and inputs, different summation order: outputs differ from ``F.linear``
by float reassociation only (max |diff| ~1e-6 relative; greedy outputs unchanged on the tests' and
the benchmark's prompts).

Shape letters: m rows (any leading dims), i in_features, o out_features.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")


def available() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its prepacked-linear ops."""
    try:
        return bool(
            torch._C._has_mkldnn
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs on a oneDNN prepacked copy of its weight when nothing needs gradients.

    Built from an existing layer (:meth:`from_linear`); ``weight`` and ``bias`` are that layer's own
    ``Parameter`` objects (shared, not copied). ``forward(x)``: x [..., i] -> [..., o], equal to
    ``F.linear(x, weight, bias)`` up to float reassociation.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight  # the same Parameter: tied weights and shared references stay valid
        new.bias = linear.bias
        new.__dict__["_packed"] = None  # (key, packed weight); not a buffer: never saved, never moved
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` on the same parameters (undoes :func:`pack_linears` for this layer)."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def _key(self) -> tuple:
        w, b = self.weight, self.bias
        return (w.data_ptr(), w._version, w.dtype, w.device, None if b is None else (b.data_ptr(), b._version))

    def packed_weight(self) -> torch.Tensor:
        """The prepacked (opaque oneDNN layout) weight [o, i], rebuilt when ``weight`` changed."""
        key = self._key()
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous())
            self.__dict__["_packed"] = cached = (key, packed)
        return cached[1]

    def _usable(self, x: torch.Tensor) -> bool:
        w = self.weight
        if x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu" or w.device.type != "cpu":
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside torch.compile the opaque packed weight cannot be lowered (inductor raises LoweringException);
        # F.linear there lets inductor's freezing pass pack the weight itself (docs/benchmarks/compile.md).
        if torch.compiler.is_compiling() or not self._usable(x) or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        b = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), b, "none", [], "")

    def __deepcopy__(self, memo):  # the opaque packed tensor does not deep-copy: copy the layer, repack lazily
        import copy

        new = self.to_linear()
        new.weight = copy.deepcopy(self.weight, memo)
        new.bias = copy.deepcopy(self.bias, memo)
        return PackedLinear.from_linear(new)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packed"] = None
        return state

    def extra_repr(self) -> str:
        return super().extra_repr() + ", packed=oneDNN"


def resolve(mode: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``target.fast_linear=mode`` packs the target on ``device`` / ``dtype``.

    ``auto``: on for float32 on CPU when oneDNN is available (:func:`available`); ``on``: the same,
    but an error where it cannot apply; ``off``: never.

    Raises:
        ValueError: an unknown mode, or ``on`` where packing cannot apply (not CPU, not float32, no oneDNN).
    """
    if mode not in MODES:
        raise ValueError(f"target.fast_linear must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return False
    ok_dev, ok_dtype, ok_lib = torch.device(device).type == "cpu", dtype == torch.float32, available()
    if mode == "on" and not (ok_dev and ok_dtype and ok_lib):
        why = "no oneDNN in this torch build" if not ok_lib else ("the device is not CPU" if not ok_dev else "dtype is not float32")
        raise ValueError(f"target.fast_linear=on cannot apply: {why} (use auto or off)")
    return ok_dev and ok_dtype and ok_lib


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` (recursively, LM head included) by a :class:`PackedLinear`
    sharing its parameters; weights are packed now (not on the first call). Idempotent.

    Returns:
        the number of layers replaced.
    """
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # exact type: subclasses (already packed, quantized, ...) stay as they are
                new = PackedLinear.from_linear(child)
                new.packed_weight()
                setattr(parent, name, new)
                n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears`: every :class:`PackedLinear` becomes a plain ``nn.Linear`` on the same
    parameters. Returns the number of layers restored."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.to_linear())
                n += 1
    return n


def is_packed(model: nn.Module) -> bool:
    """True when some linear layer of ``model`` is a :class:`PackedLinear`."""
    return any(isinstance(m, PackedLinear) for m in model.modules())
