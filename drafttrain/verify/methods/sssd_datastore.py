"""Suffix-array datastore over token ids: the large, fixed n-gram source of SSSD drafting.

Source: SSSD (Marzollo et al., "SSSD: Simply-Scalable Speculative Decoding") section 3.1.2, which
builds the datastore "the same way as in REST (He et al. 2023), using a suffix array of tokenized
text to efficiently search for continuations of a given prefix with a binary search over the
suffixes", with two changes that this module implements:

1. at most ``max_samples`` (the paper's N, "usually 100") continuations per matched prefix, picked
   **at regular intervals** of the suffix-array range ("since the suffix array is sorted, sampling at
   regular intervals approximates the original distribution, unlike selecting only the initial
   continuations"): :meth:`Datastore.strided_positions`;
2. if the continuations of the longest matched prefix are fewer than a threshold, shorter prefixes
   are searched too "until this number is met", and all continuations are merged
   (:meth:`Datastore.lookup_batch`; the merge into a weighted tree is in :mod:`drafttrain.verify.methods.sssd`).

Layout. Documents (token-id lists) are concatenated, each followed by :data:`SEPARATOR` (-1), into
``tokens`` int32 [N]. ``suffix_array`` [N] (int32 when N < 2**31) lists the suffix start positions in
lexicographic order, where the separator sorts below every token and the end of the array below the
separator (a suffix that is a prefix of another sorts first). Patterns never contain the separator,
so a match never crosses a document boundary, and continuations stop at it.

On disk (:meth:`Datastore.save`): a folder with ``tokens.npy``, ``suffix_array.npy`` and
``datastore.json`` (format version, sizes, build metadata). :meth:`Datastore.load` memory-maps both
arrays (``np.load(mmap_mode="r")``), so loading is instant and processes share the pages.

Lookups are vectorised with numpy across patterns (every context of a batch and every prefix length
at once): one binary search of ~log2(N) numpy steps serves the whole batch (:meth:`Datastore.lookup_batch`).
A decoding sequence's context only grows, so its ranges can also be **kept up to date** token by token
(:meth:`Datastore.suffix_ranges` once, then :meth:`Datastore.extend_ranges` with every committed token):
the suffixes that start with ``q + [x]`` are the sub-range of ``q``'s range whose token at offset
``len(q)`` is x, a binary search over that (usually short) range only, so a step's lookup
(:meth:`Datastore.lookup_ranges`) no longer searches the whole array for every prefix length.

Shape letters: N datastore tokens, m patterns, L pattern length, D continuation depth.
"""

from __future__ import annotations

import bisect
import json
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Document separator in ``tokens``; sorts below every token id.
SEPARATOR = -1
#: Bump when the on-disk layout changes; :meth:`Datastore.load` refuses other versions.
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.npy"
SA_FILE = "suffix_array.npy"
META_FILE = "datastore.json"
_END = -2  # value of a position past the end of the array (sorts below SEPARATOR)


def concat_documents(documents: Iterable[Sequence[int]]) -> tuple[np.ndarray, int]:
    """Concatenate documents, each followed by :data:`SEPARATOR`.

    Args:
        documents: token-id sequences (ints in [0, 2**31 - 1)); empty ones are skipped.

    Returns:
        ``(tokens, num_documents)``: int32 [N], N = sum(len(doc) + 1) over non-empty documents.

    Raises:
        ValueError: a token id is negative or does not fit in int32.
    """
    parts: list[np.ndarray] = []
    sep = np.array([SEPARATOR], dtype=np.int32)
    n_docs = 0
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.size == 0:
            continue
        if arr.min() < 0 or arr.max() >= np.iinfo(np.int32).max:
            raise ValueError(f"token ids must be in [0, 2**31 - 1), got min {arr.min()} max {arr.max()}")
        parts.append(arr.astype(np.int32))
        parts.append(sep)
        n_docs += 1
    if not parts:
        return np.zeros(0, dtype=np.int32), 0
    return np.concatenate(parts), n_docs


def build_suffix_array(tokens: np.ndarray, sort_depth: int | None = None) -> np.ndarray:
    """Suffix array of ``tokens`` by prefix doubling (Manber & Myers), vectorised with numpy.

    Each round sorts the suffixes by (rank of the first k tokens, rank of the next k tokens), so
    after round r they are ordered by their first 2**r tokens; it stops when all ranks are distinct.
    O(N log N) memory traffic per round, ~log2(longest repeated substring) rounds.

    Args:
        tokens: int [N], ids >= 0 or :data:`SEPARATOR`.
        sort_depth: stop once suffixes are ordered by at least this many leading tokens; suffixes
            equal on them keep position order. Range queries of patterns up to ``sort_depth`` tokens
            (and continuations of at most ``sort_depth - L`` tokens after a length-L match) are then
            exactly as with the full array, and building is bounded when the data has long repeats.
            None = full suffix array.

    Returns:
        int32 [N] suffix start positions (int64 if N >= 2**31), lexicographic order with
        end-of-array < :data:`SEPARATOR` < every token.
    """
    n = int(tokens.shape[0])
    out_dtype = np.int32 if n < 2**31 else np.int64
    if n == 0:
        return np.zeros(0, dtype=out_dtype)
    # ranks start at 1 so that 0 can stand for "past the end"
    _, rank = np.unique(np.asarray(tokens, dtype=np.int64), return_inverse=True)
    rank = rank.astype(np.int64) + 1
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        if k < n:
            second[: n - k] = rank[k:]
        key = rank * (n + 1) + second  # rank, second <= n: no overflow for n < 3e9
        sa = np.argsort(key, kind="stable")
        sorted_key = key[sa]
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[sa] = 1 + np.concatenate(([0], np.cumsum(sorted_key[1:] != sorted_key[:-1])))
        rank = new_rank
        k *= 2
        if rank[sa[-1]] == n or k >= n or (sort_depth is not None and k >= sort_depth):
            return sa.astype(out_dtype)


@dataclass
class DatastoreMatch:
    """Continuations of one context found in the datastore (input of the SSSD datastore tree).

    Attributes:
        continuations: int64 [m, D] tokens following each sampled occurrence, -1 after a document
            end; m = total samples over the prefix lengths searched (0 if nothing matched).
        match_lengths: int64 [m] length L of the matched prefix of each sample.
        longest_match: the longest L with at least one occurrence (0 if none).
        occurrences: ``{L: number of occurrences}`` of every prefix length searched.
    """

    continuations: np.ndarray
    match_lengths: np.ndarray
    longest_match: int
    occurrences: dict[int, int]


class Datastore:
    """Token ids + their suffix array, with vectorised prefix search and strided sampling.

    Args:
        tokens: int32 [N] (see module docstring), possibly memory-mapped.
        suffix_array: int [N] from :func:`build_suffix_array` over ``tokens``.
        meta: free-form build metadata (saved to ``datastore.json``).

    Raises:
        ValueError: the two arrays differ in length.
    """

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray, meta: dict | None = None):
        if tokens.shape != suffix_array.shape or tokens.ndim != 1:
            raise ValueError(f"tokens {tokens.shape} and suffix_array {suffix_array.shape} must be equal 1-D shapes")
        self.tokens = tokens
        self.suffix_array = suffix_array
        self.meta = dict(meta or {})
        self._views = None  # (tokens, suffix_array) as memoryviews: scalar reads for extend_ranges
        self._token_ranges: dict[int, tuple[int, int]] = {}  # token -> range of the 1-token pattern

    # -- building and storage ----------------------------------------------------------------------
    @classmethod
    def from_documents(
        cls, documents: Iterable[Sequence[int]], sort_depth: int | None = None, meta: dict | None = None
    ) -> Datastore:
        """Build from token-id documents (see :func:`concat_documents`, :func:`build_suffix_array`).

        ``meta`` gains ``num_tokens``, ``num_documents``, ``vocab_size`` (max id + 1), ``sort_depth``
        and ``build_seconds`` (suffix-array construction wall time).
        """
        tokens, n_docs = concat_documents(documents)
        t0 = time.perf_counter()
        sa = build_suffix_array(tokens, sort_depth=sort_depth)
        seconds = time.perf_counter() - t0
        meta = dict(meta or {})
        meta.update(
            num_tokens=int(tokens.shape[0]),
            num_documents=n_docs,
            vocab_size=int(tokens.max()) + 1 if tokens.size else 0,
            sort_depth=sort_depth,
            build_seconds=round(seconds, 3),
        )
        return cls(tokens, sa, meta)

    def save(self, path: str | Path) -> Path:
        """Write ``tokens.npy``, ``suffix_array.npy`` and ``datastore.json`` into folder ``path``.

        The folder is written beside ``path`` under a temporary name and renamed into place, so an
        interrupted save never leaves a folder that :meth:`load` accepts. An existing folder at
        ``path`` is replaced.

        Raises:
            OSError: the parent folder cannot be written.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
        try:
            np.save(tmp / TOKENS_FILE, np.ascontiguousarray(self.tokens))
            np.save(tmp / SA_FILE, np.ascontiguousarray(self.suffix_array))
            meta = {**self.meta, "format_version": FORMAT_VERSION, "num_tokens": int(self.tokens.shape[0])}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, default=str))
            from drafttrain.atomic import fsync_path, replace_dir

            fsync_path(tmp)
            replace_dir(tmp, path)  # the old datastore whole until the rename
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return path

    @classmethod
    def load(cls, path: str | Path, mmap: bool = True) -> Datastore:
        """Open a saved datastore; both arrays are memory-mapped read-only when ``mmap``.

        Raises:
            FileNotFoundError: ``path`` is not a datastore folder (the message says what is missing
                and how to build one).
            ValueError: its format version differs from :data:`FORMAT_VERSION`, or its arrays
                disagree with its metadata.
        """
        path = Path(path)
        missing = [f for f in (TOKENS_FILE, SA_FILE, META_FILE) if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path} is not a datastore folder (missing {', '.join(missing)}); "
                f"build one with `python -m scripts.build_datastore output={path}`"
            )
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: datastore format version {meta.get('format_version')} != {FORMAT_VERSION}; rebuild it"
            )
        mode = "r" if mmap else None
        tokens = np.load(path / TOKENS_FILE, mmap_mode=mode)
        sa = np.load(path / SA_FILE, mmap_mode=mode)
        if tokens.shape[0] != meta["num_tokens"]:
            raise ValueError(f"{path}: {TOKENS_FILE} has {tokens.shape[0]} tokens, metadata says {meta['num_tokens']}")
        return cls(tokens, sa, meta)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the two arrays (the on-disk size up to the .npy headers)."""
        return int(self.tokens.nbytes + self.suffix_array.nbytes)

    # -- search --------------------------------------------------------------------------------
    def find_ranges(self, patterns: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Suffix-array ranges of many patterns at once (vectorised binary search).

        Args:
            patterns: m token-id sequences, each of length >= 1, ids >= 0.

        Returns:
            ``(lo, hi)`` int64 [m]: the suffixes starting with pattern i are
            ``suffix_array[lo[i]:hi[i]]``; ``hi - lo`` is its number of occurrences.

        Raises:
            ValueError: an empty pattern or a negative id.
        """
        m = len(patterns)
        if m == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        lens = np.array([len(p) for p in patterns], dtype=np.int64)
        if lens.min() < 1:
            raise ValueError("patterns must be non-empty")
        pat = np.zeros((m, int(lens.max())), dtype=np.int64)
        for i, p in enumerate(patterns):
            pat[i, : lens[i]] = p
        if pat.min() < 0:
            raise ValueError("pattern token ids must be >= 0")
        # rows 0..m-1 search the lower bound, rows m..2m-1 the upper bound
        bounds = self._search(np.concatenate([pat, pat]), np.concatenate([lens, lens]), m)
        return bounds[:m], bounds[m:]

    def _search(self, pat: np.ndarray, lens: np.ndarray, n_lower: int) -> np.ndarray:
        """Binary search; rows < n_lower: first suffix >= pattern, others: first suffix > pattern
        (comparing only the first len tokens of the suffix)."""
        n = len(self)
        rows = pat.shape[0]
        lo = np.zeros(rows, dtype=np.int64)
        hi = np.full(rows, n, dtype=np.int64)
        if n == 0:
            return lo
        ar = np.arange(pat.shape[1])
        in_len = ar[None, :] < lens[:, None]  # [rows, L]
        upper = np.arange(rows) >= n_lower
        row_ids = np.arange(rows)
        while True:
            active = lo < hi
            if not active.any():
                return lo
            mid = (lo + hi) // 2
            start = self.suffix_array[np.minimum(mid, n - 1)].astype(np.int64)
            idx = start[:, None] + ar[None, :]  # [rows, L]
            g = np.where(idx < n, self.tokens[np.minimum(idx, n - 1)], _END)
            diff = (g != pat) & in_len
            has = diff.any(axis=1)
            first = diff.argmax(axis=1)
            less = has & (g[row_ids, first] < pat[row_ids, first])  # suffix < pattern
            go_right = less | (upper & ~has)  # upper bound also skips suffixes equal on the prefix
            lo = np.where(active & go_right, mid + 1, lo)
            hi = np.where(active & ~go_right, mid, hi)

    def suffix_ranges(self, context: Sequence[int], max_len: int) -> list[tuple[int, int]]:
        """Suffix-array ranges of the last 1 .. min(``max_len``, len(context)) tokens of ``context``.

        Returns:
            ``ranges[L - 1] = (lo, hi)`` for the last L tokens (:meth:`find_ranges`; lo == hi when absent).

        Raises:
            ValueError: ``max_len`` < 1 or a negative id among the last ``max_len`` tokens.
        """
        return self.suffix_ranges_batch([context], max_len)[0]

    def suffix_ranges_batch(self, contexts: Sequence[Sequence[int]], max_len: int) -> list[list[tuple[int, int]]]:
        """:meth:`suffix_ranges` of every context, in one vectorised search (every context, every length)."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        patterns: list[Sequence[int]] = []
        owners: list[int] = []
        for b, ctx in enumerate(contexts):
            tail = list(ctx[-max_len:])  # only the last P tokens are ever matched
            for length in range(1, len(tail) + 1):
                patterns.append(tail[-length:])
                owners.append(b)
        lo, hi = self.find_ranges(patterns)
        ranges: list[list[tuple[int, int]]] = [[] for _ in contexts]
        for b, l_, h_ in zip(owners, lo.tolist(), hi.tolist()):
            ranges[b].append((l_, h_))  # L ascending
        return ranges

    def extend_ranges(
        self, ranges: Sequence[tuple[int, int]], tokens: Iterable[int], max_len: int
    ) -> list[tuple[int, int]]:
        """:meth:`suffix_ranges` of the context after appending ``tokens``, from the ranges before.

        The suffixes that start with ``q + [x]`` are those of ``q``'s range whose token at offset ``len(q)``
        is x; within the range that token is sorted (the suffixes share ``q``), so two binary searches over
        the range find them. The 1-token pattern ``[x]`` is searched over the whole array once per token
        id and remembered. Cost per appended token: P - 1 searches of ~log2(range size) scalar steps.

        Args:
            ranges: the context's current ranges (``ranges[L - 1]`` for its last L tokens, as returned by
                :meth:`suffix_ranges` or this method with the same ``max_len``).
            tokens: ids >= 0 appended, in order.
            max_len: P.

        Returns:
            the new ranges (a new list; ``ranges`` is not modified), equal to :meth:`suffix_ranges` of the
            extended context.

        Raises:
            ValueError: a negative token id.
        """
        out = list(ranges)
        for x in tokens:
            x = int(x)
            if x < 0:
                raise ValueError(f"token ids must be >= 0, got {x}")
            new = [self._token_range(x)]
            for length in range(2, min(max_len, len(out) + 1) + 1):
                lo, hi = out[length - 2]  # the last length - 1 tokens before x
                new.append(self._refine(lo, hi, length - 1, x) if lo < hi else (lo, lo))
            out = new
        return out

    def _token_range(self, x: int) -> tuple[int, int]:
        got = self._token_ranges.get(x)
        if got is None:
            got = self._token_ranges[x] = self._refine(0, len(self), 0, x)
        return got

    def _refine(self, lo: int, hi: int, offset: int, x: int) -> tuple[int, int]:
        """The sub-range of [lo, hi) whose suffixes hold token x at ``offset`` (their tokens at that offset
        are sorted within [lo, hi); past the end of the array reads :data:`_END`)."""
        if self._views is None:  # memoryview items are Python ints: ~10x cheaper to read one by one than numpy's
            self._views = tuple(memoryview(np.ascontiguousarray(a)).cast("B").cast(a.dtype.char)
                                for a in (self.tokens, self.suffix_array))  # fmt: skip
        toks, sa = self._views
        n = len(self)

        def key(start: int) -> int:
            p = start + offset
            return toks[p] if p < n else _END

        a = bisect.bisect_left(sa, x, lo, hi, key=key)
        return a, bisect.bisect_right(sa, x, a, hi, key=key)

    def find_range(self, pattern: Sequence[int]) -> tuple[int, int]:
        """``(lo, hi)`` of one pattern (see :meth:`find_ranges`)."""
        lo, hi = self.find_ranges([pattern])
        return int(lo[0]), int(hi[0])

    def count(self, pattern: Sequence[int]) -> int:
        """Number of occurrences of ``pattern`` (never across a document boundary)."""
        lo, hi = self.find_range(pattern)
        return hi - lo

    @staticmethod
    def strided_indices(lo: int, hi: int, max_samples: int) -> np.ndarray:
        """At most ``max_samples`` suffix-array indices spread at regular intervals over [lo, hi).

        Index j of m = min(hi - lo, max_samples) is ``lo + floor((2j + 1)(hi - lo) / 2m)`` (the
        middle of the j-th of m equal slices). Because suffixes in the range are sorted by their
        continuation, a continuation of frequency f in the range gets f*m +- 1 samples (SSSD §3.1.2).

        Returns:
            int64 [m], increasing; all of [lo, hi) when hi - lo <= max_samples.
        """
        count = hi - lo
        m = min(count, max_samples)
        if m <= 0:
            return np.zeros(0, dtype=np.int64)
        j = np.arange(m, dtype=np.int64)
        return lo + ((2 * j + 1) * count) // (2 * m)

    def strided_positions(self, lo: int, hi: int, max_samples: int) -> np.ndarray:
        """Token positions of the strided sample of [lo, hi) (see :meth:`strided_indices`)."""
        return self.suffix_array[self.strided_indices(lo, hi, max_samples)].astype(np.int64)

    def continuations(self, positions: np.ndarray, offsets: np.ndarray, depth: int) -> np.ndarray:
        """Tokens ``tokens[p + o : p + o + depth]`` for each position p and offset o, cut at documents' ends.

        Args:
            positions: int [m] suffix start positions; offsets: int [m] (the match lengths).
            depth: D.

        Returns:
            int64 [m, D]; entries at and after a separator (or past the end) are -1.
        """
        n = len(self)
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0 or depth <= 0:
            return np.full((positions.size, max(depth, 0)), -1, dtype=np.int64)
        idx = (positions + np.asarray(offsets, dtype=np.int64))[:, None] + np.arange(depth)[None, :]  # [m, D]
        out = np.where(idx < n, self.tokens[np.minimum(idx, n - 1)], -1).astype(np.int64)
        ended = np.maximum.accumulate(out < 0, axis=1)
        out[ended] = -1
        return out

    def lookup_batch(
        self,
        contexts: Sequence[Sequence[int]],
        max_prefix_len: int,
        depth: int,
        max_samples: int = 100,
        min_continuations: int = 1,
        min_prefix_len: int = 1,
    ) -> list[DatastoreMatch]:
        """Continuations of the longest matching suffixes of many contexts (SSSD §3.1.2).

        For each context, suffixes of length L = min(max_prefix_len, len(context)) down to
        ``min_prefix_len`` are looked up (all contexts and lengths in one vectorised search). Starting
        from the longest L with occurrences, each L contributes a strided sample of at most
        ``max_samples`` occurrences; shorter L are added while the occurrences gathered so far are
        fewer than ``min_continuations``.

        Args:
            contexts: b token-id sequences (the prompt + output so far; the last token is the root).
            max_prefix_len, min_prefix_len: the range of L searched (1 <= min <= max).
            depth: D, tokens read after each occurrence.
            max_samples: N, samples per prefix length.
            min_continuations: stop searching shorter prefixes once this many occurrences are gathered.

        Returns:
            b :class:`DatastoreMatch` in context order.

        Raises:
            ValueError: bad lengths or counts.
        """
        if not 1 <= min_prefix_len <= max_prefix_len or depth < 1 or max_samples < 1:
            raise ValueError(
                f"need 1 <= min_prefix_len <= max_prefix_len, depth >= 1, max_samples >= 1; got "
                f"{min_prefix_len}, {max_prefix_len}, {depth}, {max_samples}"
            )
        ranges = self.suffix_ranges_batch(contexts, max_prefix_len)
        return self.lookup_ranges(ranges, depth, max_samples, min_continuations, min_prefix_len)

    def lookup_ranges(
        self,
        ranges: Sequence[Sequence[tuple[int, int]]],
        depth: int,
        max_samples: int = 100,
        min_continuations: int = 1,
        min_prefix_len: int = 1,
    ) -> list[DatastoreMatch]:
        """:meth:`lookup_batch` from each context's suffix ranges, already known (:meth:`extend_ranges`).

        Args:
            ranges: per context, ``ranges[L - 1]`` = ``(lo, hi)`` of its last L tokens, L = 1 .. P' (P' =
                min(P, context length): :meth:`suffix_ranges`).
            depth, max_samples, min_continuations, min_prefix_len: as :meth:`lookup_batch`.

        Returns:
            b :class:`DatastoreMatch`, equal to :meth:`lookup_batch` on the contexts the ranges describe.

        Raises:
            ValueError: bad counts.
        """
        if min_prefix_len < 1 or depth < 1 or max_samples < 1:
            raise ValueError(
                f"need min_prefix_len, depth, max_samples >= 1; got {min_prefix_len}, {depth}, {max_samples}"
            )
        pos_parts, off_parts, sizes, results_meta = [], [], [], []
        for per_len in ranges:
            occurrences: dict[int, int] = {}
            longest, gathered, n_samples = 0, 0, 0
            for length in range(len(per_len), min_prefix_len - 1, -1):  # L descending
                l_, h_ = per_len[length - 1]
                count = h_ - l_
                occurrences[length] = count
                if count == 0:
                    continue
                if longest == 0:
                    longest = length
                pos = self.strided_positions(l_, h_, max_samples)
                pos_parts.append(pos)
                off_parts.append(np.full(pos.size, length, dtype=np.int64))
                n_samples += pos.size
                gathered += count
                if gathered >= min_continuations:
                    break
            sizes.append(n_samples)
            results_meta.append((longest, occurrences))
        if pos_parts:
            positions, offsets = np.concatenate(pos_parts), np.concatenate(off_parts)
        else:
            positions, offsets = np.zeros(0, np.int64), np.zeros(0, np.int64)
        cont = self.continuations(positions, offsets, depth)
        out, start = [], 0
        for size, (longest, occurrences) in zip(sizes, results_meta):
            out.append(DatastoreMatch(cont[start : start + size], offsets[start : start + size], longest, occurrences))
            start += size
        return out


def documents_from_rows(rows: Iterable[dict], answers_only: bool = True) -> Iterator[list[int]]:
    """Token-id documents from dataset rows with ``input_ids`` and ``loss_mask``.

    Works on the SFT rows of :func:`drafttrain.data.dataset.build_sft_dataset` and the self-distilled
    rows of :func:`drafttrain.data.selfdistill.self_distill` alike.

    Args:
        rows: dicts with ``input_ids`` [s] and, when ``answers_only``, ``loss_mask`` [s].
        answers_only: one document per maximal run of ``loss_mask == 1`` (the assistant answers);
            otherwise one document per row (the whole conversation).

    Yields:
        lists of token ids.
    """
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        if not answers_only:
            yield ids.tolist()
            continue
        mask = np.asarray(row["loss_mask"], dtype=np.int8) > 0
        if not mask.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
        for s, e in zip(edges[::2], edges[1::2]):
            yield ids[s:e].tolist()


def first_answer_split(input_ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """Split a row into (context, continuation) at its first answer: the continuation is the first
    maximal run of ``loss_mask == 1``, the context everything before it (the prompt, template included).

    Returns:
        ``(context, continuation)`` as lists, or None when the row has no answer token or no context.
    """
    mask = np.asarray(loss_mask, dtype=np.int8) > 0
    if not mask.any():
        return None
    start = int(np.argmax(mask))
    if start == 0:
        return None
    rest = mask[start:]
    end = start + (int(np.argmin(rest)) if not rest.all() else rest.size)
    ids = list(map(int, input_ids))
    return ids[:start], ids[start:end]
