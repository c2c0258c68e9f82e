"""Tests of drafttrain.data: sources, chat template -> loss mask, cached SFT dataset (CPU, a few seconds)."""

from __future__ import annotations

import collections
import json

import pytest

from drafttrain import assets
from helpers import need_input
from drafttrain.data import (
    LoadStats,
    TemplateError,
    build_sft_dataset,
    iter_json_array_records,
    load_conversations_jsonl,
    load_eval_prompts,
    load_gsm8k,
    load_mt_bench,
    load_sharegpt,
    prompt_ids,
    split_heldout,
    tokenize_conversation,
)
from drafttrain.data import template as template_mod

TWO_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
# SmolLM2 ChatML render, default system prompt included (the template adds it when none is given):
# <|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
# <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n[4.<|im_end|>]\n
# <|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n[6.<|im_end|>]\n      ([...] = loss 1)
GOLDEN_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
    1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198,
    1, 520, 9531, 198, 36, 30, 2, 198,
    1, 4093, 198, 3528, 216, 35, 27, 35, 47, 2, 198,
    1, 520, 9531, 198, 38, 30, 2, 198,
]  # fmt: skip
GOLDEN_MASK = (
    [0] * 21  # system prompt
    + [0] * 12  # user 1
    + [0] * 4 + [1, 1, 1] + [0]  # <|im_start|>assistant\n | 4 . <|im_end|> | \n
    + [0] * 11  # user 2
    + [0] * 4 + [1, 1, 1] + [0]  # <|im_start|>assistant\n | 6 . <|im_end|> | \n
)  # fmt: skip


def _need(fn):
    """Call an assets function; a packaged input that is not installed fails the test (install command)."""
    return need_input(fn)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_need(assets.converted_target_dir))


# ---------------------------------------------------------------- chat template -> loss mask


@pytest.mark.real
def test_golden_two_turn_mask(tokenizer):
    out = tokenize_conversation(tokenizer, TWO_TURNS)
    assert out["input_ids"] == GOLDEN_IDS
    assert out["loss_mask"] == GOLDEN_MASK
    assert len(GOLDEN_IDS) == len(GOLDEN_MASK) == 60
    masked = [t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]
    assert tokenizer.decode(masked) == "4.<|im_end|>6.<|im_end|>"
    spans = [tokenizer.decode(GOLDEN_IDS[s : s + 3]) for s in (37, 56)]
    assert spans == ["4.<|im_end|>", "6.<|im_end|>"]
    assert tokenizer.decode(GOLDEN_IDS[33:37]) == "<|im_start|>assistant\n"  # header not learned
    assert tokenizer.decode(GOLDEN_IDS[:21]).startswith("<|im_start|>system\nYou are a helpful AI assistant")


@pytest.mark.real
def test_prompt_ids_is_prefix_up_to_generation_prompt(tokenizer):
    assert prompt_ids(tokenizer, TWO_TURNS[:1]) == GOLDEN_IDS[:37]
    assert prompt_ids(tokenizer, TWO_TURNS[:3]) == GOLDEN_IDS[:56]


@pytest.mark.real
def test_truncation_keeps_start(tokenizer):
    out = tokenize_conversation(tokenizer, TWO_TURNS, max_length=40)
    assert out["input_ids"] == GOLDEN_IDS[:40]
    assert out["loss_mask"] == GOLDEN_MASK[:40]
    out = tokenize_conversation(tokenizer, TWO_TURNS, max_length=38)
    assert out["loss_mask"] == GOLDEN_MASK[:38] and sum(out["loss_mask"]) == 1
    with pytest.raises(TemplateError, match="no assistant token") as err:
        tokenize_conversation(tokenizer, TWO_TURNS, max_length=37)
    assert err.value.reason == "no assistant token within max_length"


@pytest.mark.real
def test_template_rejects_conversations_without_assistant_tokens(tokenizer):
    with pytest.raises(TemplateError, match="no assistant turn"):
        tokenize_conversation(tokenizer, TWO_TURNS[:1])
    with pytest.raises(TemplateError, match="before any user turn"):
        tokenize_conversation(tokenizer, [{"role": "assistant", "content": "hi"}, *TWO_TURNS])
    # a trailing user turn is kept as context with loss 0
    out = tokenize_conversation(tokenizer, TWO_TURNS[:3])
    assert out["input_ids"][:41] == GOLDEN_IDS[:41] and sum(out["loss_mask"]) == 3


@pytest.mark.real
def test_template_without_generation_prompt_is_refused(tokenizer, monkeypatch):
    no_prompt = tokenizer.chat_template.split("{% if add_generation_prompt %}")[0]
    monkeypatch.setattr(tokenizer, "chat_template", no_prompt)
    with pytest.raises(TemplateError, match="no generation prompt") as err:
        tokenize_conversation(tokenizer, TWO_TURNS)
    assert err.value.reason == "no generation prompt"


# ---------------------------------------------------------------- sources


def test_truncated_json_array_decoder(tmp_path):
    def conv(*turns):
        return [{"from": r, "value": v} for r, v in turns]

    records = [
        {"id": "a", "conversations": conv(("human", "hi"), ("gpt", "hello"))},
        42,
        {"id": "c", "conversations": conv(("human", "q"), ("gpt", "a"))[:1] + [{"from": "gpt", "value": 7}]},
        {"id": "d", "conversations": conv(("human", "only a question"))},
        {"id": "e", "conversations": conv(("human", ""), ("gpt", "x"))},
        {"id": "f", "conversations": conv(
            ("system", "be brief"), ("gpt", "dropped"), ("human", "q1"), ("human", "q2"),
            ("gpt", "a1"), ("chatgpt", "a2"), ("human", "trailing"))},  # fmt: skip
        {"id": "g", "conversations": conv(("robot", "beep"), ("gpt", "x"))},
        {"id": "h", "conversations": ["not a turn"]},
        {"id": "i"},
        {"id": "j", "conversations": conv(("human", "   \n"), ("gpt", "x"))},
    ]
    body = ",\n".join(json.dumps(r, indent=2) for r in records)
    path = tmp_path / "sharegpt.json"
    path.write_text("[\n" + body + ',\n  {"id": "k", "conversations": [{"from": "human", "value": "cut he')

    stats = LoadStats(name="sharegpt")
    convs = load_sharegpt(path, stats=stats)
    assert [c["id"] for c in convs] == ["a", "f"]
    assert stats.skipped == collections.Counter({
        "not a dict": 1, "non-string content": 1, "no assistant turn": 1, "empty content": 2,
        "unknown role": 1, "turn not a dict": 1, "no conversations": 1, "truncated record": 1,
    })  # fmt: skip
    assert stats.read == 11 and stats.kept == 2
    assert stats.report().startswith("sharegpt: read 11, kept 2, skipped 9 (")
    assert stats.as_dict()["skipped"]["empty content"] == 2
    # system kept, leading assistant dropped, same-role turns merged, trailing user dropped
    assert convs[1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q1\n\nq2"},
        {"role": "assistant", "content": "a1\n\na2"},
    ]
    # lazy: a limit decodes only what it needs and never reaches the truncated tail
    stats = LoadStats()
    assert [c["id"] for c in load_sharegpt(path, max_conversations=1, stats=stats)] == ["a"]
    assert stats.read == 1 and not stats.skipped
    it = iter_json_array_records(path)
    assert next(it)["id"] == "a" and next(it) == 42


def test_json_array_decoder_complete_and_invalid(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text('[{"x": 1}, {"x": 2}]\n')
    assert list(iter_json_array_records(path)) == [{"x": 1}, {"x": 2}]
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array_records(bad))


def test_conversations_jsonl_counts_malformed_lines(tmp_path):
    path = tmp_path / "convs.jsonl"
    lines = [
        json.dumps({"id": "m1", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}),
        "{not json",
        "",
        json.dumps({"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}),
        json.dumps({"id": "m3", "messages": [{"role": "user", "content": "u"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    stats = LoadStats(name="jsonl")
    convs = load_conversations_jsonl(path, stats=stats)
    assert [c["id"] for c in convs] == ["m1", "jsonl-1"]
    assert convs[1]["messages"] == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert stats.skipped == collections.Counter({"malformed json": 1, "no assistant turn": 1})
    assert (stats.read, stats.kept) == (4, 2)


@pytest.mark.real
def test_real_sharegpt_first_50():
    path = _need(assets.sharegpt_file)
    stats = LoadStats(name="sharegpt")
    convs = load_sharegpt(path, max_conversations=50, stats=stats)
    assert len(convs) == 50 and stats.kept == 50
    assert "truncated record" not in stats.skipped
    for c in convs:
        roles = [m["role"] for m in c["messages"]]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:]))
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in c["messages"])


@pytest.mark.real
def test_eval_sets(tmp_path):
    _need(assets.mt_bench_file)
    _need(assets.gsm8k_file)
    mt = load_mt_bench()
    assert len(mt) == 80 and mt[0]["id"] == "81" and len(mt[0]["turns"]) == 2 and mt[0]["category"] == "writing"
    gsm = load_gsm8k()
    assert len(gsm) == 1319 and gsm[0]["id"] == "0" and gsm[0]["answer"].endswith("#### 18")

    prompts = load_eval_prompts("mt_bench")
    assert len(prompts) == 80
    assert prompts[0] == {"id": "81", "messages": [{"role": "user", "content": mt[0]["turns"][0]}]}
    prompts = load_eval_prompts("gsm8k", limit=5, offset=10)
    assert [p["id"] for p in prompts] == ["10", "11", "12", "13", "14"]
    assert prompts[0]["messages"] == [{"role": "user", "content": gsm[10]["question"]}]
    # the main job's in-training eval sample: every 5th question = 2 from each of the 8 categories
    sample = load_eval_prompts("mt_bench", limit=16, stride=5)
    category = {q["id"]: q["category"] for q in mt}
    assert sorted(collections.Counter(category[p["id"]] for p in sample).values()) == [2] * 8


def test_eval_prompts_from_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "p", "prompt": "hello"},
        {"question_id": 7, "turns": ["first", "second"]},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "a1"}]},  # fmt: skip
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_eval_prompts(str(path))
    assert prompts == [
        {"id": "p", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "7", "messages": [{"role": "user", "content": "first"}]},
        {"id": "2", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"}]},
    ]
    assert load_eval_prompts(str(path), limit=1, offset=1) == prompts[1:2]
    assert load_eval_prompts(str(path), stride=2) == prompts[::2]
    with pytest.raises(ValueError, match="stride"):
        load_eval_prompts(str(path), stride=0)
    with pytest.raises(ValueError, match="mt_bench"):
        load_eval_prompts("no_such_set")


# ---------------------------------------------------------------- tokenized dataset


@pytest.mark.real
def test_build_sft_dataset_cache(tokenizer, tmp_path, monkeypatch):
    long_user = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    convs = [
        {"id": "two", "messages": TWO_TURNS},
        {"id": "long", "messages": long_user},
        {"id": "bad", "messages": [{"role": "assistant", "content": "x"}]},
    ]
    cache = tmp_path / "sft"
    stats = LoadStats(name="sft")
    ds = build_sft_dataset(convs, tokenizer, max_length=64, cache_path=cache, stats=stats)
    assert list(ds["id"]) == ["two"]
    assert ds[0]["input_ids"] == GOLDEN_IDS and ds[0]["loss_mask"] == GOLDEN_MASK
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"
    assert stats.skipped == collections.Counter({"no assistant token within max_length": 1, "assistant before user": 1})
    assert (stats.read, stats.kept) == (3, 1)

    def boom(*args, **kwargs):
        raise AssertionError("re-tokenized despite a valid cache")

    real = template_mod.tokenize_conversation
    monkeypatch.setattr(template_mod, "tokenize_conversation", boom)
    stats2 = LoadStats(name="sft")
    again = build_sft_dataset(convs, tokenizer, max_length=64, cache_path=cache, stats=stats2)
    assert again.to_list() == ds.to_list()
    assert stats2.as_dict() == stats.as_dict()

    calls = []
    monkeypatch.setattr(template_mod, "tokenize_conversation", lambda *a, **k: calls.append(1) or real(*a, **k))
    rebuilt = build_sft_dataset(convs, tokenizer, max_length=40, cache_path=cache)
    assert len(calls) == 3
    assert rebuilt[0]["input_ids"] == GOLDEN_IDS[:40] and rebuilt[0]["loss_mask"] == GOLDEN_MASK[:40]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind


def test_split_heldout_deterministic():
    from datasets import Dataset

    ds = Dataset.from_dict({"id": [str(i) for i in range(20)]})
    train, held = (list(d["id"]) for d in split_heldout(ds, 5, seed=0))
    train2, held2 = (list(d["id"]) for d in split_heldout(ds, 5, seed=0))
    assert held == held2 and train == train2
    assert len(held) == 5 and len(train) == 15
    assert train == sorted(train, key=int) and held == sorted(held, key=int)  # original order kept
    assert sorted(train + held, key=int) == list(ds["id"])
    assert list(split_heldout(ds, 5, seed=1)[1]["id"]) != held
    with pytest.raises(ValueError):
        split_heldout(ds, 21, seed=0)
