"""Self-distillation: the target regenerates the assistant turns of every conversation.

The drafter then learns the target's own distribution (ParallelSpec section 5.3: self-distilled data
is its best setting, Table 2). One implementation serves both uses:

- ``python -m scripts.generate_data`` (:func:`generate_dataset`): every assistant turn, multi-turn
  aware, greedy or sampled, written as a ``datasets`` folder for any later training run;
- the in-training path ``data=selfdistill`` (:func:`self_distill`): first turns, greedy, with the
  target's last hidden states kept from the generation itself, so training needs no target forward.

**How a conversation is regenerated.** The chat template's render of the source conversation is
split into per-turn spans (:func:`drafttrain.data.template.iter_assistant_turns`):
``glue_1 content_1 tail_1 glue_2 content_2 tail_2 ...`` (glue = system/user turns and markers up to
the generation prompt; content = the answer + its end-of-turn token; tail = what the template puts
after the end-of-turn token). The regenerated row is ``glue_1 G_1 tail_1 glue_2 G_2 ...`` where G_k
is what the target generates given everything before it, i.e. turn k is generated given the
*regenerated* turns before it. Rows are built from the generated token ids themselves (no
re-tokenisation of decoded text); ``loss_mask`` is 1 exactly on the generated tokens (including the
end-of-turn token when the target produced it) and 0 on every template token. A turn cut by
``max_new_tokens`` is closed with the template's end-of-turn token at loss 0 (``on_length="close"``)
or ends the conversation (``"stop"``). Before turn k+1 is generated, the template's *text* render of
the conversation with the regenerated answers is compared with the decoded ids (``check_template``):
a template that would render the regenerated turns differently (e.g. one that strips or trims
previous answers) ends the conversation there, counted as ``end_reason="template mismatch"``. A row
always ends with its last generated token.

**Backends** (``generation.backend``; the rows are the same whichever generates them): ``engine`` (greedy through
the bundled engine, :mod:`drafttrain.generation.engine`), ``hf`` (:meth:`drafttrain.target.Target.generate`; what
sampling uses) and ``vllm`` (greedy through vLLM in its own venv, ``bash scripts/install_vllm.sh``: one engine
process for the whole job, :class:`drafttrain.generation.vllm_client.VllmGenerator`, each round sent whole; vLLM keeps
no hidden states, so ``features`` come from one teacher-forced target forward over each finished row). The
backend is part of the job's key: batched floats differ between backends, hence possibly a token at a near tie.

**Resumable and loss-free.** Conversations are planned first (skips counted with a reason), sorted by
first-prompt length into shards (little left padding), generated shard by shard and written with a
manifest (:class:`drafttrain.data.shards.ShardStore`); a run killed at any point and restarted with
the same inputs and settings finishes without duplicating or dropping a conversation, and its output
equals an uninterrupted run's. The final dataset is in input order. The report satisfies
``generated + skipped + failed == input``.

Stored columns: ``id`` str (source id), ``index`` int32 (position in the input), ``input_ids`` int32
[L], ``loss_mask`` int8 [L], ``num_prompt`` int32 (tokens before the first answer), ``num_turns``
int32 (regenerated turns), ``source_turns`` int32 (assistant turns in the source),
``finish_reasons`` list[str] ("stop" | "length" per turn), ``finish_reason`` str (the last turn's),
``end_reason`` str ("complete" | "length" | "context window" | "template mismatch"), and with
``store_features`` ``features`` float16 [L-1, len(feature_layers) * d] (f_0..f_{L-2} of the target layers
a drafter declares, default the final post-norm state; ``report.json`` records them as ``feature_layers``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafttrain.cliconfig import FatalError
from drafttrain.config import GenerationConfig, VllmConfig
from drafttrain.data.lock import locks_folder
from drafttrain.data.shards import ShardStore, atomic_write_text, load_dataset_folder, quiet, read_json
from drafttrain.data.sources import LoadStats
from drafttrain.generation import generator_for
from drafttrain.data.template import AssistantTurn, TemplateError, end_of_turn_ids, iter_assistant_turns, render_text
from drafttrain.sampling import SamplingParams, row_generator
from drafttrain.target import resolve_feature_layers

log = logging.getLogger(__name__)

#: Bump when the row format or the generation rules change: earlier shards are not reused.
FORMAT_VERSION = 3
DATASET_DIR = "dataset"
REPORT = "report.json"
SKIPPED = "skipped.jsonl"


# ==================================================================================================
# planning: template spans and skips, before any generation
# ==================================================================================================
@dataclass
class ConversationPlan:
    """A conversation ready to regenerate: its template spans for the turns to generate."""

    index: int  # position in the input list
    id: str
    messages: list[dict]
    turns: list[AssistantTurn]  # the turns to regenerate (at most max_turns)
    source_turns: int  # assistant turns in the source


def plan_conversation(tokenizer, index: int, conv: dict, gen: GenerationConfig) -> ConversationPlan | str:
    """Split one conversation into template spans, or return the reason it is skipped.

    Skip reasons: ``"malformed record"`` (not ``{"id", "messages": list}``), ``"no assistant turn"``,
    a :class:`~drafttrain.data.template.TemplateError` reason (``"no generation prompt"`` for a
    template without an assistant marker, ``"malformed messages"``, ...), ``"prompt longer than the
    context window"`` (first prompt > ``max_length - 1`` tokens) and ``"prompt longer than
    max_prompt_length"``.
    """
    messages = conv.get("messages") if isinstance(conv, dict) else None
    if not isinstance(messages, list):
        return "malformed record"
    assistant_at = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if not assistant_at:
        return "no assistant turn"
    cut = assistant_at[gen.max_turns - 1] + 1 if gen.max_turns is not None and len(assistant_at) > gen.max_turns else len(messages)
    try:
        turns = list(iter_assistant_turns(tokenizer, messages[:cut]))
    except TemplateError as err:
        return err.reason
    if not turns:
        return "no assistant turn"
    n_prompt = len(turns[0].glue)
    if n_prompt > gen.max_length - 1:
        return "prompt longer than the context window"
    if gen.max_prompt_length is not None and n_prompt > gen.max_prompt_length:
        return "prompt longer than max_prompt_length"
    return ConversationPlan(index, str(conv.get("id", index)), messages, turns, len(assistant_at))


def plan_conversations(tokenizer, conversations: Sequence[dict], gen: GenerationConfig):
    """Plan every conversation. Returns ``(plans, skipped)`` with ``skipped = [(index, id, reason)]``."""
    plans, skipped = [], []
    for index, conv in enumerate(conversations):
        p = plan_conversation(tokenizer, index, conv, gen)
        if isinstance(p, str):
            cid = conv.get("id", index) if isinstance(conv, dict) else index
            skipped.append((index, str(cid), p))
        else:
            plans.append(p)
    return plans, skipped


def job_fingerprint(conversations: Sequence[dict], target_name: str, tokenizer, gen: GenerationConfig) -> str:
    """sha256 (16 hex digits) of the inputs and every setting the output depends on."""
    from drafttrain.config import to_dict

    h = hashlib.sha256()
    for conv in conversations:
        h.update(json.dumps(conv, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\0")
    # generation.vllm: where and how vLLM runs (its python, cores, memory, time limits), not what it generates
    settings = {k: v for k, v in to_dict(gen).items() if k not in ("batch_size", "vllm")}
    if gen.sampling.temperature == 0:  # greedy: the sampling settings play no part
        settings.pop("sampling")
    elif not gen.sampling.top_k:  # top-k off: the key of jobs made before top-k existed
        settings["sampling"].pop("top_k", None)
    if settings.get("backend") == "hf":  # the generator of jobs made before there was a choice: their keys stay
        settings.pop("backend")
    meta = {
        "format_version": FORMAT_VERSION,
        "target": target_name,
        "vocab_size": len(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "settings": settings,
        "batch_size": gen.batch_size,  # batch composition changes the floats, hence possibly the tokens
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


# ==================================================================================================
# generation of one shard
# ==================================================================================================
@dataclass
class _State:
    """A conversation being regenerated: its ids so far and what comes next."""

    plan: ConversationPlan
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # generated [start, end) of each turn
    finish: list[str] = field(default_factory=list)
    features: torch.Tensor | None = None
    end_reason: str = ""
    failed: str = ""  # the reason counted in the report ("generation error: RuntimeError")
    error: str = ""  # the failure's own message, one line (``failure_detail``)

    @property
    def pending(self) -> bool:
        return not self.end_reason and not self.failed

    @property
    def row_end(self) -> int:
        return self.spans[-1][1]


def _regenerated_messages(st: _State, tokenizer, stops: set[int], upto: int) -> list[dict]:
    """The source messages before index ``upto`` with the regenerated answers' decoded text."""
    msgs = [dict(m) for m in st.plan.messages[:upto]]
    for turn, (a, b) in zip(st.plan.turns, st.spans):
        gen_ids = st.ids[a:b]
        if gen_ids and gen_ids[-1] in stops:
            gen_ids = gen_ids[:-1]
        msgs[turn.index]["content"] = tokenizer.decode(gen_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return msgs


def _advance(st: _State, tokenizer, gen: GenerationConfig, stops: set[int]) -> None:
    """After turn k was generated: end the conversation or append the glue of turn k+1."""
    k = len(st.spans)
    if k == len(st.plan.turns):
        st.end_reason = "complete"
        return
    if st.finish[-1] == "length" and gen.on_length == "stop":
        st.end_reason = "length"
        return
    turn, nxt = st.plan.turns[k - 1], st.plan.turns[k]
    closing = [] if st.ids[-1] == turn.eot else [turn.eot]  # closed by us (loss 0), not by the target
    glue = closing + turn.tail + nxt.glue
    if len(st.ids) + len(glue) > gen.max_length - 1:
        st.end_reason = "context window"
        return
    if gen.check_template:
        msgs = _regenerated_messages(st, tokenizer, stops, nxt.index)
        want = render_text(tokenizer, msgs, add_generation_prompt=True)
        have = tokenizer.decode(st.ids + glue, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if want != have:
            log.debug("conversation %s: template renders the regenerated turn %d differently", st.plan.id, k)
            st.end_reason = "template mismatch"
            return
    st.ids += glue
    st.mask += [0] * len(glue)


def _generate_batch(target, states: list[_State], gen: GenerationConfig, stops: set[int],
                    feature_layers: Sequence[int] | None = None, vllm=None) -> int:  # fmt: skip
    """Generate the next turn of every state in one batch (features of ``feature_layers``, default the final
    post-norm state, when ``gen.store_features``; the vllm backend returns none: :func:`generate_shard` computes
    them). ``vllm``: the job's :class:`~drafttrain.generation.vllm_client.VllmGenerator` (backend vllm).
    Returns the number of generated tokens."""
    sampling = SamplingParams(gen.sampling.temperature, gen.sampling.top_p, gen.sampling.top_k)
    gens = None
    if not sampling.greedy:
        gens = [row_generator(gen.sampling.seed, st.plan.index, st.plan.id, len(st.spans)) for st in states]
    caps = [min(gen.max_new_tokens, gen.max_length - len(st.ids)) for st in states]
    # engine: continuous batching, preallocated cache; vllm: one request, vLLM batches it itself (greedy only,
    # config validation); hf: Target.generate, which also samples (one generator per row)
    backend = gen.backend if (gen.backend != "engine" or sampling.greedy) else "hf"
    results = generator_for(backend, target, batch_size=gen.batch_size, vllm=vllm).generate(
        [st.ids for st in states], caps, stop_token_ids=stops, return_features=gen.store_features,
        feature_layers=feature_layers, sampling=sampling, generators=gens)  # fmt: skip
    n = 0
    for st, r in zip(states, results):
        new = r["tokens"][r["num_prompt"] :]
        start = len(st.ids)
        st.ids += new
        st.mask += [1] * len(new)
        st.spans.append((start, len(st.ids)))
        st.finish.append(r["finish_reason"])
        if gen.store_features and "features" in r:
            st.features = r["features"].to(torch.float16)  # [len(ids) - 1, F]: the whole context so far
        n += len(new)
    return n


def vllm_generator(target, gen: GenerationConfig, log_path: str | Path | None = None):
    """The :class:`~drafttrain.generation.vllm_client.VllmGenerator` of a ``generation.backend=vllm`` job: the target's
    own Hugging Face folder and dtype, ``max_model_len = gen.max_length`` (every request fits: a turn's cap is
    ``min(max_new_tokens, max_length - context)``), ``max_num_seqs = gen.batch_size``, ``gen.vllm``'s settings.
    Nothing starts until its first request.

    Raises:
        ValueError: the target was not loaded from a folder (a random target): vLLM has nothing to load.
    """
    from drafttrain.generation.vllm_client import VllmGenerator

    folder = getattr(target, "source_dir", None)
    if folder is None:
        raise ValueError("generation.backend=vllm loads the target from its Hugging Face folder and this target has "
                         "none (a random target): save it (save_pretrained) and load it with target.path=<folder>")
    v = gen.vllm
    return VllmGenerator(folder, max_model_len=gen.max_length, max_num_seqs=gen.batch_size,
                         dtype=str(target.model.dtype).removeprefix("torch."), python=v.python, threads=v.threads,
                         kv_cache_gb=v.kv_cache_gb, memory_utilization=v.memory_utilization, eager=v.eager,
                         timeout_s=v.timeout_s, log_path=log_path)  # fmt: skip


@torch.no_grad()
def teacher_forced_features(target, rows: Sequence[Sequence[int]], feature_layers: Sequence[int] | None = None,
                            batch_size: int = 32, max_batch_tokens: int | None = 16384) -> list[torch.Tensor]:  # fmt: skip
    """Features of token-id rows from the target's forward over the whole row (teacher forcing), as stored.

    What the other backends keep from the generation itself, computed afterwards: f_0..f_{n-2} of
    ``feature_layers`` (default the final post-norm state; :meth:`drafttrain.target.Target.forward`). Rows are
    sorted by length and run right-padded, at most ``batch_size`` rows and ``max_batch_tokens`` padded slots
    per forward (one row at least).

    Returns:
        One float16 CPU tensor per row, in order: [len(row) - 1, len(feature_layers) * d].
    """
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out: list[torch.Tensor | None] = [None] * len(rows)
    batches: list[list[int]] = []
    for i in order:
        n = len(rows[i])
        if batches and len(batches[-1]) < batch_size and (max_batch_tokens is None or (len(batches[-1]) + 1) * n <= max_batch_tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    for batch in batches:
        s = max(len(rows[i]) for i in batch)
        ids = torch.zeros((len(batch), s), dtype=torch.long, device="cpu")  # assembled on the host, then one copy
        attn = torch.zeros((len(batch), s), dtype=torch.long, device="cpu")
        for j, i in enumerate(batch):
            ids[j, : len(rows[i])] = torch.as_tensor(list(rows[i]), device="cpu")
            attn[j, : len(rows[i])] = 1
        feats = target.forward(ids.to(target.device), attention_mask=attn.to(target.device), with_logits=False,
                               feature_layers=feature_layers).features  # [b, s, F]
        for j, i in enumerate(batch):
            out[i] = feats[j, : len(rows[i]) - 1].to("cpu", torch.float16)
    return out


#: conversations failing with one identical error, before any succeeded, that stop self-distillation at once
SYSTEMATIC_FAILURES = 3


class SystematicFailure(FatalError):
    """Self-distillation's first conversations all failed with the same error (a target or setting that cannot
    work, not a bad row): the job stops in one line instead of failing every conversation."""


def failure_detail(err: BaseException, limit: int = 300) -> str:
    """An exception as one line, ``"Type: message"`` (whitespace collapsed, at most ``limit`` characters): what a
    failed conversation's report keeps of its cause."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _teacher_forced_features(states: list[_State], target, gen: GenerationConfig, feature_layers) -> None:
    """``st.features`` of every state from :func:`teacher_forced_features` over its row (``ids[:row_end]``); a
    batch that raises is retried one state at a time, a state that still raises is recorded as failed."""
    try:
        feats = teacher_forced_features(target, [st.ids[: st.row_end] for st in states], feature_layers,
                                        gen.batch_size, gen.max_batch_tokens)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - retried per conversation below, never silent
        log.warning("teacher-forced features of %d rows failed (%s: %s); retrying one by one", len(states), type(err).__name__, err)
        feats = []
        for st in states:
            try:
                feats += teacher_forced_features(target, [st.ids[: st.row_end]], feature_layers)
            except Exception as err1:  # noqa: BLE001
                st.failed, st.error = f"feature error: {type(err1).__name__}", failure_detail(err1)
                log.error("conversation %s: features failed: %s: %s", st.plan.id, type(err1).__name__, err1)
                feats.append(None)
    for st, f in zip(states, feats):
        st.features = f


def batches_by_budget(
    states: Sequence[_State], batch_size: int, max_batch_tokens: int | None, max_padding: float | None = None
) -> list[list[_State]]:
    """Cut states sorted by context length into batches, keeping at least one row per batch.

    A state joins the current batch while it has fewer than ``batch_size`` rows, its padded prefill
    slots (rows x the longest context) stay <= ``max_batch_tokens``, and those padded slots stay
    <= ``(1 + max_padding)`` x its real tokens (None disables a limit).

    Example: lengths [10, 10, 30, 30, 30], batch_size 4, budget 64 -> [[10, 10], [30, 30], [30]];
    lengths [10, 10, 30], batch_size 4, no budget, max_padding 0.5 -> [[10, 10], [30]] (3 x 30 > 1.5 x 50).
    """
    out: list[list[_State]] = []
    real = 0
    for st in states:
        n = len(st.ids)
        if out and len(out[-1]) < batch_size and (
            max_batch_tokens is None or (len(out[-1]) + 1) * n <= max_batch_tokens
        ) and (max_padding is None or (len(out[-1]) + 1) * n <= (1 + max_padding) * (real + n)):
            out[-1].append(st)
            real += n
        else:
            out.append([st])
            real = n
    return out


def generate_shard(
    target, plans: Sequence[ConversationPlan], gen: GenerationConfig, on_tokens: Callable[[int], None] | None = None,
    feature_layers: Sequence[int] | None = None, vllm=None, errors: dict[int, tuple[str, str]] | None = None,
) -> tuple[list[dict], dict[int, str]]:
    """Regenerate the conversations of one shard, turn by turn (round k = every conversation's turn k).

    Within a round, conversations are sorted by context length and generated in batches of at most
    ``gen.batch_size`` rows, ``gen.max_batch_tokens`` padded prompt slots and ``gen.max_padding``
    padding (:func:`batches_by_budget`; left padding, KV cache, finished rows dropped); greedy rounds of the
    ``engine`` and ``vllm`` backends go whole to the backend, which batches them itself. A batch that raises is
    retried one conversation at a time; a conversation that still raises is recorded as failed. A vLLM engine that
    died or hung (:class:`~drafttrain.generation.vllm_client.VllmProcessError`) stops the job instead.

    ``feature_layers``: the target layers whose hidden states a row's ``features`` hold (with
    ``gen.store_features``; :func:`drafttrain.target.resolve_feature_layers`; default the final state). The
    ``vllm`` backend keeps no hidden states: its rows' features come from one teacher-forced target forward
    over the row's final ids (:func:`teacher_forced_features`; the same layers and storage dtype).

    ``vllm``: the job's :class:`~drafttrain.generation.vllm_client.VllmGenerator` (backend vllm; None: one started
    and shut down for this shard).

    ``errors``: a dict that gets, for every conversation that raised, input index -> (source id, the exception
    as one line, :func:`failure_detail`): the cause that ``failed``'s reasons name only by type.

    Returns:
        ``(rows, failed)``: one row dict per conversation that did not fail (see the module docstring
        for the columns), in the order of ``plans``; ``failed`` maps input index -> reason.
    """
    from drafttrain.generation.vllm_client import VllmProcessError

    if gen.backend == "vllm" and vllm is None:  # a direct call: an engine for this shard only
        with vllm_generator(target, gen) as own:
            return generate_shard(target, plans, gen, on_tokens, feature_layers, vllm=own, errors=errors)
    tok = target.tokenizer
    stops = end_of_turn_ids(tok) | {t.eot for p in plans for t in p.turns}
    states = []
    for p in plans:
        st = _State(p, ids=list(p.turns[0].glue), mask=[0] * len(p.turns[0].glue))
        states.append(st)
    # the engine and vLLM batch (and refill) a whole round themselves
    whole_round = gen.backend in ("engine", "vllm") and gen.sampling.temperature == 0
    generated_any, same = False, []  # a systematic failure (the same error before any success) stops at once
    while True:
        ready = sorted((st for st in states if st.pending), key=lambda st: (len(st.ids), st.plan.index))
        if not ready:
            break
        batches = [ready] if whole_round else batches_by_budget(ready, gen.batch_size, gen.max_batch_tokens, gen.max_padding)
        for batch in batches:
            try:
                n = _generate_batch(target, batch, gen, stops, feature_layers, vllm)
                generated_any = True
            except VllmProcessError:  # the engine is gone: stop the job (resumable), never fail rows one by one
                raise
            except Exception as err:  # noqa: BLE001 - counted per conversation below, never silent
                log.warning("generation batch of %d failed (%s: %s); retrying one by one", len(batch), type(err).__name__, err)
                n = 0
                for st in batch:
                    try:
                        n += _generate_batch(target, [st], gen, stops, feature_layers, vllm)
                        generated_any = True
                    except VllmProcessError:
                        raise
                    except Exception as err1:  # noqa: BLE001
                        st.failed, st.error = f"generation error: {type(err1).__name__}", failure_detail(err1)
                        log.error("conversation %s failed: %s: %s", st.plan.id, type(err1).__name__, err1)
                        if not generated_any:  # nothing generated yet: is it the same error every time?
                            same.append(st.error)
                            if len(same) >= SYSTEMATIC_FAILURES and len(set(same)) == 1:
                                raise SystematicFailure(
                                    f"self-distillation stopped: the first {len(same)} conversations failed with the "
                                    f"same error, so every other one would ({same[0]}); nothing was written for "
                                    "them, and the same command resumes once the cause is fixed")  # fmt: skip
            if on_tokens is not None:
                on_tokens(n)
        for st in ready:
            if not st.failed:
                _advance(st, tok, gen, stops)
    if gen.store_features and gen.backend == "vllm":  # vLLM keeps no hidden states: one teacher-forced pass
        _teacher_forced_features([st for st in states if not st.failed], target, gen, feature_layers)
    rows, failed = [], {}
    for st in states:
        if st.failed:
            failed[st.plan.index] = st.failed
            if errors is not None and st.error:
                errors[st.plan.index] = (st.plan.id, st.error)
            continue
        end = st.row_end
        ids, mask = st.ids[:end], st.mask[:end]
        if not 0 < sum(mask) < len(mask):  # never write an all-zero or all-one loss mask
            failed[st.plan.index] = "degenerate loss mask"
            continue
        row = {
            "id": st.plan.id,
            "index": st.plan.index,
            "input_ids": ids,
            "loss_mask": mask,
            "num_prompt": len(st.plan.turns[0].glue),
            "num_turns": len(st.spans),
            "source_turns": st.plan.source_turns,
            "finish_reasons": st.finish,
            "finish_reason": st.finish[-1],
            "end_reason": st.end_reason,
        }
        if gen.store_features:
            row["features"] = st.features[: end - 1].numpy()
        rows.append(row)
    return rows, failed


def row_features(hidden_size: int | None):
    """The ``datasets.Features`` of generated rows (``hidden_size``: width of ``features``, len(layers) * d;
    None: no ``features`` column)."""
    import datasets

    cols = {
        "id": datasets.Value("string"),
        "index": datasets.Value("int32"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "num_prompt": datasets.Value("int32"),
        "num_turns": datasets.Value("int32"),
        "source_turns": datasets.Value("int32"),
        "finish_reasons": datasets.List(datasets.Value("string")),
        "finish_reason": datasets.Value("string"),
        "end_reason": datasets.Value("string"),
    }
    if hidden_size is not None:
        cols["features"] = datasets.Array2D(shape=(None, hidden_size), dtype="float16")
    return datasets.Features(cols)


# ==================================================================================================
# a time budget: how many shards the host's measured speed lets the job generate
# ==================================================================================================
#: Shards generated before a time budget is decided: their measured speed decides it.
PROBE_SHARDS = 2


def spread_order(n: int) -> list[int]:
    """The order in which the ``n`` shards of a job with a time budget are generated: the bit-reversed
    indices below ``n`` (n = 11: 0, 8, 4, 2, 10, 6, 1, 9, 5, 3, 7). Shards are sorted by prompt length, so
    every prefix of this order spreads over short and long prompts alike: the probe shards' speed stands for
    the whole job's, and the conversations a budget keeps are not only the shortest prompts.

    Raises:
        ValueError: n < 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    bits = (n - 1).bit_length() if n > 1 else 0
    return [r for r in (int(format(j, f"0{bits}b")[::-1], 2) if bits else 0 for j in range(1 << bits)) if r < n]


def budget_shards(sizes: Sequence[int], seconds_per_conversation: float, budget_seconds: float,
                  probe: int = PROBE_SHARDS) -> int:  # fmt: skip
    """How many shards fit in a time budget: the longest prefix of ``sizes`` (conversations per shard, in
    generation order) whose estimated seconds (``sizes[j] * seconds_per_conversation``, summed) stay within
    ``budget_seconds``, and never fewer than the ``probe`` shards generated to measure the speed (they are
    already paid for) nor more than there are.

    Example: sizes [4, 4, 4, 4], 2.5 s per conversation, budget 35 s -> 3 (30 s; 4 shards would take 40 s).
    """
    spent, kept = 0.0, 0
    for n in sizes:
        spent += n * seconds_per_conversation
        if spent > budget_seconds and kept >= probe:
            break
        kept += 1
    return kept


def measure_speed(store: ShardStore, shards: Sequence[int]) -> tuple[float, float] | None:
    """The generation speed measured on the done shards ``shards`` of ``store``: ``(generated tokens per
    second, generated tokens per conversation)`` from the ``tokens``, ``seconds`` and ``rows`` + ``failed``
    recorded with each shard. None when none of them has timings (shards written before they were recorded)."""
    tokens = seconds = conversations = 0.0
    for i in shards:
        info = store.info(i)
        if "tokens" in info and "seconds" in info:
            tokens += info["tokens"]
            seconds += info["seconds"]
            conversations += info["rows"] + len(info["failed"])
    if seconds <= 0 or conversations == 0:
        return None
    return tokens / seconds, tokens / conversations


def _budget_record(shards: list, order: list[int], speed: tuple[float, float], probe: int, budget_seconds: float) -> dict:
    """The budget decision stored in the job's manifest: the measured speed and the shards (in ``order``) kept."""
    tokens_per_s, tokens_per_conversation = speed
    per_conversation = tokens_per_conversation / max(tokens_per_s, 1e-9)
    keep = budget_shards([len(shards[i]) for i in order], per_conversation, budget_seconds, probe)
    total = sum(len(s) for s in shards)
    return {"budget_seconds": budget_seconds, "tokens_per_s": tokens_per_s, "tokens_per_conversation": tokens_per_conversation,
            "probe_shards": probe, "shards": keep, "shards_total": len(order),
            "conversations": sum(len(shards[i]) for i in order[:keep]), "conversations_total": total,
            "estimated_seconds": round(per_conversation * total, 1)}  # fmt: skip


def _recorded_budget(store: ShardStore, shards: list, order: list[int], budget_seconds: float | None) -> dict | None:
    """The budget an earlier run of this job decided (None: none yet, or no budget now). Under another
    ``budget_seconds`` the recorded speed decides again, so the shards kept never depend on a new measurement."""
    rec = store.manifest.get("budget")
    if rec is None or budget_seconds is None:
        return None
    if rec["budget_seconds"] != budget_seconds:
        rec = _budget_record(shards, order, (rec["tokens_per_s"], rec["tokens_per_conversation"]), rec["probe_shards"],
                             budget_seconds)  # fmt: skip
        store.set("budget", rec)
    return rec


# ==================================================================================================
# the job: plan, shards, assembly, report
# ==================================================================================================
@dataclass
class _Job:
    """A generation job laid out: its key, plans and skips, shards (plans sorted by first-prompt length,
    ``shard_size`` each) and their store, and the dataset features of its rows."""

    fingerprint: str
    layers: tuple[int, ...]  # the target layers the stored features hold
    plans: list[ConversationPlan]
    skipped: list[tuple[int, str, str]]  # (index, id, reason)
    store: ShardStore
    shards: list[list[ConversationPlan]]
    features: object  # datasets.Features of a row
    n_input: int  # conversations given + those the loader skipped


@dataclass
class _Generated:
    """What :func:`_generate_shards` did in this call."""

    kept: list[int]  # the shards that make the dataset (all of them without a time budget), by index
    new_tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False  # max_seconds stopped it before every kept shard was done
    budget: dict | None = None  # the time budget's decision (None: no budget, or not decided yet)
    backend_info: dict = field(default_factory=dict)


def _plan_job(target, conversations, out_dir: Path, gen: GenerationConfig, target_name: str, load_stats,
              reset_on_mismatch: bool, feature_layers) -> _Job:  # fmt: skip
    """Fingerprint the job, plan every conversation, open its shard store and cut the plans into shards."""
    tok = target.tokenizer
    fingerprint = job_fingerprint(conversations, target_name, tok, gen)
    layers = resolve_feature_layers(feature_layers, target.num_hidden_layers)
    if gen.store_features and layers != (target.num_hidden_layers,):  # other layers: another job (the final one keeps old keys)
        fingerprint = hashlib.sha256(f"{fingerprint}|layers{list(layers)}".encode()).hexdigest()[:16]
    plans, skipped = plan_conversations(tok, conversations, gen)
    store = ShardStore(out_dir, {"fingerprint": fingerprint, "target": target_name, "conversations": len(conversations)},
                       reset_on_mismatch=reset_on_mismatch)
    shard_size = gen.shard_size or gen.batch_size
    by_length = sorted(plans, key=lambda p: (len(p.turns[0].glue), p.index))
    shards = [by_length[i : i + shard_size] for i in range(0, len(by_length), shard_size)]
    features = row_features(target.config.hidden_size * len(layers) if gen.store_features else None)
    n_input = len(conversations) + (sum(load_stats.skipped.values()) if load_stats is not None else 0)
    return _Job(fingerprint, layers, plans, skipped, store, shards, features, n_input)


def _generate_shards(target, job: _Job, gen: GenerationConfig, out_dir: Path, progress: bool, desc: str,
                     max_seconds: float | None, budget_seconds: float | None) -> _Generated:  # fmt: skip
    """Generate the shards not done yet, each written to the store with its token count and seconds.

    Without a budget every shard, by index. With ``budget_seconds`` the shards go in :func:`spread_order`;
    after the first :data:`PROBE_SHARDS` the speed measured on them (:func:`measure_speed`) decides how many
    fit (:func:`budget_shards`), recorded in the manifest, so a rerun keeps exactly those: a prefix of a
    fixed order, none generated twice. ``max_seconds`` stops starting new shards (``stopped``).
    """
    import datasets
    from tqdm.auto import tqdm

    store, shards = job.store, job.shards
    order = spread_order(len(shards)) if budget_seconds is not None else list(range(len(shards)))
    budget = _recorded_budget(store, shards, order, budget_seconds)
    keep = budget["shards"] if budget else len(order)
    size = lambda k: sum(len(shards[i]) for i in order[:k])  # noqa: E731 - conversations in the first k shards
    done = sum(len(shards[i]) for i in order[:keep] if store.is_done(i))
    bar = tqdm(total=size(keep), initial=done, desc=desc, unit="conv", disable=not progress, dynamic_ncols=True)
    out = _Generated(kept=[])
    t_gen = time.time()

    def on_tokens(n: int) -> None:
        out.new_tokens += n
        bar.set_postfix(tok_s=f"{out.new_tokens / max(time.time() - t_gen, 1e-9):.1f}")

    # backend vllm: one engine for the whole job, started by its first request (a finished job starts none),
    # shut down here whatever happens (no process outlives the job)
    engine = vllm_generator(target, gen, out_dir / "vllm.log") if gen.backend == "vllm" else None
    try:
        for j, i in enumerate(order):
            if j >= keep:
                break
            if not store.is_done(i):
                if max_seconds is not None and time.time() - t_gen >= max_seconds:
                    out.stopped = True
                    break
                t_shard, before = time.time(), out.new_tokens
                errors: dict[int, tuple[str, str]] = {}
                rows, failed = generate_shard(target, shards[i], gen, on_tokens, job.layers, vllm=engine, errors=errors)
                cols = {k: [r[k] for r in rows] for k in job.features}
                first = min(errors.items()) if errors else None  # the shard's first failure's cause, kept for the report
                store.write(i, datasets.Dataset.from_dict(cols, features=job.features),
                            {"rows": len(rows), "failed": {str(k): v for k, v in failed.items()},
                             "tokens": out.new_tokens - before, "seconds": round(time.time() - t_shard, 3),
                             **({"first_error": [first[0], *first[1]]} if first else {})})  # fmt: skip
                bar.update(len(shards[i]))
            if budget is None and budget_seconds is not None and j + 1 >= min(PROBE_SHARDS, len(order)):
                speed = measure_speed(store, [k for k in order[: j + 1] if store.is_done(k)])
                if speed is not None:  # (None: shards of an older run without timings; decided after the next one)
                    budget = _budget_record(shards, order, speed, j + 1, budget_seconds)
                    store.set("budget", budget)
                    keep = budget["shards"]
                    bar.total = size(keep)
                    bar.refresh()
                    log.info("time budget %.0f s: %.1f generated tokens/s on %d probe shards, %.0f tokens per "
                             "conversation: %d of %d shards (%d of %d conversations) fit", budget_seconds, speed[0],
                             j + 1, speed[1], keep, len(order), budget["conversations"], budget["conversations_total"])
    finally:
        if engine is not None:
            engine.close()
        bar.close()
    out.seconds = time.time() - t_gen
    out.kept, out.budget = sorted(order[:keep]), budget
    if engine is not None and engine.info:  # vLLM ran: its version, start-up and request seconds (in `seconds`)
        out.backend_info = {"vllm": {**engine.info, "request_seconds": round(engine.seconds, 1)}}
    return out


def _this_run(g: _Generated, t0: float) -> dict:
    return {"generated_tokens": g.new_tokens, "seconds": round(g.seconds, 1),
            "tokens_per_s": round(g.new_tokens / g.seconds, 2) if g.new_tokens else None,
            "wall_seconds": round(time.time() - t0, 1), **g.backend_info}  # fmt: skip


def _partial_report(job: _Job, g: _Generated, t0: float) -> dict:
    """The report of a run that ``max_seconds`` stopped (``complete: False``): shards and conversations done."""
    done = [i for i in range(len(job.shards)) if job.store.is_done(i)]
    report = {
        "complete": False,
        "input": job.n_input,
        "conversations_done": sum(len(job.shards[i]) for i in done),
        "conversations_planned": len(job.plans),
        "shards_done": len(done),
        "shards": len(job.shards),
        "this_run": _this_run(g, t0),
    }
    if g.budget is not None:
        report["budget"] = g.budget
    return report


def _assemble(job: _Job, kept: list[int], out_dir: Path, save_dataset: bool):
    """The rows of the ``kept`` shards in input order; with ``save_dataset`` written once to ``dataset/``
    (reused while the same shards are kept) and read back memory-mapped."""
    import datasets

    store, final = job.store, out_dir / DATASET_DIR
    if save_dataset and store.manifest.get("dataset_written") and final.is_dir() \
            and store.manifest.get("dataset_shards", len(job.shards)) == len(kept):  # fmt: skip
        return load_generated(final)
    parts = [store.load(i) for i in kept if store.info(i)["rows"]]  # (an all-failed shard is empty)
    if parts:
        ds = datasets.concatenate_datasets(parts)
        index = list(ds["index"])
        order = sorted(range(len(ds)), key=index.__getitem__)
        ds = ds.select(order)
    else:
        ds = datasets.Dataset.from_dict({k: [] for k in job.features}, features=job.features)
    if save_dataset:
        from drafttrain.atomic import atomic_dir
        from drafttrain.data.shards import free_hint

        with atomic_dir(final, f"the assembled dataset ({len(ds)} rows)", free_hint(out_dir)) as tmp:  # full disk: shards kept
            ds.save_to_disk(str(tmp))
        store.set("dataset_shards", len(kept))
        store.set("dataset_written", True)
        ds = load_generated(final)
    return ds


def _final_report(job: _Job, ds, g: _Generated, gen: GenerationConfig, load_stats, out_dir: Path, t0: float) -> dict:
    """Counts of the finished job (``input == generated + skipped + failed + budget_cut``), written with the
    skipped conversations to ``report.json`` and ``skipped.jsonl``.

    Raises:
        RuntimeError: the counts do not add up (a conversation was lost).
    """
    store = job.store
    skip_reasons = Counter(r for _, _, r in job.skipped)
    if load_stats is not None:
        skip_reasons.update(load_stats.skipped)
    fail_reasons = Counter(v for i in g.kept for v in store.info(i)["failed"].values())
    first_errors = [store.info(i)["first_error"] for i in g.kept if store.info(i).get("first_error")]
    meta = ds.with_format(None).select_columns(["num_turns", "loss_mask", "finish_reasons", "end_reason"])
    cut = len(job.plans) - sum(len(job.shards[i]) for i in g.kept)
    report = {
        "complete": True,
        "input": job.n_input,
        "generated": len(ds),
        "skipped": sum(skip_reasons.values()),
        "failed": sum(fail_reasons.values()),
        **({"budget_cut": cut, "budget": g.budget} if g.budget is not None else {}),
        "skip_reasons": dict(skip_reasons.most_common()),
        "fail_reasons": dict(fail_reasons.most_common()),
        **({"first_failure": dict(zip(("index", "id", "error"), min(first_errors)))} if first_errors else {}),
        "turns_generated": int(sum(meta["num_turns"])) if len(ds) else 0,
        "tokens_generated": int(sum(sum(m) for m in meta["loss_mask"])) if len(ds) else 0,
        "finish_reasons": dict(Counter(f for fs in meta["finish_reasons"] for f in fs)) if len(ds) else {},
        "end_reasons": dict(Counter(meta["end_reason"])) if len(ds) else {},
        "shards": len(job.shards),
        "this_run": _this_run(g, t0),
        "fingerprint": job.fingerprint,
    }
    if gen.store_features:  # which target hidden states the features column holds (DrafterSpec convention)
        report["feature_layers"] = list(job.layers)
    if report["generated"] + report["skipped"] + report["failed"] + report.get("budget_cut", 0) != report["input"]:
        raise RuntimeError(f"lost count: generated + skipped + failed + budget_cut != input in {report}")
    atomic_write_text(out_dir / REPORT, json.dumps(report, indent=1))
    atomic_write_text(out_dir / SKIPPED, "".join(
        json.dumps({"index": i, "id": cid, "reason": r}) + "\n" for i, cid, r in job.skipped))
    log.info("generation: input %d = generated %d + skipped %d + failed %d%s; skipped %s; failed %s",
             report["input"], report["generated"], report["skipped"], report["failed"],
             f" + cut by the time budget {cut}" if g.budget is not None else "", report["skip_reasons"], report["fail_reasons"])
    return report


@quiet
@locks_folder("out_dir", "lock_wait_s")  # one run writes a job folder at a time
def generate_dataset(
    target,
    conversations: Sequence[dict],
    out_dir: str | Path,
    gen: GenerationConfig,
    target_name: str = "target",
    load_stats: LoadStats | None = None,
    save_dataset: bool = True,
    progress: bool = True,
    desc: str = "generate",
    reset_on_mismatch: bool = False,
    max_seconds: float | None = None,
    feature_layers: Sequence[int] | None = None,
    budget_seconds: float | None = None,
    lock_wait_s: float = 0.0,
):
    """Regenerate the assistant turns of ``conversations`` with ``target``, resumably, into ``out_dir``.

    One run writes a job folder at a time: :func:`drafttrain.data.lock.folder_lock` is held for the whole call.

    The stages: :func:`_plan_job` (key, plans, shards), :func:`_generate_shards`, then :func:`_assemble` and
    :func:`_final_report` (or :func:`_partial_report` when ``max_seconds`` stopped it).

    Args:
        target: a :class:`drafttrain.target.Target` with a tokenizer that has a chat template.
        conversations: ``[{"id", "messages": [{"role", "content"}, ...]}]`` as the loaders of
            :mod:`drafttrain.data.sources` return them; malformed ones are skipped and counted.
        out_dir: the job folder: ``manifest.json``, ``shard_*/``, ``report.json``, ``skipped.jsonl``
            and, with ``save_dataset``, the final ``dataset/`` (``datasets.load_from_disk``-able).
        gen: generation settings (:class:`drafttrain.config.GenerationConfig`).
        target_name: names the target in the job fingerprint (a different target = a different job).
        load_stats: the loader's counts; its records count as input and its skips as skipped.
        save_dataset: write ``dataset/`` (input order); otherwise the shards are concatenated in memory.
        progress: show a tqdm bar (conversations done, generated tokens/s, ETA).
        reset_on_mismatch: start over when ``out_dir`` holds another job (else raise).
        max_seconds: stop starting new shards after this many seconds of generation; the run then
            returns ``(None, report)`` with ``report["complete"] = False`` (the same call continues).
        feature_layers: with ``gen.store_features``, the target layer ids whose hidden states ``features``
            holds, concatenated ([L-1, len(ids) * d]; default: the final post-norm state). Recorded in the
            report as ``feature_layers`` (resolved ids).
        budget_seconds: a time budget for generation: the shards that the speed measured on the first
            :data:`PROBE_SHARDS` shards lets fit (:func:`budget_shards`, estimated seconds); the rest are
            left out (``report["budget_cut"]`` conversations; ``report["budget"]`` the decision, kept in the
            manifest so that a rerun keeps the same shards). None: every shard.
        lock_wait_s: seconds to wait while another run writes ``out_dir`` (0: refuse at once).

    Returns:
        ``(dataset, report)``: rows in input order (skipped and failed conversations left out) and a
        dict with ``input == generated + skipped + failed (+ budget_cut)``, ``skip_reasons``,
        ``fail_reasons``, ``first_failure`` (where any conversation raised: ``{"index", "id", "error"}`` of the
        lowest input index, the exception as one line), turn, token, finish and end-reason counts, and this
        run's generated tokens/s.

    Raises:
        drafttrain.data.shards.JobMismatchError: ``out_dir`` holds a job with other inputs or settings.
        drafttrain.data.lock.FolderLockedError: another process is writing ``out_dir`` (after ``lock_wait_s``).
        ValueError: the target has no tokenizer.
    """
    if target.tokenizer is None:
        raise ValueError("generation needs a target with a tokenizer (for its chat template)")
    out_dir = Path(out_dir)
    t0 = time.time()
    job = _plan_job(target, conversations, out_dir, gen, target_name, load_stats, reset_on_mismatch, feature_layers)
    g = _generate_shards(target, job, gen, out_dir, progress, desc, max_seconds, budget_seconds)
    if g.stopped:
        done = sum(job.store.is_done(i) for i in range(len(job.shards)))
        log.info("stopped after %.0f s with %d of %d shards done; run again to continue", g.seconds, done, len(job.shards))
        return None, _partial_report(job, g, t0)
    ds = _assemble(job, g.kept, out_dir, save_dataset)
    return ds, _final_report(job, ds, g, gen, load_stats, out_dir, t0)


def all_failed_message(report: dict) -> str | None:
    """One line for a finished job in which every conversation that was generated failed (None otherwise):
    how many, and the first failure's conversation and cause (``report["first_failure"]``; the other
    failures are in the log's ERROR lines). :func:`drafttrain.data.pipeline.prepare_data` raises it instead of
    the generic "no training sequences"."""
    failed, done = int(report.get("failed", 0)), int(report.get("generated", 0))
    if not report.get("complete", True) or done or not failed:
        return None
    first = report.get("first_failure")
    cause = (f"first failure (conversation {first['id']}): {first['error']}" if first
             else f"reasons {report.get('fail_reasons')}")  # (shards written before causes were kept)
    return f"self-distillation failed on {failed} of {failed + done} conversations; {cause}"


def load_generated(path: str | Path):
    """The dataset written by :func:`generate_dataset` (its ``out_dir``, or the ``dataset/`` folder itself).

    Raises:
        FileNotFoundError: no finished dataset there (a run that has not completed yet).
    """
    import datasets

    path = Path(path).expanduser()
    for folder in (path / DATASET_DIR, path):
        if (folder / "dataset_info.json").is_file():
            fix = (f"delete {folder} and rerun the command that wrote it (scripts.generate_data: the same "
                   f"command; it reassembles the dataset from its shards)")
            state = read_json(folder / "state.json", fix)
            if not state.get("_data_files"):  # a saved empty dataset: datasets cannot load it back
                info = read_json(folder / "dataset_info.json", fix)
                feats = datasets.Features.from_dict(info["features"])
                return datasets.Dataset.from_dict({k: [] for k in feats}, features=feats)
            return load_dataset_folder(folder, fix)
    raise FileNotFoundError(
        f"no generated dataset in {path} (expected {path / DATASET_DIR}); run "
        f"`python -m scripts.generate_data output_dir={path}` to completion first"
    )


# ==================================================================================================
# the in-training path (data=selfdistill): first turns, greedy, features kept
# ==================================================================================================
def distill_key(
    conversations: list[dict], target_name: str, max_new_tokens: int, max_length: int, max_prompt_length: int | None = None,
    first_turn_only: bool = True, feature_layers: Sequence[int] | None = None, backend: str = "hf",
    dtype: str = "float32",
) -> str:
    """Fingerprint of an in-training self-distillation job (inputs + generation settings + the stored
    feature layers; None = the final post-norm state, which keeps the keys of caches made before layers
    were declared; the generation backend, ``hf`` keeping the keys of caches made before there was a
    choice: batched floats may differ between backends, hence possibly a token at a near tie; the target's
    loaded dtype, ``float32`` keeping the keys of caches made before ``target.dtype=auto``)."""
    h = hashlib.sha256()
    for c in conversations:
        h.update(c["id"].encode())
        h.update(json.dumps(c["messages"], sort_keys=True).encode())
    h.update(f"{target_name}|{max_new_tokens}|{max_length}|{max_prompt_length}|{first_turn_only}|v{FORMAT_VERSION}".encode())
    if feature_layers is not None:
        h.update(f"|layers{[int(i) for i in feature_layers]}".encode())
    if backend != "hf":
        h.update(f"|backend={backend}".encode())
    if dtype != "float32":
        h.update(f"|dtype={dtype}".encode())
    return h.hexdigest()[:16]


def self_distill(
    target,
    conversations: list[dict],
    out_dir: str | Path,
    max_new_tokens: int,
    max_length: int,
    batch_size: int = 16,
    progress: bool = True,
    max_prompt_length: int | None = None,
    first_turn_only: bool = True,
    target_name: str = "target",
    feature_layers: Sequence[int] | None = None,
    backend: str = "engine",
    vllm: VllmConfig | None = None,
    budget_minutes: float | None = None,
):
    """Regenerate the first assistant turn (all turns with ``first_turn_only=False``) greedily, keeping features.

    The in-training data path: :func:`generate_dataset` with ``store_features=True``, shards of
    ``batch_size`` conversations, and no final copy (the shards are concatenated memory-mapped).

    Args:
        target: a :class:`drafttrain.target.Target` (with tokenizer).
        conversations: ``[{"id", "messages": [{"role", "content"}]}]`` (e.g. from ``load_sharegpt``).
        out_dir: job folder; shards and ``manifest.json`` live here; reused when complete.
        max_new_tokens: answer length cap per turn (tokens).
        max_length: cap on prompt + answers (tokens); first prompts longer than ``max_length - 1`` are skipped.
        batch_size: conversations per generation batch (also the shard size).
        max_prompt_length: optional tighter cap on first-prompt tokens (long prompts make batched
            generation slow and teach the drafter little about answers); longer prompts are skipped.
        feature_layers: the target layers the drafter reads (its declaration; default the final state).
        backend: ``engine`` (the bundled engine, :func:`drafttrain.generation.engine.engine_generate`), ``hf``
            (:meth:`drafttrain.target.Target.generate`) or ``vllm`` (vLLM in its own venv, one process for the job;
            features from a teacher-forced pass: :func:`generate_shard`).
        vllm: ``backend=vllm``'s settings (:class:`drafttrain.config.VllmConfig`; None: its defaults).
        budget_minutes: generation minutes at most (``budget_seconds`` of :func:`generate_dataset`); None: every shard.

    Another process writing ``out_dir`` (a training rank, or another run of the same job: the folder is keyed by
    the job's inputs) is waited for, then its shards are reused.

    Returns:
        ``(dataset, report)`` as :func:`generate_dataset`; rows carry ``features`` float16
        [L-1, len(feature_layers) * d].
    """
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, max_length=max_length, max_prompt_length=max_prompt_length,
        max_turns=1 if first_turn_only else None, batch_size=batch_size, store_features=True,
        max_padding=None,  # one batch per shard, as the main job's measured runs and stored losses assume
        backend=backend, vllm=vllm if vllm is not None else VllmConfig(),
    )
    return generate_dataset(target, conversations, out_dir, gen, target_name=target_name, save_dataset=False,
                            progress=progress, desc="self-distill", reset_on_mismatch=True,
                            feature_layers=feature_layers, budget_seconds=60 * budget_minutes if budget_minutes else None,
                            lock_wait_s=float("inf"))  # fmt: skip
