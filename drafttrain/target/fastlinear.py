"""Cheap verification on CPU: the frozen target's linear layers on prepacked weights.

Why (measured, docs/benchmarks/forward_cost.md): on the CPU wheel of torch, ``F.linear`` goes to MKL
sgemm, whose small-M path makes a forward of 2-9 tokens cost 1.7-2.5x a one-token forward although
both read the same 538 MB of weights once (the memory roofline says ~1.0x). Two backends fix it, both
on a weight reordered once:

- ``kernel`` (the default where it builds): drafttrain's own AVX2/FMA register-blocked GEMM micro-kernel
  (``drafttrain/target/csrc/small_m_linear.cpp``, built on first use with ``torch.utils.cpp_extension``, cached
  in torch's extension folder; on AVX-512 CPUs built with -mavx512vl, whose 32 registers allow larger
  tiles: 10-20% less time at 5-17 rows, :func:`kernel_isa`). On the 2-core AMD EPYC machines it reads the weights near the memory
  bandwidth at 1-3 rows and stays compute-efficient at 4-64 rows, where MKL and oneDNN are 1.5-3x
  slower; it also beats MKL on prefill-sized products. Every output row is one in-order FMA chain, so
  a row's result is bitwise the same alone or in any batch (batch invariance).
- ``onednn``: oneDNN's inner-product primitive on its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``torch.ops.mkldnn._linear_pointwise``, what
  ``torch.compile``'s freezing pass emits on CPU): the fallback where the kernel cannot be built
  (no AVX2/FMA, not x86-64, no C++ compiler or ninja).

How: :func:`pack_linears` swaps every ``nn.Linear`` of a loaded, frozen model (the LM head included)
for a :class:`PackedLinear` from outside, the way quantization libraries do; no modeling file is
touched. A ``PackedLinear`` *is* an ``nn.Linear`` holding the very same ``weight`` / ``bias``
parameters (tied embeddings stay tied, ``state_dict`` is unchanged, drafters that share the target's
LM head by reference keep reading ``lm_head.weight``), plus a prepacked copy used only for inference:
whenever autograd needs the op (grad mode on and the input or weight requires grad), the input is not
a float32 CPU tensor, or the code runs inside ``torch.compile``, it falls back to ``F.linear``. A weight
changed in place (``load_state_dict``, ``.to``) is repacked on the next call. Cost: one more copy of
the weights in memory (538 MB for SmolLM2-135M).

Numerics: same fp32 weights and inputs, different summation order: outputs differ from ``F.linear``
by float reassociation only (max |diff| ~1e-6 relative; greedy outputs unchanged on the tests' and
the benchmark's prompts).

Shape letters: m rows (any leading dims), i in_features, o out_features.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain.config import FAST_LINEAR_MODES as MODES  # auto | on | off | kernel | onednn

log = logging.getLogger(__name__)

BACKENDS = ("kernel", "onednn")
_KERNEL_SOURCE = Path(__file__).parent / "csrc" / "small_m_linear.cpp"


def onednn_available() -> bool:
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


KERNEL_ISAS = ("avx2", "avx512")


def cpu_capability() -> str:
    """torch's CPU capability in capitals (``AVX512``, ``AVX2``, ``DEFAULT``, ...; "" where torch cannot tell):
    what decides the kernel build (:func:`kernel_isa`), and recorded with each run (``launch.json``)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except (AttributeError, RuntimeError):
        return ""


def kernel_isa() -> str | None:
    """The kernel build this machine gets: ``avx512`` where torch reports AVX-512 (its AVX512 capability
    implies AVX-512F/BW/VL/DQ), else ``avx2`` where it reports AVX2, else None. ``DRAFTTRAIN_KERNEL_ISA=avx2``
    forces the AVX2 build on an AVX-512 machine (benchmarks compare the two); asking for ``avx512`` where
    the CPU lacks it gives None (the kernel is then unavailable, with the reason)."""
    cap = cpu_capability()
    native = "avx512" if cap.startswith("AVX512") else ("avx2" if cap.startswith("AVX2") else None)
    forced = os.environ.get("DRAFTTRAIN_KERNEL_ISA", "").strip().lower()
    if not forced:
        return native
    if forced not in KERNEL_ISAS:
        raise ValueError(f"DRAFTTRAIN_KERNEL_ISA must be one of {KERNEL_ISAS}, got {forced!r}")
    if native is None or (forced == "avx512" and native != "avx512"):
        return None
    return forced


ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl"]}


def extension_dir(name: str) -> Path:
    """torch's build folder of extension ``name``: ``$TORCH_EXTENSIONS_DIR/name``, else its per-Python default."""
    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is not None:
        return Path(get(name, verbose=False))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / name


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold drafttrain's lock of one extension's build folder for the block: an ``fcntl`` lock on
    ``drafttrain-build.flock``, which the kernel releases when its holder dies (a SIGKILL included). Inside it no
    other drafttrain process is building, so a ``lock`` file of torch's own (``FileBaton``: a plain file that a
    killed build leaves behind, and that torch's next build waits on forever) belongs to no live build: it is
    removed, with a warning naming it."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "drafttrain-build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # waits while a live drafttrain process builds; never for a dead one
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s: torch's extension build lock, left by a build that was killed (no "
                            "drafttrain process is building it now)", stale)  # fmt: skip
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_extension(name: str, source: Path, isa: str, fallback: str):
    """Build (once per machine: torch's extension folder, ``TORCH_EXTENSIONS_DIR``) and load one of
    drafttrain's C++ CPU kernels (``drafttrain/target/csrc``) with ``isa``'s flags (:data:`ISA_FLAGS`), or return
    why it did not build (a str; logged as a warning naming ``fallback``, what runs instead). Shared by the
    linear kernel and :mod:`drafttrain.target.fastattention`. Under :func:`build_lock`: a build killed earlier
    never blocks this one."""
    try:
        from torch.utils import cpp_extension

        log.info("building drafttrain's %s kernel %s (once per machine, under a minute)", isa.upper(), name)
        with build_lock(extension_dir(name)):
            return cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=["-O3", *ISA_FLAGS[isa], "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:  # no compiler / ninja / headers: fall back, say why (once per process)
        why = f"the kernel did not build: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("%s: %s; falling back to %s", name, why, fallback)
        return why


@functools.cache
def _kernel_build(isa: str):
    """The linear kernel extension built for ``isa`` (``avx2`` | ``avx512``), or why it did not build (a str).
    Built once per machine and ISA (~40 s on 2 cores), loaded once per process. The same source serves
    both: the AVX-512 build is compiled with -mavx512vl, which gives the compiler 32 ymm registers and
    the source larger tiles (``small_m_linear.cpp``). Where it does not build, the target's linears fall
    back to oneDNN (``target.fast_linear=onednn`` skips the build)."""
    return build_extension("drafttrain_small_m_linear" + ("" if isa == "avx2" else "_" + isa), _KERNEL_SOURCE, isa,
                           "oneDNN (target.fast_linear=onednn skips the build)")


def host_reason() -> str | None:
    """Why none of drafttrain's C++ kernels (``drafttrain/target/csrc``: the linear kernel, the decode attention)
    can run on this host, before any build: ``DRAFTTRAIN_NO_KERNEL`` set, not x86-64, or no AVX2/FMA (or
    not the ISA ``DRAFTTRAIN_KERNEL_ISA`` asks for: :func:`kernel_isa`); None when they may."""
    if os.environ.get("DRAFTTRAIN_NO_KERNEL"):
        return "DRAFTTRAIN_NO_KERNEL is set"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    if kernel_isa() is None:
        return f"this CPU has no AVX2/FMA (or not the ISA DRAFTTRAIN_KERNEL_ISA asks for; torch reports {cpu_capability()!r})"
    return None


@functools.cache
def _kernel_module():
    """The built kernel extension for this machine (:func:`kernel_isa`), or the reason it is unavailable (a str).
    Decided once per process (the environment variables are read at the first call)."""
    reason = host_reason()
    if reason is not None:
        return reason
    isa = kernel_isa()
    mod = _kernel_build(isa)
    if isinstance(mod, str) and isa == "avx512":  # e.g. a compiler without -mavx512vl: the AVX2 build still runs here
        fallback = _kernel_build("avx2")
        if not isinstance(fallback, str):
            log.warning("fast_linear: the AVX-512 build failed (%s); using the AVX2 build", mod)
            return fallback
    return mod


def kernel_available() -> bool:
    """True when drafttrain's kernel (its AVX2 or AVX-512 build, :func:`kernel_isa`) is built (or builds now)
    and loads on this machine."""
    mod = _kernel_module()
    if isinstance(mod, str):
        log.debug("fast_linear kernel unavailable: %s", mod)
        return False
    return True


def kernel_unavailable_reason() -> str | None:
    """Why the kernel backend cannot be used here (None when it can)."""
    mod = _kernel_module()
    return mod if isinstance(mod, str) else None


def available(backend: str | None = None) -> bool:
    """True when ``backend`` (``kernel`` | ``onednn``; None: either) can run here."""
    if backend is None:
        return kernel_available() or onednn_available()
    if backend == "kernel":
        return kernel_available()
    if backend == "onednn":
        return onednn_available()
    raise ValueError(f"unknown fast_linear backend {backend!r}; expected one of {BACKENDS}")


def best_backend() -> str | None:
    """The fastest backend available here: ``kernel``, else ``onednn``, else None."""
    return "kernel" if kernel_available() else ("onednn" if onednn_available() else None)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs on a prepacked copy of its weight (``backend``: ``kernel`` or ``onednn``)
    when nothing needs gradients.

    Built from an existing layer (:meth:`from_linear`); ``weight`` and ``bias`` are that layer's own
    ``Parameter`` objects (shared, not copied). ``forward(x)``: x [..., i] float32 -> [..., o] float32,
    equal to ``F.linear(x, weight, bias)`` up to float reassociation.
    """

    backend: str = "onednn"

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str | None = None) -> "PackedLinear":
        """Wrap ``linear`` (its parameters shared). ``backend``: None = :func:`best_backend`.

        Raises:
            ValueError: an unknown backend, or one that is not available here.
        """
        backend = backend or best_backend()
        if backend not in BACKENDS or not available(backend):
            raise ValueError(f"fast_linear backend {backend!r} is not available here (choose from {BACKENDS})")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight  # the same Parameter: tied weights and shared references stay valid
        new.bias = linear.bias
        new.__dict__["_packed"] = None  # (key, packed weight); not a buffer: never saved, never moved
        new.__dict__["backend"] = backend
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
        """The prepacked weight, rebuilt when ``weight`` changed: the kernel's [ceil(o/96)*12, i, 8]
        float32 layout, or oneDNN's opaque [o, i] one."""
        key = self._key()
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                w = self.weight.detach().contiguous()
                if self.backend == "kernel":
                    packed = self._kernel().pack(w)
                else:
                    packed = torch.ops.mkldnn._reorder_linear_weight(w)
            self.__dict__["_packed"] = cached = (key, packed)
        return cached[1]

    def _kernel(self):
        """The kernel extension this layer runs on: this machine's build (:func:`kernel_isa`)."""
        return _kernel_module()

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
        if self.backend == "kernel":
            return self._kernel().linear(x, self.packed_weight(), self.out_features, b)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), b, "none", [], "")

    def __deepcopy__(self, memo):  # the opaque packed tensor does not deep-copy: copy the layer, repack lazily
        import copy

        new = self.to_linear()
        new.weight = copy.deepcopy(self.weight, memo)
        new.bias = copy.deepcopy(self.bias, memo)
        return PackedLinear.from_linear(new, self.backend)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packed"] = None
        return state

    def extra_repr(self) -> str:
        return super().extra_repr() + f", packed={self.backend}"


def resolve(mode: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """The backend ``target.fast_linear=mode`` packs the target with on ``device`` / ``dtype``, or None.

    ``auto``: for float32 on CPU, the best available backend (:func:`best_backend`: the kernel, else
    oneDNN), else None; ``on``: the same, but an error where none applies; ``kernel`` / ``onednn``:
    that backend, an error where it cannot apply; ``off``: None.

    Raises:
        ValueError: an unknown mode, or ``on`` / a named backend where it cannot apply (not CPU, not
            float32, the backend unavailable; the message says which and why).
    """
    if mode not in MODES:
        raise ValueError(f"target.fast_linear must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return None
    ok_dev, ok_dtype = torch.device(device).type == "cpu", dtype == torch.float32
    if not (ok_dev and ok_dtype):
        if mode == "auto":
            return None
        raise ValueError(f"target.fast_linear={mode} cannot apply: {'the device is not CPU' if not ok_dev else 'dtype is not float32'} (use auto or off)")
    backend = best_backend() if mode in ("auto", "on") else mode
    if backend is None or not available(backend):
        if mode == "auto":
            return None
        why = kernel_unavailable_reason() if backend == "kernel" else "no oneDNN in this torch build"
        raise ValueError(f"target.fast_linear={mode} cannot apply: {why} (use auto or off)")
    return backend


def pack_linears(model: nn.Module, backend: str | None = None) -> int:
    """Replace every ``nn.Linear`` in ``model`` (recursively, LM head included) by a :class:`PackedLinear`
    on ``backend`` (None: :func:`best_backend`) sharing its parameters; weights are packed now (not on
    the first call). Idempotent: layers already packed keep their backend.

    Returns:
        the number of layers replaced.

    Raises:
        ValueError: ``backend`` unknown or unavailable here.
    """
    backend = backend or best_backend()
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # exact type: subclasses (already packed, quantized, ...) stay as they are
                new = PackedLinear.from_linear(child, backend)
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


def describe(model: nn.Module) -> str:
    """How ``model``'s linear layers run, for run records: ``kernel (avx512 build)``, ``kernel (avx2 build)``,
    ``onednn``, or ``F.linear`` (nothing packed)."""
    backend = backend_of(model)
    if backend is None:
        return "F.linear"
    if backend == "kernel":
        mod = _kernel_module()
        return f"kernel ({getattr(mod, 'isa', 'avx2')} build)"
    return backend


def backend_of(model: nn.Module) -> str | None:
    """The backend of ``model``'s first :class:`PackedLinear` (None when nothing is packed)."""
    return next((m.backend for m in model.modules() if isinstance(m, PackedLinear)), None)
