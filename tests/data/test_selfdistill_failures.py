"""A self-distillation in which conversations fail: the report keeps the first failure's cause (conversation id
and exception, one line), and a run in which every conversation failed stops with that cause instead of the
generic "no training sequences" (the cause used to be only in ERROR log lines)."""

from __future__ import annotations

import pytest

from drafttrain.config import GenerationConfig, TrainConfig
from drafttrain.data import pipeline, selfdistill
from drafttrain.data.selfdistill import all_failed_message, generate_dataset, plan_conversations

CONVS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": "word " * (1 + 3 * i) + str(i)},
                                 {"role": "assistant", "content": "ok"}]}
    for i in range(4)
]  # fmt: skip
CAUSE = "shape mismatch: the cache holds head_dim 16, the layer writes 24"


def _failing_generation(monkeypatch, fails):
    """Generation (any backend) raises CAUSE for a batch holding a prompt ``fails(prompt)`` is true of."""
    real = selfdistill.generator_for

    class Failing:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, prompts, *args, **kwargs):
            if any(fails(p) for p in prompts):
                raise RuntimeError(CAUSE + "\n  (second line of the message)")
            return self.inner.generate(prompts, *args, **kwargs)

    monkeypatch.setattr(selfdistill, "generator_for", lambda *a, **k: Failing(real(*a, **k)))


def test_every_conversation_failing_stops_the_run_with_the_first_cause(tiny_target, tmp_path, monkeypatch):
    _failing_generation(monkeypatch, lambda prompt: True)
    monkeypatch.setattr(pipeline, "load_conversations", lambda c: [dict(x) for x in CONVS])
    c = TrainConfig()
    c.target.random_init = True
    c.data.cache_dir, c.data.self_distill_minutes, c.data.heldout = str(tmp_path), None, 0
    c.data.generation.max_new_tokens, c.data.generation.batch_size = 4, 2
    c.trainer.progress = False
    with pytest.raises(RuntimeError) as err:
        pipeline.prepare_data(c, tiny_target, pipeline.LocalProcess())
    msg = str(err.value)
    assert msg.startswith("self-distillation failed on 4 of 4 conversations; first failure (conversation c0): ")
    assert f"RuntimeError: {CAUSE} (second line of the message)" in msg and "\n" not in msg
    assert "no training sequences" not in msg
    # the same job again (its shards are kept, complete): the same line, from the recorded causes
    with pytest.raises(RuntimeError, match="failed on 4 of 4 conversations; first failure \\(conversation c0\\)"):
        pipeline.prepare_data(c, tiny_target, pipeline.LocalProcess())


def test_some_conversations_failing_keep_the_rest_and_report_the_first_cause(tiny_target, tmp_path, monkeypatch):
    gen = GenerationConfig(max_new_tokens=4, max_length=256, batch_size=2, shard_size=2, max_turns=1)
    plans, _ = plan_conversations(tiny_target.tokenizer, CONVS, gen)
    bad = {tuple(p.turns[0].glue) for p in plans if p.id in ("c1", "c3")}
    _failing_generation(monkeypatch, lambda prompt: tuple(prompt) in bad)
    ds, report = generate_dataset(tiny_target, CONVS, tmp_path, gen, progress=False)
    assert sorted(ds["id"]) == ["c0", "c2"] and report["failed"] == 2
    assert report["fail_reasons"] == {"generation error: RuntimeError": 2}
    assert report["first_failure"]["id"] == "c1" and report["first_failure"]["index"] == 1
    assert report["first_failure"]["error"].startswith(f"RuntimeError: {CAUSE}")
    assert all_failed_message(report) is None  # rows were made: training goes on
