"""A training run that cannot fit in memory fails before the optimizer is allocated, in one line naming the
estimate and the limit (:mod:`drafttrain.memory`); the main job and the tiny test runs are never refused.

Why: a too-large ``trainer.micro_batch_size`` or ``data.max_length`` was found by the OOM killer minutes into
the run (after the target loaded and the data was generated), with no message at all.
"""

from __future__ import annotations

import pytest

from drafttrain.config import ConfigError
from drafttrain.memory import GIB, LIMIT_ENV, available_memory, check_training_fits, training_lower_bound

# SmolLM2-135M-Instruct (the main job's target): hidden 576, vocabulary 49152, 30 layers
SMOLLM2_HIDDEN, SMOLLM2_VOCAB = 576, 49152


def test_the_estimate_grows_with_batch_and_length():
    base = training_lower_bound(8, 512, 4096, 576, 3, 10_000_000)
    assert training_lower_bound(16, 512, 4096, 576, 3, 10_000_000) > base
    assert training_lower_bound(8, 1024, 4096, 576, 3, 10_000_000) > base
    assert training_lower_bound(8, 512, 49152, 576, 3, 10_000_000) > base  # the full vocabulary costs more
    # the logits term alone: 8 x 512 x 4096 fp32, twice (logits + gradient); AdamW: 16 bytes a parameter
    assert base == 2 * 8 * 512 * 4096 * 4 + 8 * 512 * 576 * 3 * 2 + 10_000_000 * 16


def test_the_limit_is_the_smallest_readable_and_the_env_var_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 20971520 kB\n")  # 20 GiB
    assert available_memory(tmp_path) == (20 * GIB, "MemAvailable")
    cg = tmp_path / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("max\n")  # no cgroup limit: MemAvailable decides
    assert available_memory(tmp_path)[0] == 20 * GIB
    (cg / "memory.max").write_text(f"{8 * GIB}\n")
    (cg / "memory.current").write_text(f"{2 * GIB}\n")
    assert available_memory(tmp_path) == (6 * GIB, "cgroup memory.max minus usage")
    monkeypatch.setenv(LIMIT_ENV, "0.5")
    assert available_memory(tmp_path) == (GIB // 2, LIMIT_ENV)
    monkeypatch.setenv(LIMIT_ENV, "lots")
    with pytest.raises(ConfigError, match=LIMIT_ENV):
        available_memory(tmp_path)
    monkeypatch.delenv(LIMIT_ENV)
    assert available_memory(tmp_path / "nothing") == (None, "nothing readable")  # no refusal on a blind host


def test_a_run_over_the_limit_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "1")
    with pytest.raises(ConfigError) as e:
        check_training_fits(64, 2048, 49152, 576, 3, 10_000_000)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("trainer.micro_batch_size=64 x data.max_length=2048 needs at least ~")
    assert "this host has 1.00 GiB available (DRAFTTRAIN_MEMORY_LIMIT_GIB)" in msg
    assert msg.endswith("lower trainer.micro_batch_size or data.max_length")
    check_training_fits(1, 64, 100, 32, 1, 1000)  # a tiny one fits under the same limit


def test_the_main_job_is_far_under_a_24_gib_host(monkeypatch):
    from drafttrain.train import compose_config

    c = compose_config(["+recipe=parallelspec"])
    assert c.drafter.draft_vocab_size == 4096  # the recipe's own head, not the full vocabulary
    # an EAGLE-3 drafter on SmolLM2 has a few million trainable parameters: 60M is a generous ceiling
    need = training_lower_bound(c.trainer.micro_batch_size, c.data.max_length, c.drafter.draft_vocab_size,
                                SMOLLM2_HIDDEN, 3, 60_000_000)
    assert need < 2 * GIB  # the job peaks ~11 GiB with everything else; this lower bound stays far under 24
    monkeypatch.setenv(LIMIT_ENV, "24")
    check_training_fits(c.trainer.micro_batch_size, c.data.max_length, c.drafter.draft_vocab_size,
                        SMOLLM2_HIDDEN, 3, 60_000_000)
    # the full vocabulary at the same sizes is refused on a host with 1 GiB left
    monkeypatch.setenv(LIMIT_ENV, "1")
    with pytest.raises(ConfigError, match="needs at least"):
        check_training_fits(c.trainer.micro_batch_size * 8, c.data.max_length, SMOLLM2_VOCAB, SMOLLM2_HIDDEN, 3,
                            60_000_000)


TINY = [
    "+recipe=parallelspec", "target=tiny", "data.max_conversations=10", "data.generation.max_new_tokens=12",
    "data.heldout=2", "data.generation.batch_size=8", "trainer.max_steps=3", "trainer.micro_batch_size=2",
    "trainer.progress=false", "trainer.num_threads=1", "logging.wandb=false", "trainer.mixed_precision=no",
    "trainer.export=false",
]  # fmt: skip


def test_a_forced_tiny_limit_stops_a_tiny_run_before_training(tmp_path, monkeypatch):
    import torch

    from drafttrain.train import compose_config, run

    built = []
    real = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: built.append(1) or real(*a, **k))
    monkeypatch.setenv(LIMIT_ENV, "0.01")
    out = tmp_path / "run"
    c = compose_config(TINY + [f"data.cache_dir={tmp_path / 'data'}", f"output_dir={out}"])
    with pytest.raises(ConfigError) as e:
        run(c)
    msg = str(e.value)
    assert "\n" not in msg and "trainer.micro_batch_size=2 x data.max_length=" in msg
    assert "needs at least ~" in msg and "this host has 0.01 GiB available (DRAFTTRAIN_MEMORY_LIMIT_GIB)" in msg
    assert built == [] and not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
