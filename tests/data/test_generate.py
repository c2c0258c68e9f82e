"""Tests of self-distillation data generation (drafttrain.data.selfdistill, drafttrain.sampling) on tiny targets.

Why: generated rows are what every drafter learns from. Each turn must be exactly what the target
says given the regenerated turns before it, the loss mask must cover exactly the generated tokens,
and no input - however malformed - may crash a run or be lost from the counts.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch

from drafttrain.config import GenerationConfig, SamplingConfig
from drafttrain.data.selfdistill import generate_dataset, load_generated, self_distill
from drafttrain.data.sources import LoadStats, load_conversations
from drafttrain.data.template import end_of_turn_ids, iter_assistant_turns, prompt_ids, render_text
from drafttrain.sampling import SamplingParams, process_logits, sample_next

CONVS = [
    {"id": "math", "messages": [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."},
        {"role": "user", "content": "And 4+4?"}, {"role": "assistant", "content": "8."}]},
    {"id": "hi", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]},
    {"id": "story", "messages": [
        {"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "Once"},
        {"role": "user", "content": "more please"}, {"role": "assistant", "content": "upon a time"}]},
    {"id": "poem", "messages": [
        {"role": "user", "content": "Write a poem about the sea and the sky"}, {"role": "assistant", "content": "Waves"},
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    {"id": "x", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "z"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def eot_target():
    """A tiny target that sometimes says end-of-turn: its (untied) LM head's ``<|im_end|>`` row is a fixed
    random direction, so some turns end with the target's own end-of-turn token and others by
    ``max_new_tokens`` (the tests assert both happen)."""
    from drafttrain.config import TargetConfig
    from drafttrain.target import Target, load_target
    from helpers import need_input

    t = need_input(lambda: load_target(TargetConfig(random_init=True)))  # missing package: fail, never skip
    m = t.model
    head = torch.nn.Linear(m.config.hidden_size, m.config.vocab_size, bias=False)
    head.weight.data = m.lm_head.weight.data.clone()
    eot = t.tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(1)
    direction = torch.randn(m.config.hidden_size)
    head.weight.data[eot] = direction / direction.norm() * 0.7
    m.lm_head = head
    return Target(m, t.tokenizer)


def ids_of(ds) -> list[list[int]]:
    return [list(x) for x in ds.with_format(None)["input_ids"]]


def plain_greedy(target, context: list[int], cap: int, stops: set[int]) -> list[int]:
    """Reference: greedy decoding with a full forward per token (no cache, no batch, no padding)."""
    ids, out = list(context), []
    with torch.no_grad():
        for _ in range(cap):
            tok = int(target.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok in stops:
                break
    return out


def reference_row(target, messages: list[dict], gen: GenerationConfig) -> dict:
    """Plain restatement of the regeneration rule: glue_1 G_1 [eot] tail_1 glue_2 G_2 ... with plain greedy G_k."""
    turns = list(iter_assistant_turns(target.tokenizer, messages))
    stops = end_of_turn_ids(target.tokenizer) | {t.eot for t in turns}
    ids, mask, finish = list(turns[0].glue), [0] * len(turns[0].glue), []
    for k, turn in enumerate(turns):
        g = plain_greedy(target, ids, min(gen.max_new_tokens, gen.max_length - len(ids)), stops)
        ids, mask = ids + g, mask + [1] * len(g)
        finish.append("stop" if g[-1] in stops else "length")
        if k + 1 == len(turns):
            break
        glue = ([] if g[-1] == turn.eot else [turn.eot]) + turn.tail + turns[k + 1].glue
        if len(ids) + len(glue) > gen.max_length - 1:
            break
        ids, mask = ids + glue, mask + [0] * len(glue)
    return {"input_ids": ids, "loss_mask": mask, "finish_reasons": finish}


# ---------------------------------------------------------------- multi-turn correctness


def test_multi_turn_rows_equal_plain_greedy_per_turn(eot_target, tmp_path):
    """Every turn equals plain greedy of the target given the regenerated turns before it; the loss mask
    is 1 exactly on the generated tokens (with the target's end-of-turn token when it produced one)."""
    gen = GenerationConfig(max_new_tokens=12, max_length=256, batch_size=3, shard_size=3)
    ds, report = generate_dataset(eot_target, CONVS, tmp_path / "g", gen, progress=False)
    assert list(ds["id"]) == [c["id"] for c in CONVS] and list(ds["index"]) == list(range(5))
    finishes = collections.Counter()
    tok = eot_target.tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for conv, row in zip(CONVS, ds.with_format(None)):
        ref = reference_row(eot_target, conv["messages"], gen)
        assert row["input_ids"] == ref["input_ids"], conv["id"]
        assert row["loss_mask"] == ref["loss_mask"], conv["id"]
        assert row["finish_reasons"] == ref["finish_reasons"]
        n_turns = sum(m["role"] == "assistant" for m in conv["messages"])
        assert row["num_turns"] == row["source_turns"] == n_turns and row["end_reason"] == "complete"
        assert row["num_prompt"] == len(prompt_ids(tok, conv["messages"][: next(
            i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")]))
        finishes.update(row["finish_reasons"])
        # the masked runs are exactly the generated turns; a run ends with eot iff the target said it
        ids, mask = row["input_ids"], row["loss_mask"]
        runs, start = [], None
        for t, m in enumerate(mask + [0]):
            if m and start is None:
                start = t
            if not m and start is not None:
                runs.append((start, t))
                start = None
        assert len(runs) == n_turns
        for (a, b), f in zip(runs, row["finish_reasons"]):
            assert (ids[b - 1] == eot) == (f == "stop")
            assert 1 <= b - a <= 12
            if f == "length" and b < len(ids):
                assert ids[b] == eot  # closed by us at loss 0
        # the template renders the regenerated text as these ids (prefix consistency)
        msgs = [dict(m) for m in conv["messages"]]
        turn_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for i, (a, b) in zip(turn_idx, runs):
            msgs[i]["content"] = tok.decode([t for t in ids[a:b] if t != eot], skip_special_tokens=False)
        assert render_text(tok, msgs, add_generation_prompt=False).startswith(tok.decode(ids, skip_special_tokens=False))
    assert finishes["stop"] >= 2 and finishes["length"] >= 2  # both endings exercised
    assert report["turns_generated"] == 9
    assert report["finish_reasons"] == dict(finishes)
    assert report["input"] == report["generated"] == 5 and report["skipped"] == report["failed"] == 0


def test_on_length_stop_and_context_window(eot_target, tmp_path):
    """on_length=stop ends a conversation at a cut turn; a full context window ends it before the next turn."""
    gen = GenerationConfig(max_new_tokens=12, max_length=256, on_length="stop")
    ds, _ = generate_dataset(eot_target, CONVS, tmp_path / "stop", gen, progress=False)
    for row in ds.with_format(None):
        assert all(f == "stop" for f in row["finish_reasons"][:-1])
        if row["finish_reasons"][-1] == "length" and row["num_turns"] < row["source_turns"]:
            assert row["end_reason"] == "length"
    assert collections.Counter(ds["end_reason"])["length"] >= 1

    first = len(prompt_ids(eot_target.tokenizer, CONVS[0]["messages"][:1]))
    gen = GenerationConfig(max_new_tokens=12, max_length=first + 14)  # room for turn 1 only
    ds, report = generate_dataset(eot_target, CONVS[:1], tmp_path / "ctx", gen, progress=False)
    row = ds.with_format(None)[0]
    assert row["num_turns"] == 1 and row["end_reason"] == "context window"
    assert row["input_ids"] == reference_row(eot_target, CONVS[0]["messages"][:2], gen)["input_ids"]


def test_template_mismatch_ends_the_conversation(tiny_target, tmp_path, monkeypatch):
    """A template that renders assistant text differently from how it was generated (here: upper-cased)
    is caught before the next turn: the row keeps the turns before the mismatch. Here the template trims
    assistant text (as Llama 3's does) and the tiny target's greedy answer is all newlines."""
    tok = tiny_target.tokenizer
    trim = tok.chat_template.replace("message['content']", "(message['content'] | trim if message['role'] == 'assistant' else message['content'])")
    assert trim != tok.chat_template
    monkeypatch.setattr(tok, "chat_template", trim)
    convs = [{"id": "u", "messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "OK"},
                                      {"role": "user", "content": "again"}, {"role": "assistant", "content": "FINE"}]}]
    gen = GenerationConfig(max_new_tokens=12, max_length=256)
    ds, report = generate_dataset(tiny_target, convs, tmp_path / "trim", gen, progress=False)
    assert report["end_reasons"] == {"template mismatch": 1}
    assert ds[0]["num_turns"] == 1 and ds[0]["source_turns"] == 2


def test_first_turn_features_equal_a_full_forward(tiny_target, tmp_path):
    """The in-training path keeps f_0..f_{L-2} from the generation itself; they equal a full forward's."""
    ds, report = self_distill(tiny_target, CONVS, tmp_path / "sd", max_new_tokens=6, max_length=128, batch_size=2,
                              progress=False)
    assert report["generated"] == 5 and set(ds["num_turns"]) == {1}
    for row in ds.with_format("torch"):
        ids = row["input_ids"].long()
        full = tiny_target.features(ids[None])[0, :-1]
        assert row["features"].shape == full.shape
        torch.testing.assert_close(row["features"].float(), full, atol=2e-2, rtol=1e-2)  # fp16 storage
        assert row["loss_mask"].sum() == 6 == len(ids) - row["num_prompt"]


def test_multi_turn_features_cover_every_turn(eot_target, tmp_path):
    gen = GenerationConfig(max_new_tokens=8, max_length=256, store_features=True)
    ds, _ = generate_dataset(eot_target, CONVS[:3], tmp_path / "f", gen, progress=False, save_dataset=False)
    for row in ds.with_format("torch"):
        full = eot_target.features(row["input_ids"].long()[None])[0, :-1]
        torch.testing.assert_close(row["features"].float(), full, atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------- sampling


def test_sampling_is_deterministic_under_a_seed(tiny_target, tmp_path):
    def run(name, **sampling):
        gen = GenerationConfig(max_new_tokens=10, max_length=256, batch_size=2,
                               sampling=SamplingConfig(**{"temperature": 1.0, **sampling}))
        ds, _ = generate_dataset(tiny_target, CONVS, tmp_path / name, gen, progress=False)
        return ids_of(ds)

    a = run("a", temperature=1.0, top_p=0.9, seed=0)
    assert run("b", temperature=1.0, top_p=0.9, seed=0) == a
    assert run("c", temperature=1.0, top_p=0.9, seed=1) != a
    # batch composition does not change which random numbers a conversation gets
    gen = GenerationConfig(max_new_tokens=10, max_length=256, batch_size=5,
                           sampling=SamplingConfig(temperature=1.0, top_p=0.9, seed=0))
    assert ids_of(generate_dataset(tiny_target, CONVS, tmp_path / "d", gen, progress=False)[0]) == a
    # a nucleus of one token is greedy decoding
    greedy, _ = generate_dataset(tiny_target, CONVS, tmp_path / "g", GenerationConfig(max_new_tokens=10, max_length=256),
                                 progress=False)
    assert run("e", top_p=1e-6) == ids_of(greedy)


def test_process_logits_literal():
    logits = torch.log(torch.tensor([[0.5, 0.1, 0.25, 0.15]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reach 0.7
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 0.0, 1 / 3, 0.0]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))  # 0.5 + 0.25 = 0.75: nothing more
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 0.0, 1 / 3, 0.0]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.76))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.0, 0.25, 0.15]]) / 0.9)
    p = process_logits(logits, SamplingParams(temperature=0.5, top_p=1.0))
    torch.testing.assert_close(p, torch.tensor([[0.25, 0.01, 0.0625, 0.0225]]) / 0.345)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-0.1)
    assert SamplingParams(temperature=0.0).greedy  # one convention everywhere: temperature 0 = greedy


def test_sample_next_matches_its_distribution_chi_square():
    """Empirical frequencies of sample_next equal process_logits (chi-square, toy vocabulary of 6)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, 0.7])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    n = 40_000
    draws = sample_next(logits.expand(n, -1), params, torch.Generator().manual_seed(0))
    p = process_logits(logits[None], params)[0].double()
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[p == 0].sum() == 0  # nothing outside the nucleus
    keep = p > 0
    chi2 = float((((counts - n * p) ** 2)[keep] / (n * p[keep])).sum())
    df = int(keep.sum()) - 1
    assert df == 3  # top-p 0.9 at T = 0.8 keeps 4 of the 6 tokens
    assert chi2 < 16.27  # the chi-square 0.999 quantile for 3 degrees of freedom
    assert torch.equal(sample_next(logits[None].repeat(3, 1), None), torch.zeros(3, dtype=torch.long))
    assert torch.equal(sample_next(logits[None].repeat(3, 1), SamplingParams()), torch.zeros(3, dtype=torch.long))


# ---------------------------------------------------------------- bad input, counts, resume


def test_bad_input_is_counted_never_crashes(tiny_target, tmp_path):
    """No assistant turn, an empty string, a non-string field, a record that is not JSON, an empty
    conversation, an over-long prompt, a record that is not a conversation: each counted with its reason."""
    lines = [
        json.dumps({"id": "ok1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"id": "noasst", "messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"id": "empty", "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"id": "nonstr", "messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}),
        "{this is not json",
        json.dumps({"id": "noconv", "messages": []}),
        json.dumps({"id": "long", "messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"id": "ok2", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    stats = LoadStats(name="bad")
    convs = load_conversations(str(path), stats=stats)
    convs.append("not a conversation at all")  # a caller's malformed record
    gen = GenerationConfig(max_new_tokens=4, max_length=128)
    ds, report = generate_dataset(tiny_target, convs, tmp_path / "out", gen, load_stats=stats, progress=False)
    assert list(ds["id"]) == ["ok1", "ok2"]
    assert report["skip_reasons"] == {
        "no assistant turn": 1, "empty content": 1, "non-string content": 1, "malformed json": 1,
        "no conversations": 1, "prompt longer than the context window": 1, "malformed record": 1,
    }  # fmt: skip
    assert (report["input"], report["generated"], report["skipped"], report["failed"]) == (9, 2, 7, 0)
    for row in ds.with_format(None):
        assert 0 < sum(row["loss_mask"]) < len(row["loss_mask"])
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["skip_reasons"] == report["skip_reasons"]
    skipped = [json.loads(x) for x in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert {(s["id"], s["reason"]) for s in skipped} == {("long", "prompt longer than the context window"),
                                                         ("3", "malformed record")}


def test_template_without_assistant_marker_skips_everything_cleanly(tiny_target, tmp_path, monkeypatch):
    tok = tiny_target.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template.split("{% if add_generation_prompt %}")[0])
    ds, report = generate_dataset(tiny_target, CONVS, tmp_path / "nomarker", GenerationConfig(max_new_tokens=4),
                                  progress=False)
    assert len(ds) == 0
    assert report["skip_reasons"] == {"no generation prompt": 5} and report["input"] == 5


@pytest.mark.parametrize("backend", ["hf", "engine"])
def test_generation_errors_are_counted_as_failed(tiny_target, tmp_path, monkeypatch, backend):
    """A conversation whose generation raises is retried alone, then counted as failed; the others are kept."""
    import drafttrain.generation.engine as recorder

    owner, name = (type(tiny_target), "generate") if backend == "hf" else (recorder, "engine_generate")
    real = getattr(owner, name)

    def flaky(first, prompts, *args, **kwargs):  # first: the target (self or engine_generate's argument)
        if prompt_ids(tiny_target.tokenizer, CONVS[1]["messages"][:2]) in prompts:
            raise RuntimeError("boom")
        return real(first, prompts, *args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)
    gen = GenerationConfig(max_new_tokens=4, max_length=128, max_turns=1, batch_size=2, shard_size=1,  # "hi" alone
                           backend=backend)  # fmt: skip
    ds, report = generate_dataset(tiny_target, CONVS, tmp_path / "flaky", gen, progress=False)
    assert "hi" not in list(ds["id"]) and len(ds) == 4
    assert report["fail_reasons"] == {"generation error: RuntimeError": 1}
    assert report["generated"] + report["skipped"] + report["failed"] == report["input"] == 5


def test_resume_after_a_crash_equals_an_uninterrupted_run(tiny_target, tmp_path, monkeypatch):
    """In-process version of the SIGKILL test (tests/data/test_generate_cli.py): a crash after two shards."""
    from drafttrain.data import selfdistill
    from drafttrain.data.shards import JobMismatchError

    convs = CONVS * 3
    convs = [{**c, "id": f"{c['id']}-{i}"} for i, c in enumerate(convs)]
    gen = GenerationConfig(max_new_tokens=6, max_length=256, batch_size=2, shard_size=2)
    full, _ = generate_dataset(tiny_target, convs, tmp_path / "full", gen, progress=False)

    real, calls = selfdistill.generate_shard, []

    def crash_after_two(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt  # not an Exception: nothing catches it
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(selfdistill, "generate_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(tiny_target, convs, tmp_path / "resumed", gen, progress=False)
    assert not (tmp_path / "resumed" / "dataset").exists()
    monkeypatch.setattr(selfdistill, "generate_shard", real)
    ds, partial = generate_dataset(tiny_target, convs, tmp_path / "resumed", gen, progress=False, max_seconds=0)
    assert ds is None and not partial["complete"] and partial["shards_done"] == 2  # a time budget stops between shards
    resumed, report = generate_dataset(tiny_target, convs, tmp_path / "resumed", gen, progress=False)
    assert resumed.with_format(None).to_list() == full.with_format(None).to_list()
    assert report["this_run"]["generated_tokens"] < sum(sum(m) for m in full["loss_mask"])
    assert load_generated(tmp_path / "resumed").to_list() == full.to_list()
    with pytest.raises(JobMismatchError):  # other settings, same folder
        generate_dataset(tiny_target, convs, tmp_path / "resumed", GenerationConfig(max_new_tokens=7), progress=False)


def test_batches_by_budget_literal():
    from drafttrain.data.selfdistill import _State, batches_by_budget

    states = [_State(plan=None, ids=[0] * n) for n in (10, 10, 30, 30, 30)]
    shape = [[len(st.ids) for st in b] for b in batches_by_budget(states, 4, 64)]
    assert shape == [[10, 10], [30, 30], [30]]
    assert [[len(st.ids) for st in b] for b in batches_by_budget(states, 2, None)] == [[10, 10], [30, 30], [30]]
    assert [len(b) for b in batches_by_budget(states, 8, 5)] == [1, 1, 1, 1, 1]  # one row even over the budget
    assert [[len(st.ids) for st in b] for b in batches_by_budget(states[:3], 4, None, 0.5)] == [[10, 10], [30]]
    assert [[len(st.ids) for st in b] for b in batches_by_budget(states[:3], 4, None, 0.8)] == [[10, 10, 30]]  # 90 <= 1.8 x 50


def test_hf_dataset_folder_source(tmp_path):
    import datasets

    rows = {"id": ["a", "b"], "messages": [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}],
        [{"role": "user", "content": "q2"}],
    ]}  # fmt: skip
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dict"))
    stats = LoadStats()
    convs = load_conversations(str(tmp_path / "plain"), stats=stats)
    assert [c["id"] for c in convs] == ["a"] and stats.skipped == collections.Counter({"no assistant turn": 1})
    assert [c["id"] for c in load_conversations(str(tmp_path / "dict"), split="test")] == ["a"]
    with pytest.raises(ValueError, match="no split 'train'"):
        load_conversations(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="unknown conversation source"):
        load_conversations(str(tmp_path / "missing"))


def test_job_fingerprint_top_k(tiny_target, monkeypatch):
    """Top-k is part of a sampled job's key (other outputs) and of no greedy job's key; top-k 0 leaves the key of a
    job made before top-k existed (its settings had no top_k)."""
    import drafttrain.config
    from drafttrain.config import GenerationConfig, SamplingConfig
    from drafttrain.data.selfdistill import job_fingerprint

    conv = [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}]

    def key(t, k):
        return job_fingerprint(conv, "tiny", tiny_target.tokenizer, GenerationConfig(sampling=SamplingConfig(t, 0.9, k)))

    assert key(0.0, 0) == key(0.0, 20)
    assert key(0.7, 0) != key(0.7, 20)
    now = key(0.7, 0)
    to_dict = drafttrain.config.to_dict

    def before_top_k(obj):  # the settings as a job made before top-k existed saw them
        d = to_dict(obj)
        d["sampling"].pop("top_k")
        return d

    monkeypatch.setattr(drafttrain.config, "to_dict", before_top_k)
    assert key(0.7, 0) == now
