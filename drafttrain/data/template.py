"""Chat template -> ``input_ids`` + ``loss_mask``, generically through ``tokenizer.apply_chat_template``.

No template is written by hand: for every assistant turn i the conversation is rendered twice,
``messages[:i]`` with the generation prompt and ``messages[:i+1]`` without it; the tokens the second
render adds are the assistant turn. Its content and its end-of-turn token get loss 1; the generation
prompt (e.g. ``<|im_start|>assistant\\n``), everything the template adds after the end-of-turn token
(e.g. ChatML's ``\\n``), system and user turns get loss 0. Whatever the template inserts by itself
(SmolLM2's default system prompt when none is given) is kept, because the target sees the same at
inference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: End-of-turn markers of common chat templates, used besides the tokenizer's eos token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>", "</s>")


class TemplateError(ValueError):
    """The chat template cannot be split into per-turn token spans, or no assistant token is left.

    ``reason`` is a short fixed label (e.g. ``"no assistant token within max_length"``) for counting.
    """

    def __init__(self, message: str, reason: str = "template error"):
        super().__init__(message)
        self.reason = reason


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template (handles list / dict / BatchEncoding returns)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template", "no chat template")
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise TemplateError(f"apply_chat_template returned a batch of {len(out)} for one conversation", "batched render")
        out = list(out[0])
    return [int(t) for t in out]


def _render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    """The chat-template render as text (cheap: no tokenization)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def end_of_turn_ids(tokenizer) -> set[int]:
    """Ids that may close an assistant turn: the eos token(s) plus known end-of-turn markers among added tokens."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    added = tokenizer.get_added_vocab()  # only added/special tokens: plain text never maps onto them
    ids.update(added[t] for t in END_OF_TURN_TOKENS if t in added)
    return ids


def _check_messages(messages: Sequence[dict]) -> None:
    if not messages:
        raise TemplateError("empty conversation", "malformed messages")
    for k, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TemplateError(f"message {k} is not a {{'role': str, 'content': str}} dict: {m!r:.200}", "malformed messages")


@dataclass
class AssistantTurn:
    """Token spans of one assistant turn in the chat template's render of a conversation.

    The render of a conversation is the concatenation, over its assistant turns k, of
    ``glue_k + content_k + tail_k``, followed by whatever comes after the last assistant turn.

    Attributes:
        index: position of the assistant message in ``messages``.
        glue: template tokens since the previous turn's ``tail`` (system/user turns, markers),
            ending with the generation prompt (ChatML: ``<|im_start|>assistant\\n``).
            ``render(messages[:index], add_generation_prompt=True)`` is the concatenation of all
            spans of earlier turns plus this ``glue``.
        content: the source's answer tokens, ending with the end-of-turn token ``content[-1]``.
        tail: template tokens after the end-of-turn token within the turn's render (ChatML: ``\\n``).
    """

    index: int
    glue: list[int]
    content: list[int]
    tail: list[int]

    @property
    def eot(self) -> int:
        """The end-of-turn token id that closes this turn in the template's render."""
        return self.content[-1]


def iter_assistant_turns(tokenizer, messages: Sequence[dict]) -> Iterator[AssistantTurn]:
    """Split the chat template's render of ``messages`` into per-assistant-turn token spans.

    For every assistant turn i the conversation is rendered twice, ``messages[:i]`` with the
    generation prompt and ``messages[:i+1]`` without it; the tokens the second render adds are the
    turn. Lazy: a caller that stops early renders no later turn.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``; every assistant turn must follow a user turn.

    Yields:
        :class:`AssistantTurn` for each assistant message, in order.

    Raises:
        TemplateError: malformed or empty messages (``"malformed messages"``); an assistant turn
            before any user turn (``"assistant before user"``); the template adds no generation
            prompt, i.e. has no assistant marker (``"no generation prompt"``); a shorter render is
            not a token prefix of a longer one (``"template not prefix-consistent"``); no end-of-turn
            token closes an assistant turn (``"no end-of-turn token"``); no chat template.
    """
    _check_messages(messages)
    eot = end_of_turn_ids(tokenizer)
    done = 0  # tokens of the render covered by the turns yielded so far
    prev: list[int] = []
    seen_user = False
    first = True
    for i, m in enumerate(messages):
        if m["role"] == "user":
            seen_user = True
        if m["role"] != "assistant":
            continue
        if not seen_user:
            raise TemplateError(f"assistant turn {i} comes before any user turn", "assistant before user")
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        if first and _render_text(tokenizer, messages[:i], True) == _render_text(tokenizer, messages[:i], False):
            raise TemplateError("the chat template adds no generation prompt (no assistant marker)", "no generation prompt")
        first = False
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if through[: len(before)] != before:
            raise TemplateError(
                f"chat template is not prefix-consistent at assistant turn {i}: the render up to the "
                f"generation prompt ({len(before)} tokens) is not a token prefix of the render through the turn",
                "template not prefix-consistent",
            )
        if before[:done] != prev:
            raise TemplateError(
                f"chat template is not prefix-consistent at assistant turn {i}: the render through the "
                f"previous assistant turn is not a token prefix of the later render",
                "template not prefix-consistent",
            )
        span = through[len(before) :]
        end = next((k for k, t in enumerate(span) if t in eot), None)
        if end is None:
            raise TemplateError(f"no end-of-turn token (ids {sorted(eot)}) closes assistant turn {i}", "no end-of-turn token")
        yield AssistantTurn(index=i, glue=before[done:], content=span[: end + 1], tail=span[end + 1 :])
        done, prev = len(through), through


def tokenize_conversation(tokenizer, messages: Sequence[dict], max_length: int | None = None) -> dict:
    """Tokenize a conversation with its chat template and mark the tokens the drafter learns.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``; every assistant
            turn must come after a user turn.
        max_length: keep the first ``max_length`` tokens (None: no truncation). Turns entirely past
            ``max_length`` are not rendered.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int]}`` of equal length s <= max_length;
        ``loss_mask[t] == 1`` exactly on the content tokens of every assistant turn plus the
        end-of-turn token closing it, 0 elsewhere.

    Raises:
        TemplateError: as :func:`iter_assistant_turns`; also no assistant turn
            (``"no assistant turn"``) or no assistant token left after truncation
            (``"no assistant token within max_length"``).
    """
    ids: list[int] = []
    mask: list[int] = []
    for turn in iter_assistant_turns(tokenizer, messages):
        ids += turn.glue + turn.content + turn.tail
        mask += [0] * len(turn.glue) + [1] * len(turn.content) + [0] * len(turn.tail)
        if max_length is not None and len(ids) >= max_length:
            break
    if not ids:
        raise TemplateError("conversation has no assistant turn", "no assistant turn")
    if (max_length is None or len(ids) < max_length) and messages[-1]["role"] != "assistant":
        full = _render(tokenizer, messages, add_generation_prompt=False)
        if full[: len(ids)] != ids:
            raise TemplateError("chat template is not prefix-consistent after the last assistant turn", "template not prefix-consistent")
        mask += [0] * (len(full) - len(ids))
        ids = full
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise TemplateError(f"no assistant token within the first {max_length} tokens", "no assistant token within max_length")
    return {"input_ids": ids, "loss_mask": mask}


def render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    """The chat template's render of ``messages`` as text (no tokenization).

    Raises:
        TemplateError: malformed messages or no chat template.
    """
    _check_messages(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template", "no chat template")
    return _render_text(tokenizer, messages, add_generation_prompt)


def prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids the target is given to generate the next assistant turn.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: the conversation so far, ``[{"role", "content"}, ...]``, normally ending with a user turn.

    Returns:
        ``list[int]``: the chat-template render with ``add_generation_prompt=True`` (for SmolLM2 this
        includes the default system prompt and ends with ``<|im_start|>assistant\\n``).

    Raises:
        TemplateError: malformed or empty messages, or the tokenizer has no chat template.
    """
    _check_messages(messages)
    return _render(tokenizer, messages, add_generation_prompt=True)
