"""What the host can do natively, for the defaults that depend on it (``trainer.mixed_precision=auto``).

bf16 is only worth choosing where the hardware computes it. oneDNN's own flag
(``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) is true on *any* AVX-512 CPU, including those that
only emulate bf16 through fp32 (an Intel Xeon with AVX-512 F/BW/VL but no AVX512_BF16 and no AMX: there a
[2048, 576] x [576, 1536] linear runs about 3x slower in bf16 than in fp32, and a training step 4x). So
the decision reads the CPU's feature flags instead:

- x86: ``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo`` (Zen 4, Sapphire Rapids and later);
- Arm: ``bf16`` in the ``Features`` line (Armv8.6 BF16 instructions);
- a CUDA device: ``torch.cuda.is_bf16_supported()`` (compute capability 8.0 and later);
- where the flags cannot be read (no ``/proc/cpuinfo``: macOS, Windows), a short probe
  (:func:`bf16_probe`): bf16 is chosen only if a bf16 matmul is at least 1.25x faster than fp32.

Everything is cached per process. ``DRAFTTRAIN_NATIVE_BF16=0|1`` overrides the answer (tests; a host
whose flags lie).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def cpu_flags(path: str | None = None) -> frozenset[str] | None:
    """The CPU feature flags of the first processor in ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``),
    lower case; None where the file does not exist or has no such line."""
    p = Path(path) if path else CPUINFO
    try:
        text = p.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return None


def bf16_probe(size: int = 384, reps: int = 3) -> float:
    """Time ratio fp32 / bf16 of a ``size``-cubed CPU matmul (best of ``reps``): > 1 means bf16 is faster.

    Costs a few tens of milliseconds. Returns 0.0 where bf16 matmuls fail.
    """
    import torch

    a32 = torch.randn(size, size)
    b32 = torch.randn(size, size)

    def best(a, b) -> float:
        a @ b  # warm-up (kernel selection)
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            t.append(time.perf_counter() - t0)
        return min(t)

    try:
        t16 = best(a32.bfloat16(), b32.bfloat16())
    except RuntimeError:
        return 0.0
    return best(a32, b32) / max(t16, 1e-9)


@functools.lru_cache(maxsize=None)
def native_cpu_bf16() -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, how that was decided) — see the module docstring."""
    forced = os.environ.get("DRAFTTRAIN_NATIVE_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"DRAFTTRAIN_NATIVE_BF16={forced}"
    flags = cpu_flags()
    if flags is not None:
        hit = [f for f in (*X86_BF16_FLAGS, "bf16") if f in flags]
        return bool(hit), (f"CPU flags: {', '.join(hit)}" if hit else "CPU flags: no avx512_bf16 / amx_bf16 / bf16")
    ratio = bf16_probe()
    return ratio >= 1.25, f"probe: bf16 matmul {ratio:.2f}x fp32 speed"


def native_bf16(device: str = "auto") -> tuple[bool, str]:
    """(whether ``device`` computes bf16 natively, the reason). ``auto``: CUDA when available, else the CPU."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        ok = bool(torch.cuda.is_bf16_supported())
        return ok, f"CUDA device {'supports' if ok else 'lacks'} bf16"
    return native_cpu_bf16()
