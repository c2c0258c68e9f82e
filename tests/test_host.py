"""Host-dependent defaults: ``trainer.mixed_precision=auto`` follows native bf16, not oneDNN's emulation flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafttrain import host
from drafttrain.validation import resolve_mixed_precision


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.delenv("DRAFTTRAIN_NATIVE_BF16", raising=False)
    host.native_cpu_bf16.cache_clear()
    host.cpu_flags.cache_clear()
    yield
    host.native_cpu_bf16.cache_clear()
    host.cpu_flags.cache_clear()


def _cpuinfo(tmp_path, flags: str, key: str = "flags"):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\n{key}\t\t: {flags}\n\nprocessor\t: 1\n")
    return str(p)


@pytest.mark.parametrize(
    "flags, key, want",
    [
        ("fpu sse avx2 avx512f avx512bw avx512vl", "flags", False),  # Intel Xeon AVX-512, bf16 emulated
        ("fpu sse avx2 avx512f avx512_bf16 avx512vl", "flags", True),  # AMD Zen 4
        ("fpu sse avx2 avx512f amx_bf16 amx_tile", "flags", True),  # Sapphire Rapids
        ("fpu sse avx2 fma", "flags", False),  # AVX2 only
        ("fp asimd sve bf16 i8mm", "Features", True),  # Arm with BF16 instructions
    ],
)
def test_native_bf16_reads_cpu_flags(tmp_path, monkeypatch, flags, key, want):
    monkeypatch.setattr(host, "CPUINFO", host.Path(_cpuinfo(tmp_path, flags, key)))
    monkeypatch.setattr(host, "bf16_probe", lambda *a, **k: pytest.fail("flags were readable: no probe"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    ok, why = host.native_bf16()
    assert ok is want and "CPU flags" in why
    assert resolve_mixed_precision("auto") == ("bf16" if want else "no")


def test_emulated_bf16_is_not_chosen_even_where_onednn_claims_it(tmp_path, monkeypatch):
    """The trap this module exists for: oneDNN's flag says yes on any AVX-512 CPU."""
    import torch

    monkeypatch.setattr(host, "CPUINFO", host.Path(_cpuinfo(tmp_path, "avx512f avx512bw avx512vl")))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert resolve_mixed_precision("auto") == "no"


@pytest.mark.parametrize("ratio, want", [(0.2, False), (1.1, False), (2.0, True)])
def test_probe_decides_where_flags_are_unreadable(tmp_path, monkeypatch, ratio, want):
    monkeypatch.setattr(host, "CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(host, "bf16_probe", lambda *a, **k: ratio)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    ok, why = host.native_bf16()
    assert ok is want and why.startswith("probe")


def test_env_override_and_explicit_settings(monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_NATIVE_BF16", "1")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert resolve_mixed_precision("auto") == "bf16"
    assert resolve_mixed_precision("no") == "no" and resolve_mixed_precision("fp16") == "fp16"


def test_probe_measures_something():
    assert host.bf16_probe(size=64, reps=1) > 0.0  # torch's CPU wheel runs bf16 matmuls everywhere (emulated or not)


def _full_cpuinfo(tmp_path, flags: str) -> Path:
    """Two sockets' worth of a fake /proc/cpuinfo: 4 logical CPUs on 3 physical cores (two siblings share core 0)."""
    rows = [(0, 0), (0, 0), (0, 1), (1, 0)]  # (physical id, core id) per logical CPU
    p = tmp_path / "cpuinfo"
    p.write_text("".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: Fake EPYC 9999 8-Core\n"
                         f"physical id\t: {ph}\ncore id\t\t: {co}\nflags\t\t: {flags}\n\n" for i, (ph, co) in enumerate(rows)))
    return p


@pytest.mark.parametrize("flags, want", [
    ("fpu sse2 avx2 fma", "avx2"),
    ("sse2 avx2 avx512f avx512bw avx512vl", "avx512"),
    ("sse2 avx2 avx512f avx512_bf16", "avx512_bf16"),
    ("sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16", "amx"),
    ("fpu sse2", "sse"),
    ("fp asimd", "neon"),
    ("fp asimd sve bf16", "sve"),
])  # fmt: skip
def test_isa_level_reads_the_flags(flags, want):
    assert host.isa_level(frozenset(flags.split())) == want


def test_describe_reads_model_flags_and_cores_from_cpuinfo(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(host, "CPUINFO", _full_cpuinfo(tmp_path, "fpu sse2 avx2 avx512f avx512_bf16"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    d = host.describe()
    assert set(d) >= {"cpu_model", "isa", "native_bf16", "native_bf16_reason", "cpus", "cores", "usable_cpus",
                      "torch_threads", "os", "machine", "python", "torch", "gpu"}  # fmt: skip
    assert (d["cpu_model"], d["isa"], d["native_bf16"], d["cores"]) == ("Fake EPYC 9999 8-Core", "avx512_bf16", True, 3)
    assert d["gpu"] is None and d["torch"] == torch.__version__ and d["torch_threads"] == torch.get_num_threads()
    line = host.summary(d)
    assert line.startswith("Fake EPYC 9999 8-Core (avx512_bf16, native bf16: yes), ") and "/ 3 cores" in line
    assert host.summary({**d, "gpu": "NVIDIA H100"}).endswith(", GPU NVIDIA H100")


def test_describe_without_cpuinfo_and_an_unrecorded_host(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "CPUINFO", tmp_path / "missing")
    monkeypatch.setenv("DRAFTTRAIN_NATIVE_BF16", "0")
    d = host.describe()
    assert d["cpu_model"] and d["cores"] is None and d["native_bf16"] is False
    assert host.summary({"processor": "x86_64", "cpus": 2}) == "host not recorded"  # a record older than describe()
    assert host.summary(None).startswith(d["cpu_model"])
