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

:func:`describe` is the one description of the host that every run and benchmark records (CPU model, ISA
level, native bf16, CPUs and cores, torch threads, OS, Python and torch versions, GPU), and :func:`summary`
its one line for a page.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path
from typing import Any

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


#: ISA levels :func:`isa_level` names, x86 highest first: AMX tiles, AVX-512 with bf16 dot products, AVX-512F, AVX2.
ISA_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2")


def isa_level(flags: frozenset[str] | None) -> str:
    """The vector ISA level of CPU ``flags`` (:func:`cpu_flags`): x86 ``amx`` (amx_tile / amx_bf16),
    ``avx512_bf16``, ``avx512`` (avx512f), ``avx2``, else ``sse``; Arm ``sve`` or ``neon`` (asimd);
    where the flags are unreadable (None), torch's CPU capability in lower case, else ``unknown``."""
    if flags is None:
        try:
            import torch

            return str(torch.backends.cpu.get_cpu_capability()).lower() or "unknown"
        except (AttributeError, RuntimeError, ImportError):
            return "unknown"
    if flags & {"amx_tile", "amx_bf16"}:
        return "amx"
    for level, flag in (("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return level
    if "sve" in flags:
        return "sve"
    if "asimd" in flags:
        return "neon"
    return "sse" if "sse2" in flags else "unknown"


def _cpuinfo_facts() -> tuple[str | None, int | None]:
    """(CPU model name, physical cores) from ``/proc/cpuinfo``; None for what it does not say."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return None, None
    model, cores, phys = None, set(), None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key == "model name" and model is None:
            model = value
        elif key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
    return model, (len(cores) or None)


def describe() -> dict[str, Any]:
    """The host, as every run and benchmark records it (JSON-safe):

    ``cpu_model`` (``/proc/cpuinfo``'s model name, else the platform's processor or machine name), ``isa``
    (:func:`isa_level`), ``native_bf16`` (bool) and ``native_bf16_reason`` (:func:`native_bf16`), ``cpus``
    (logical CPUs), ``cores`` (physical cores; None where not known), ``usable_cpus`` (this process's CPU
    affinity), ``torch_threads``, ``os``, ``machine`` (e.g. x86_64), ``python``, ``torch`` (versions) and
    ``gpu`` (CUDA device name, None without one).
    """
    import torch

    model, cores = _cpuinfo_facts()
    bf16, reason = native_bf16()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"cpu_model": model or platform.processor() or platform.machine() or "unknown",
            "isa": isa_level(cpu_flags()), "native_bf16": bool(bf16), "native_bf16_reason": reason,
            "cpus": os.cpu_count(), "cores": cores, "usable_cpus": usable, "torch_threads": torch.get_num_threads(),
            "os": f"{platform.system()} {platform.release()}".strip(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}  # fmt: skip


def summary(d: dict[str, Any] | None = None) -> str:
    """One line for a page from :func:`describe`'s dict (None: this host now), e.g. ``AMD EPYC 7763 64-Core
    Processor (avx2, native bf16: no), 2 CPUs / 1 core, 2 torch threads, Linux 6.8.0, torch 2.5.1``;
    ``host not recorded`` for a record without a CPU model (records written before :func:`describe`)."""
    d = describe() if d is None else d
    if not d or not d.get("cpu_model"):
        return "host not recorded"
    bf16 = {True: "yes", False: "no"}.get(d.get("native_bf16"), "?")
    cores = d.get("cores")
    cpus = (f"{d['cpus']} CPUs" if d.get("cpus") else "") + (f" / {cores} core{'s' if cores != 1 else ''}" if cores else "")
    threads = d.get("torch_threads", "?")
    line = (f"{d['cpu_model']} ({d.get('isa', '?')}, native bf16: {bf16}), {cpus + ', ' if cpus else ''}{threads} torch "
            f"thread{'' if threads == 1 else 's'}, {d['os'] + ', ' if d.get('os') else ''}torch {d.get('torch', '?')}")  # fmt: skip
    return line + (f", GPU {d['gpu']}" if d.get("gpu") else "")
