"""Tests of drafttrain.verify.methods.sssd_datastore: suffix array and counts against brute force, strided
sampling against the full continuation distribution (chi-square), storage (< 5 s)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from drafttrain.verify.methods.sssd_datastore import (
    FORMAT_VERSION,
    META_FILE,
    SEPARATOR,
    Datastore,
    build_suffix_array,
    concat_documents,
    documents_from_rows,
    first_answer_split,
)


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square goodness-of-fit p-value (cells with expected 0 must be observed 0)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def random_docs(seed: int, vocab: int, n_docs: int, max_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, max_len)).tolist() for _ in range(n_docs)]


def brute_count(docs: list[list[int]], pattern: list[int]) -> int:
    L = len(pattern)
    return sum(1 for d in docs for i in range(len(d) - L + 1) if d[i : i + L] == pattern)


@pytest.mark.parametrize("seed,vocab", [(0, 2), (1, 3), (2, 7)])
def test_suffix_array_is_the_sorted_suffixes(seed, vocab):
    docs = random_docs(seed, vocab, 40, 25)
    tokens, n_docs = concat_documents(docs)
    assert n_docs == 40 and tokens.dtype == np.int32 and (tokens == SEPARATOR).sum() == 40
    toks = tokens.tolist()
    # Python list order: a proper prefix sorts first (= end of array lowest), then SEPARATOR (-1) < ids
    reference = sorted(range(len(toks)), key=lambda i: toks[i:])
    assert build_suffix_array(tokens).tolist() == reference


def test_sort_depth_orders_by_leading_tokens_and_keeps_counts():
    docs = random_docs(3, 2, 60, 30)  # binary: long repeats
    full = Datastore.from_documents(docs)
    capped = Datastore.from_documents(docs, sort_depth=4)
    toks = full.tokens.tolist()
    heads = [tuple(toks[i : i + 4]) for i in capped.suffix_array.tolist()]
    # ordered by the first 4 tokens (a shorter tuple = end of array sorts first, as in the full order)
    assert heads == sorted(heads)
    rng = np.random.default_rng(0)
    for _ in range(100):
        p = rng.integers(0, 2, rng.integers(1, 5)).tolist()
        assert capped.count(p) == full.count(p) == brute_count(docs, p)


@pytest.mark.parametrize("seed,vocab", [(0, 3), (1, 5), (4, 50)])
def test_counts_equal_brute_force(seed, vocab):
    docs = random_docs(seed, vocab, 80, 40)
    ds = Datastore.from_documents(docs)
    rng = np.random.default_rng(seed)
    patterns = [rng.integers(0, vocab, rng.integers(1, 7)).tolist() for _ in range(150)]
    # also patterns that surely occur, including ones ending at a document's last token
    for d in docs[:30]:
        i = int(rng.integers(0, len(d)))
        patterns.append(d[i : i + int(rng.integers(1, 6))])
    lo, hi = ds.find_ranges(patterns)
    for p, l_, h_ in zip(patterns, lo.tolist(), hi.tolist()):
        assert h_ - l_ == brute_count(docs, p), p
        assert ds.find_range(p) == (l_, h_)  # batched search == one at a time
        starts = ds.suffix_array[l_:h_].tolist()
        assert all(ds.tokens[s : s + len(p)].tolist() == p for s in starts)
    assert ds.count([vocab + 5]) == 0
    with pytest.raises(ValueError, match="non-empty"):
        ds.find_ranges([[1], []])
    with pytest.raises(ValueError, match=">= 0"):
        ds.find_ranges([[SEPARATOR]])


def test_strided_indices_literal():
    assert Datastore.strided_indices(10, 20, 4).tolist() == [11, 13, 16, 18]
    assert Datastore.strided_indices(10, 13, 100).tolist() == [10, 11, 12]
    assert Datastore.strided_indices(5, 5, 3).tolist() == []


def _skewed_store(seed: int = 0):
    """2000 occurrences of the prefix [90, 91], each followed by 2 tokens drawn from a skewed law."""
    rng = np.random.default_rng(seed)
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    docs = []
    for _ in range(2000):
        a, b = rng.choice(6, size=2, p=probs)
        docs.append(rng.integers(10, 80, rng.integers(0, 6)).tolist() + [90, 91, int(a), int(b)])
    return Datastore.from_documents(docs)


def test_strided_sample_matches_full_continuation_distribution():
    """SSSD §3.1.2: strided samples follow the distribution of all continuations; the first N do not."""
    ds = _skewed_store()
    lo, hi = ds.find_range([90, 91])
    assert hi - lo == 2000
    n = 100
    full = ds.continuations(ds.suffix_array[lo:hi].astype(np.int64), np.full(hi - lo, 2), 2)
    strided = ds.continuations(ds.strided_positions(lo, hi, n), np.full(n, 2), 2)
    first = ds.continuations(ds.suffix_array[lo : lo + n].astype(np.int64), np.full(n, 2), 2)
    for depth in (1, 2):  # next token, and next two tokens (36 cells)
        code = lambda c: c[:, 0] * 6 + c[:, 1] if depth == 2 else c[:, 0]  # noqa: E731
        cells = 6**depth
        expected = np.bincount(code(full), minlength=cells) / len(full) * n
        p_strided = chi_square_pvalue(np.bincount(code(strided), minlength=cells), expected)
        p_first = chi_square_pvalue(np.bincount(code(first), minlength=cells), expected)
        assert p_strided > 0.5, p_strided  # each cell within one sample of its share
        assert p_first < 1e-6, p_first  # the first N in suffix order are all the smallest continuation


def test_lookup_batch_longest_match_threshold_and_document_ends():
    docs = [[1, 2, 3, 4, 5], [9, 2, 3, 7], [2, 3, 8], [3, 6]]
    ds = Datastore.from_documents(docs)
    # context ends with [1, 2, 3]: L=3 occurs once (-> 4 5 | end), L=2 thrice, L=1 four times
    (m_hi,) = ds.lookup_batch([[0, 1, 2, 3]], max_prefix_len=3, depth=3, max_samples=10, min_continuations=1)
    (m_lo,) = ds.lookup_batch([[0, 1, 2, 3]], max_prefix_len=3, depth=3, max_samples=10, min_continuations=3)
    assert m_hi.longest_match == 3 and m_hi.occurrences == {3: 1}
    assert m_hi.continuations.tolist() == [[4, 5, -1]] and m_hi.match_lengths.tolist() == [3]
    # threshold 3: L=3 gives 1 occurrence, so L=2 (3 occurrences) is added; L=1 is not searched further
    assert m_lo.longest_match == 3 and m_lo.occurrences == {3: 1, 2: 3}
    assert sorted(m_lo.continuations.tolist()) == sorted([[4, 5, -1], [4, 5, -1], [7, -1, -1], [8, -1, -1]])
    assert sorted(m_lo.match_lengths.tolist()) == [2, 2, 2, 3]
    # a context that matches nothing, and one shorter than max_prefix_len
    none, short = ds.lookup_batch([[42, 43], [6]], max_prefix_len=3, depth=2)
    assert none.longest_match == 0 and none.continuations.shape == (0, 2)
    assert short.longest_match == 1 and short.continuations.tolist() == [[-1, -1]]


@pytest.mark.parametrize("seed,vocab,sort_depth", [(0, 3, None), (1, 6, 8), (2, 40, None)])
def test_extend_ranges_equals_a_fresh_search_as_the_context_grows(seed, vocab, sort_depth):
    """Ranges kept up to date token by token (including tokens the datastore never saw, and a context
    shorter than P at first) equal find_ranges on the grown context, and lookup_ranges on them equals
    lookup_batch on the context."""
    rng = np.random.default_rng(seed)
    docs = random_docs(seed, vocab, 12, 30)
    ds = Datastore.from_documents(docs, sort_depth=sort_depth)
    P = 4
    ctx = [int(rng.integers(0, vocab))]
    ranges = ds.suffix_ranges(ctx, P)
    assert len(ranges) == 1
    for _ in range(25):
        add = rng.integers(0, vocab + 2, int(rng.integers(1, 4))).tolist()  # vocab, vocab + 1: unseen ids
        before = list(ranges)
        ranges = ds.extend_ranges(ranges, add, P)
        assert before == ds.extend_ranges(before, [], P)  # appending nothing changes nothing
        ctx += add
        fresh = ds.suffix_ranges(ctx, P)
        assert len(ranges) == min(P, len(ctx))
        assert [h - lo for lo, h in ranges] == [brute_count(docs, ctx[-n:]) for n in range(1, len(ranges) + 1)]
        assert [r for r in ranges if r[0] < r[1]] == [r for r in fresh if r[0] < r[1]]
        got = ds.lookup_ranges([ranges], depth=3, max_samples=4, min_continuations=3)[0]
        ref = ds.lookup_batch([ctx], max_prefix_len=P, depth=3, max_samples=4, min_continuations=3)[0]
        assert np.array_equal(got.continuations, ref.continuations)
        assert np.array_equal(got.match_lengths, ref.match_lengths)
        assert (got.longest_match, got.occurrences) == (ref.longest_match, ref.occurrences)
    with pytest.raises(ValueError, match=">= 0"):
        ds.extend_ranges(ranges, [-1], P)


def test_save_load_roundtrip_is_memory_mapped(tmp_path):
    docs = random_docs(5, 6, 30, 20)
    ds = Datastore.from_documents(docs, meta={"source": "unit"})
    path = ds.save(tmp_path / "ds")
    loaded = Datastore.load(path)
    assert isinstance(loaded.tokens, np.memmap) and isinstance(loaded.suffix_array, np.memmap)
    assert np.array_equal(loaded.tokens, ds.tokens) and np.array_equal(loaded.suffix_array, ds.suffix_array)
    assert loaded.meta["source"] == "unit" and loaded.meta["num_documents"] == 30
    assert loaded.count(docs[0][:2]) == brute_count(docs, docs[0][:2])
    ds.save(path)  # replacing an existing folder works
    with pytest.raises(FileNotFoundError, match="build_datastore"):
        Datastore.load(tmp_path / "nothing")
    meta = json.loads((path / META_FILE).read_text())
    meta["format_version"] = FORMAT_VERSION + 1
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format version"):
        Datastore.load(path)


def test_documents_from_rows_splits_answer_runs():
    rows = [
        {"input_ids": [1, 2, 3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 0, 0, 1, 0]},
        {"input_ids": [8, 9], "loss_mask": [0, 0]},
    ]
    assert list(documents_from_rows(rows)) == [[2, 3], [6]]
    assert list(documents_from_rows(rows, answers_only=False)) == [[1, 2, 3, 4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="token ids"):
        concat_documents([[1, -3]])


def test_first_answer_split():
    assert first_answer_split([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1]) == ([1, 2], [3, 4])
    assert first_answer_split([1, 2, 3], [0, 1, 1]) == ([1], [2, 3])
    assert first_answer_split([1, 2], [0, 0]) is None and first_answer_split([1, 2], [1, 1]) is None
