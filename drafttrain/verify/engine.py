"""The batched speculative-decoding engine (docs/design.md, "The verifier"; EMS-SD; ParallelSpec Algorithm 1).

One engine runs a queue of prompts through the frozen target, ``batch_size`` sequences at a time,
each with its own KV-cache length. A step (:meth:`SpecEngine.step`) is::

    trees  = proposer.draft(slots)                    # one DraftTree per live sequence
    inputs = [root_i, tree_i.tokens...] per sequence  # root = the sequence's last emitted token
    pos    = cache_len_i + depth                      # tree attention: node sees prefix + root + ancestors
    logits = target(inputs, tree mask, pos, cache)    # ONE forward for the whole batch
    for each sequence i:
        path, bonus = accept(tree_i, logits_i)        # greedy: follow children equal to the argmax;
                                                      # sampling: accept x w.p. min(1, p(x)/q(x)), else
                                                      # p := norm((p - q)+) and try the next child
        move K/V of [root, path] to contiguous slots  # rejected nodes' slots are simply overwritten later
        emit path tokens + bonus; stop on a stop token or max_new_tokens
        proposer.commit(i, path tokens + bonus, hidden at [root, path])  # the proposer's feature_layers
    finished sequences free their slot; the next prompt in the queue is prefilled into it

Three modes of the same engine (``mode``):

- ``"unpadded"`` (EMS-SD): per-row cache offsets ("unpad KV cache") and all sequences' inputs packed
  into one ``[1, N]`` row ("unpad input tokens"), attention per sequence against its own cache row
  (:func:`~drafttrain.verify.cache.ragged_attention`, one attention call per layer for the whole batch).
  No padding anywhere. With ``pack_inputs="auto"`` a step with one input per row (plain decoding) runs
  as the equivalent ``[B, 1]`` tensor through the model's own attention, measured ~8% faster there at
  batch 16; every tree step is packed: with 2-9 inputs per row the packed forward was 20-25% faster than
  the ``[B, q]`` one at batch 16 and 3-4% faster at batch 1 (transformers' sdpa repeats the grouped
  keys/values of every cache row for more than one query; ours does not).
- ``"unpadded_kv"``: per-row cache offsets, inputs batched as ``[B, q_max]`` (right-padded only if
  tree sizes differ), the model's own attention (sdpa). EMS-SD's "unpad KV cache" ablation.
- ``"padded"`` (EMS-SD's vanilla baseline): every row writes at one common cache offset W; after
  verification each row keeps its accepted tokens at [W, W + a_i) and the slots up to
  W + max_j a_j are padding; inputs are padded to the longest; a refilled row's prompt is left-padded
  to W. Padding counts are reported (EMS-SD Table 1, Fig. 4).

Shape letters: b sequences, q inputs per sequence, N packed inputs, n tree nodes, d hidden, v vocab.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from drafttrain.target import fastattention
from drafttrain.sampling import GREEDY, SamplingParams, greedy_argmax, process_logits
from drafttrain.verify.acceptance import Acceptance, accept
from drafttrain.verify.cache import (
    RAGGED_ATTENTION,
    RaggedKVCache,
    RaggedSegments,
    WritePlan,
    attention_implementation,
    attention_kwargs_reach,
    batched_layout,
)
from drafttrain.verify.tree import DraftTree

MODES = ("unpadded", "unpadded_kv", "padded")


#: draft positions a verification step may add past the committed tokens (deeper than any draft tree built
#: here): a target with a sliding window must fit prompt + new tokens + this much in the window
WINDOW_SLACK = 64


@dataclass
class SequenceResult:
    """One prompt's output.

    Attributes:
        index: position of the prompt in the submitted list.
        tokens: generated token ids (prompt excluded; the stop token included when produced).
        finish_reason: ``"stop"`` or ``"length"``.
        steps: verification steps the sequence took part in.
        emitted: tokens emitted by those steps (all generated tokens but the prefill's first).
        accept_lengths: accepted drafts per step (0 .. tree depth).
        features: what the proposer's optional ``finish`` hook returned for this sequence (e.g. the
            recorded target hidden states of :class:`~drafttrain.generation.engine.FeatureRecorder`), else None.
    """

    index: int
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    steps: int = 0
    emitted: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    features: object = None

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else float("nan")


@dataclass
class EngineStats:
    """Counters of one run. Tokens are counted per sequence; ``forwards`` per batched target call.

    τ = ``emitted / seq_steps`` (tokens emitted per sequence per verification forward, bonus included,
    prefill excluded; docs/design.md, "Definitions"). Padding (EMS-SD): ``input_padding`` = padded input slots of the
    verification forwards, ``kv_padding`` = cache slots skipped to keep rows aligned (verification
    and refills); ratios are padded / real (``input_tokens``, ``kv_tokens`` = committed tokens).
    """

    forwards: int = 0  # verification forwards (engine steps)
    prefill_forwards: int = 0
    seq_steps: int = 0  # sum over steps of the sequences verified
    emitted: int = 0
    generated: int = 0
    prompts: int = 0
    input_tokens: int = 0
    input_padding: int = 0
    kv_tokens: int = 0
    kv_padding: int = 0
    prefill_tokens: int = 0
    prefill_padding: int = 0
    window_slots: int = 0  # cache slots the verification attention reads (all rows, summed over steps)
    window_valid: int = 0  # of which hold committed tokens (the rest is padding read for nothing)
    tree_nodes: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    prefill_seconds: float = 0.0  # the target's prompt forwards (part of ``seconds``)
    prefill_emitted: int = 0  # first tokens sampled from the prompt forwards (one per admitted sequence)
    replay_forwards: int = 0  # recurrent targets: forwards that replayed committed tokens after a rejected draft
    replay_tokens: int = 0
    replay_seconds: float = 0.0  # (part of ``seconds``)
    accept_hist: dict[int, int] = field(default_factory=dict)
    depth_attempts: dict[int, int] = field(default_factory=dict)  # depth -> steps that reached it with a node there
    depth_accepts: dict[int, int] = field(default_factory=dict)  # depth -> steps that accepted a node there

    @property
    def tau(self) -> float:
        return self.emitted / self.seq_steps if self.seq_steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens/s of the decoding steps alone: the tokens of finished sequences minus their first tokens
        (sampled from the prompt forward) over ``seconds`` minus the target's prompt forwards. Plain and
        speculative decoding of the same prompts run the same prompt forwards, so the ratio of this figure
        is what speculation changes, without the noise of a few long prefill forwards (a 16-prompt prefill
        is one ~3 s forward, ~25% of a batch-16 MT-bench run on 2 cores). Meaningful once every admitted
        sequence has finished (a finished run); NaN before any decoding time."""
        t = self.seconds - self.prefill_seconds
        return (self.generated - self.prefill_emitted) / t if t > 0 else float("nan")

    @property
    def input_padding_ratio(self) -> float:
        return self.input_padding / max(self.input_tokens, 1)

    @property
    def kv_padding_ratio(self) -> float:
        return self.kv_padding / max(self.kv_tokens, 1)

    @property
    def padding_ratio(self) -> float:
        """(padded input slots + padded cache slots) / (real inputs + committed tokens) of decoding."""
        return (self.input_padding + self.kv_padding) / max(self.input_tokens + self.kv_tokens, 1)

    @property
    def window_padding_ratio(self) -> float:
        """Padding read by the verification attention / committed tokens read (padded mode's attention waste)."""
        return (self.window_slots - self.window_valid) / max(self.window_valid, 1)

    def depth_acceptance(self) -> dict[int, float]:
        """depth -> P(node at that depth accepted | depth - 1 accepted and the tree reaches it)."""
        return {d: self.depth_accepts.get(d, 0) / n for d, n in sorted(self.depth_attempts.items()) if n}

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        out.update(
            tau=self.tau, tokens_per_s=self.tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
            padding_ratio=self.padding_ratio,
            input_padding_ratio=self.input_padding_ratio, kv_padding_ratio=self.kv_padding_ratio,
            window_padding_ratio=self.window_padding_ratio,
            depth_acceptance=self.depth_acceptance(),
        )  # fmt: skip
        return out


@dataclass
class EngineRun:
    results: list[SequenceResult]
    stats: EngineStats


@dataclass
class LiveSequence:
    """A sequence in the batch (for tests and debugging): its cache row and committed tokens."""

    row: int
    slot: int
    index: int
    committed: list[int]  # tokens whose keys/values are in the cache: prompt + generated[:-1]
    pending: int  # the root of the next tree


@dataclass
class _Seq:
    index: int
    slot: int
    prompt: list[int]
    result: SequenceResult
    pending: int = -1
    cap: int = 64  # max new tokens of this sequence

    @property
    def generated(self) -> list[int]:
        return self.result.tokens


class SpecEngine:
    """Batched speculative decoding of a prompt queue with one proposer and one acceptance rule.

    Args:
        target: :class:`drafttrain.target.Target` (driven through ``Target.forward`` only).
        proposer: a :class:`~drafttrain.verify.proposers.Proposer`. Its optional ``feature_layers`` (the
            drafter's declared target layer ids) choose the hidden states handed to ``start``/``commit``
            (the layers concatenated, [q, len(ids) * d]); absent or None: the final post-norm state.
        batch_size: sequences decoded together (continuous batching refills finished slots).
        max_new_tokens: generated tokens per prompt at most (the prefill's first token counts).
        mode: ``"unpadded"`` | ``"unpadded_kv"`` | ``"padded"`` (module docstring).
        sampling: temperature / top-p; greedy by default.
        stop_token_ids: ids that end a sequence (default: the target's eos).
        seed: RNG seed of sampling (acceptance and the proposer's draws).
        replacement: the proposer's sibling candidates are i.i.d. draws (default: without replacement).
        initial_capacity: cache slots per row to start with (the cache grows, and in padded mode first
            drops common leading padding, when a step needs more).
        pack_inputs: ``"unpadded"`` mode only. ``"always"``: every forward is packed into ``[1, N]``
            with per-sequence attention. ``"auto"`` (default): a forward with one input per row (plain
            decoding) runs as the equivalent ``[B, 1]`` tensor through the model's own attention (faster
            there); tree steps are packed. Nothing is padded either way.
        compile_target: run every target forward through :meth:`Target.compiled_backbone`
            (``torch.compile`` with freezing and dynamic shapes, one graph, no graph break): batch 1 only.
            The forward reads the whole cache row through the model's own sdpa attention with an additive
            mask (committed slots + the tree), so one compiled graph serves every input length and cache
            size. Costs minutes of compilation once per process (:meth:`warm_up_compiled`); measured
            ``docs/benchmarks/peers.md``. Outputs equal the eager engine's up to float reassociation.

    Raises:
        ValueError: unknown mode, batch_size < 1 or max_new_tokens < 1, ``compile_target`` with batch_size > 1.
    """

    def __init__(
        self,
        target,
        proposer,
        batch_size: int = 1,
        max_new_tokens: int = 64,
        mode: str = "unpadded",
        sampling: SamplingParams = GREEDY,
        stop_token_ids: Sequence[int] | int | None = None,
        seed: int = 0,
        replacement: bool = False,
        initial_capacity: int = 256,
        pack_inputs: str = "auto",
        compile_target: bool = False,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        if pack_inputs not in ("auto", "always"):
            raise ValueError(f"pack_inputs must be 'auto' or 'always', got {pack_inputs!r}")
        self.pack_inputs = pack_inputs
        if compile_target and batch_size != 1:
            raise ValueError(f"compile_target needs batch_size=1 (one cache row per forward), got {batch_size}")
        self.compile_target = bool(compile_target)
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be >= 1")
        from drafttrain.target import families

        families.check_engine_support(target.config)  # sinks / soft-capping: refused, never decoded wrongly
        self.window = families.attention_window(target.config)  # a sliding window: sequences must fit in it
        self.family = families.family_of(target.config).name
        target.structure  # read before any forward of the engine's own (its attention implementation, its masks)
        self.layout = target.cache_layout  # one cache kind per layer, read from the model (UnsupportedTarget if not)
        self.recurrent = any(c.is_recurrent for c in self.layout)
        if self.recurrent:
            where = families.recurrent_layers_text(target)
            if mode == "padded":
                raise ValueError(f"mode='padded' left-pads prompts, which {where} would read into their state: use "
                                 "mode='unpadded'")  # fmt: skip
            if compile_target:
                raise ValueError(f"compile_target runs one graph over the whole cache row; {where} keep states the "
                                 "graph does not hold: run without compile_target")  # fmt: skip
        self.target = target
        self.proposer = proposer
        from drafttrain.target import resolve_feature_layers

        # the target hidden states the proposer reads (validated here, against this target)
        layers = getattr(proposer, "feature_layers", None)  # optional protocol attribute (proposers.py)
        self.feature_layers = resolve_feature_layers(layers, target.config.num_hidden_layers)
        self.batch_size = int(batch_size)
        self.max_new_tokens = int(max_new_tokens)
        self.mode = mode
        self.sampling = sampling
        if stop_token_ids is None:
            stop_token_ids = [] if target.eos_token_id is None else [target.eos_token_id]
        elif isinstance(stop_token_ids, int):
            stop_token_ids = [stop_token_ids]
        self.stop_ids = {int(s) for s in stop_token_ids if s is not None and s >= 0}
        self.replacement = replacement
        self.device = target.device
        self.dtype = next(target.model.parameters()).dtype
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cache = RaggedKVCache(target.config, 0, initial_capacity, self.dtype, self.device, layout=self.layout)
        # packed [1, N] forwards: every layer plain attention and the segments reach the attention function
        self.packable = self.cache.packable and attention_kwargs_reach(target)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            # build (once per machine, ~20 s) and load the decode-attention kernel now, not inside the first
            # timed decoding step (a benchmark's first round read 49 against ~160 tokens/s at batch 16)
            fastattention.backend()
        self.rows: list[_Seq | None] = []  # cache row r holds sequence rows[r] (None: free)
        self.queue: deque[tuple[int, list[int], int]] = deque()  # (index, prompt, max new tokens)
        self.results: dict[int, SequenceResult] = {}
        self.stats = EngineStats()
        self._free_slots = list(range(self.batch_size))
        self._write_ptr = 0  # padded mode: the common cache offset W
        self._read_lo = 0  # padded mode: common leading padding no row needs (start of the read window)
        self._progress = None
        # optional proposer hook finish(slot, hidden) -> per-sequence data kept in SequenceResult.features:
        # called once per sequence before its release, with the hidden states of the last step's inputs
        # whose tokens were emitted (a plain step: the root's)
        self._finish_hook = getattr(proposer, "finish", None)
        self._observation = None  # a recurrent target's verification cost, reported once its replay is known

    # =============================================================================================
    # public driving API
    # =============================================================================================
    def submit(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int] | None = None) -> None:
        """Queue prompts (token id lists, each non-empty).

        Args:
            prompts: token id lists.
            max_new_tokens: one cap per prompt (each >= 1); default the engine's ``max_new_tokens``.

        Raises:
            ValueError: an empty prompt, caps that do not match the prompts or are < 1, or (a target with a
                sliding window, :func:`drafttrain.target.families.attention_window`) a prompt + cap + ``WINDOW_SLACK``
                draft positions longer than the window: the engine's masks have no window, so it refuses
                rather than decode differently from the target.
        """
        caps = [self.max_new_tokens] * len(prompts) if max_new_tokens is None else [int(n) for n in max_new_tokens]
        if len(caps) != len(prompts) or min(caps, default=1) < 1:
            raise ValueError(f"max_new_tokens needs one cap >= 1 per prompt, got {list(max_new_tokens)} "
                             f"for {len(prompts)} prompts")  # fmt: skip
        base = self.stats.prompts
        for i, (p, cap) in enumerate(zip(prompts, caps)):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {base + i} is empty")
            if self.window is not None and len(p) + cap + WINDOW_SLACK > self.window:
                raise ValueError(f"prompt {base + i}: {len(p)} tokens + {cap} new + {WINDOW_SLACK} draft positions "
                                 f"exceed the {self.family} target's sliding window of {self.window} tokens; the "
                                 "engine attends without a window, so it would decode differently: shorten it")  # fmt: skip
            self.queue.append((base + i, p, cap))
        self.stats.prompts += len(prompts)

    @property
    def done(self) -> bool:
        return not self.queue and all(s is None for s in self.rows)

    def run(self, prompts: Sequence[Sequence[int]], progress: bool | str = False,
            max_new_tokens: Sequence[int] | None = None) -> EngineRun:  # fmt: skip
        """Decode every prompt; returns per-prompt results (in prompt order) and the run's counters.

        Args:
            prompts: token id lists.
            progress: show a tqdm bar over finished prompts (a str is used as its description).
            max_new_tokens: one cap per prompt (default the engine's ``max_new_tokens`` for all).
        """
        self.submit(prompts, max_new_tokens)
        desc = progress if isinstance(progress, str) else f"{self.proposer.name}/{self.mode}/b{self.batch_size}"
        with tqdm(total=len(prompts), desc=desc, disable=not progress, leave=False) as bar:
            self._progress = bar
            while not self.done:
                self.advance()
            self._progress = None
        return self.result()

    def advance(self) -> None:
        """One turn of the decoding loop: admit waiting prompts (continuous batching: one prefill per
        wave), then one verification step of the live batch; its wall time is added to
        ``stats.seconds``. :meth:`run` is ``submit`` + ``advance`` until ``done``; two engines advanced in
        turn (:func:`drafttrain.eval.driver.run_interleaved`, ``unit="step"``) are timed side by side."""
        t0 = time.perf_counter()
        self.admit()
        if any(s is not None for s in self.rows):
            self.step()
        self.stats.seconds += time.perf_counter() - t0

    def result(self) -> EngineRun:
        """Every finished prompt's result (in submission order) and the counters so far."""
        return EngineRun([self.results[i] for i in sorted(self.results)], self.stats)

    def live(self) -> list[LiveSequence]:
        """The sequences in the batch now, by cache row."""
        return [
            LiveSequence(r, s.slot, s.index, s.prompt + s.generated[:-1], s.pending)
            for r, s in enumerate(self.rows)
            if s is not None
        ]

    # =============================================================================================
    # admission: continuous batching + prefill
    # =============================================================================================
    def admit(self) -> None:
        """Fill free slots from the queue (one prefill forward per wave); drop free rows once the queue is empty."""
        while self.queue and sum(s is not None for s in self.rows) < self.batch_size:
            free = [r for r, s in enumerate(self.rows) if s is None]
            n_new = min(len(self.queue), self.batch_size - sum(s is not None for s in self.rows))
            if len(free) < n_new:
                self.cache.add_rows(n_new - len(free))
                self.rows.extend([None] * (n_new - len(free)))
                free = [r for r, s in enumerate(self.rows) if s is None]
            new_rows = free[:n_new]
            seqs = []
            for r in new_rows:
                index, prompt, cap = self.queue.popleft()
                seq = _Seq(index, self._free_slots.pop(0), prompt, SequenceResult(index, len(prompt)), cap=cap)
                self.rows[r] = seq
                seqs.append(seq)
            self._prefill(new_rows, seqs)
        if not self.queue:
            keep = [r for r, s in enumerate(self.rows) if s is not None]
            if len(keep) < len(self.rows):
                self.cache.keep_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
                self.rows = [self.rows[r] for r in keep]
        self._trim()

    def _prefill(self, rows: list[int], seqs: list[_Seq]) -> None:
        """Prompt forward of newly admitted sequences; samples each one's first token and starts its proposer."""
        cache = self.cache
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        cache.valid[idx] = False
        cache.lengths[idx] = 0
        cache.reset_rows(rows)  # recurrent layers: a new sequence starts from zero states
        lens = [len(s.prompt) for s in seqs]
        p_max = max(lens)
        if self.mode == "padded":  # left-pad every new prompt to end at the common offset W (grow W if needed)
            w_new = max(self._write_ptr, p_max)
            others = sum(1 for r, s in enumerate(self.rows) if s is not None and r not in rows)
            self.stats.kv_padding += (w_new - self._write_ptr) * others
            self._write_ptr = w_new
            self._read_lo = min(self._read_lo, w_new - p_max)
            slots = [torch.arange(w_new - n, w_new, device=self.device) for n in lens]
            self.stats.prefill_padding += sum(p_max - n for n in lens)
        else:
            slots = [torch.arange(n, device=self.device) for n in lens]
            if self.mode == "unpadded_kv":
                self.stats.prefill_padding += sum(p_max - n for n in lens)
        cache.ensure_capacity(self._write_ptr if self.mode == "padded" else p_max)
        toks = [torch.tensor(s.prompt, dtype=torch.long, device=self.device) for s in seqs]
        pos = [torch.arange(n, device=self.device) for n in lens]
        causal = [torch.ones(n, n, dtype=torch.bool, device=self.device).tril() for n in lens]
        t0 = time.perf_counter()
        last = [torch.tensor([n - 1], device=self.device) for n in lens]  # each prompt's last input: its logits
        hidden, logits = self._forward(rows, toks, pos, causal, slots, last, left_pad=self.mode == "padded")
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(lens)
        self.stats.prefill_emitted += len(seqs)
        for r, seq, sl, h, lg in zip(rows, seqs, slots, hidden, logits):
            cache.valid[r, sl] = True
            cache.lengths[r] = len(seq.prompt)
            first = self._sample_token(lg[0])
            seq.pending = first
            seq.result.tokens.append(first)
            if first in self.stop_ids or seq.cap <= 1:
                if self._finish_hook is not None:  # the proposer collects per-sequence data: give it the prompt's
                    self.proposer.start(seq.slot, seq.prompt, h, first)
                    seq.result.features = self._finish_hook(seq.slot, h[:0])
                    self._finish(r, "stop" if first in self.stop_ids else "length")
                else:
                    self._finish(r, "stop" if first in self.stop_ids else "length", started=False)
            else:
                self.proposer.start(seq.slot, seq.prompt, h, first)

    def _sample_token(self, logits: torch.Tensor) -> int:
        if self.sampling.greedy:
            return int(greedy_argmax(logits.reshape(-1)))
        return int(torch.multinomial(process_logits(logits, self.sampling), 1, generator=self.generator))

    def _finish(self, row: int, reason: str, started: bool = True) -> None:
        seq = self.rows[row]
        seq.result.finish_reason = reason
        self.results[seq.index] = seq.result
        self.stats.generated += len(seq.result.tokens)
        if started:
            self.proposer.release(seq.slot)
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
        self.rows[row] = None
        self.cache.valid[row] = False
        self.cache.lengths[row] = 0
        if self._progress is not None:
            self._progress.update(1)

    def _trim(self) -> None:
        """Padded mode: skip the leading slots that no live row uses (common padding)."""
        if self.mode != "padded":
            return
        live = [r for r, s in enumerate(self.rows) if s is not None]
        if not live:
            self._write_ptr = self._read_lo = 0
            return
        v = self.cache.valid[live, : self._write_ptr]
        first = v.float().argmax(dim=1)  # first committed slot of each row
        self._read_lo = int(first.min())

    # =============================================================================================
    # one verification step
    # =============================================================================================
    def step(self) -> None:
        """Draft, verify and commit once for every live sequence."""
        live = [r for r, s in enumerate(self.rows) if s is not None]
        seqs = [self.rows[r] for r in live]
        t0 = time.perf_counter()
        trees = self.proposer.draft([s.slot for s in seqs], self.sampling, self.generator)
        self.stats.draft_seconds += time.perf_counter() - t0
        if len(trees) != len(seqs):
            raise RuntimeError(f"proposer returned {len(trees)} trees for {len(seqs)} sequences")
        logits, hidden = self.forward_trees(trees, rows=live)
        self._commit(live, seqs, trees, logits, hidden)
        done = getattr(self.proposer, "step_done", None)  # the planner's step time ends here (verify/planner.py)
        if done is not None:
            done()

    def forward_trees(self, trees: list[DraftTree], rows: list[int] | None = None):
        """Run the verification forward of one tree per live row; writes K/V but commits nothing.

        Args:
            trees: one :class:`DraftTree` per row in ``rows``.
            rows: cache rows (default: every live row, in order).

        Returns:
            (logits, hidden): per row, [1 + n_i, v] float32 target logits and [1 + n_i, F] hidden states
            of the proposer's ``feature_layers`` (F = len(ids) * d; default the final post-norm state, F = d)
            at [root, node 0..n_i-1].
        """
        if rows is None:
            rows = [r for r, s in enumerate(self.rows) if s is not None]
        cache = self.cache
        toks, pos, masks, slots = [], [], [], []
        q = [1 + t.n for t in trees]
        if self.recurrent:
            for t in trees:
                if t.n and not bool((t.parents.cpu() == torch.arange(-1, t.n - 1, device="cpu")).all()):
                    from drafttrain.target import families

                    raise ValueError(f"{families.recurrent_layers_text(self.target)}: the engine verifies draft "
                                     "chains on this target (a recurrent state follows one sequence; a tree's "
                                     f"branches would share it), and {self.proposer.name} drafted a tree: draft a "
                                     "chain (tree.widths=null)")  # fmt: skip
        for r, tree in zip(rows, trees):
            seq = self.rows[r]
            # assembled on the host (trees live there, drafttrain.verify.tree), then one copy each
            toks.append(torch.cat([torch.tensor([seq.pending], device="cpu"), tree.tokens.cpu()]).to(self.device))
            depth = torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), tree.depth()]).to(self.device)
            pos.append(cache.lengths[r] + depth)  # position = cache length + depth
            masks.append(tree.ancestor_mask().to(self.device))
        if self.mode == "padded":  # every row writes at the common offset W
            q_max = max(q)
            if self._write_ptr + q_max > cache.capacity and self._read_lo > 0:
                cache.shift_left(self._read_lo)
                self._write_ptr -= self._read_lo
                self._read_lo = 0
            cache.ensure_capacity(self._write_ptr + q_max)
            slots = [torch.arange(self._write_ptr, self._write_ptr + n, device=self.device) for n in q]
            self.stats.window_slots += len(rows) * (self._write_ptr - self._read_lo)
            self.stats.window_valid += int(cache.valid[rows, self._read_lo : self._write_ptr].sum())
        else:  # each row writes after its own committed tokens
            lens = [int(cache.lengths[r]) for r in rows]
            q_pad = [max(q)] * len(q) if self.mode == "unpadded_kv" else q  # batched inputs pad up to q_max
            cache.ensure_capacity(max(n + k for n, k in zip(lens, q_pad)))
            slots = [n0 + torch.arange(n, device=self.device) for n0, n in zip(lens, q)]
            self.stats.window_slots += sum(lens)
            self.stats.window_valid += sum(lens)
        sel = [torch.arange(n, device=self.device) for n in q]
        t0 = time.perf_counter()
        hidden, logits = self._forward(rows, toks, pos, masks, slots, sel, left_pad=False,
                                       states="snapshot" if max(q) > 1 else "commit")  # fmt: skip
        dt = time.perf_counter() - t0
        self.stats.forward_seconds += dt
        report = getattr(self.proposer, "observe_forward", None)  # the planner's cost curve (verify/planner.py)
        if report is not None:
            if self.recurrent and max(q) > 1:  # reported after the commit, with its replay (what the step costs)
                self._observation = (report, len(rows), sum(q), dt)
            else:
                report(len(rows), sum(q), dt)
        return logits, hidden

    def _commit(self, rows, seqs, trees, logits, hidden) -> None:
        cache = self.cache
        st = self.stats
        roots = {r: seq.pending for r, seq in zip(rows, seqs)}  # the token each row's step was fed first
        rule = getattr(self.proposer, "accept", None)  # a proposer's own rule (SSSD, MCSD, MTAD) wins
        if rule is not None:
            results: list[Acceptance] = [
                rule(seq.slot, t, lg, self.sampling, self.generator) for seq, t, lg in zip(seqs, trees, logits)
            ]
        else:
            results = [accept(t, lg, self.sampling, self.generator, self.replacement) for t, lg in zip(trees, logits)]
        # tokens whose K/V this step commits: the root + the accepted path; with no bonus token (MCSD with
        # target-sampled roots) the last accepted node becomes the next root and is re-fed next step
        keep = {}
        for r, acc in zip(rows, results):
            if acc.bonus is None and not acc.path:
                raise RuntimeError("an acceptance without a bonus token must accept at least one node")
            keep[r] = 1 + len(acc.path) if acc.bonus is not None else len(acc.path)
        # keys/values of [root, accepted path] -> contiguous slots [base, base + 1 + m)
        base = {r: (self._write_ptr if self.mode == "padded" else int(cache.lengths[r])) for r in rows}
        mv_rows, mv_src, mv_dst = [], [], []
        for r, acc in zip(rows, results):
            for d, node in enumerate(acc.path):
                if node != d:  # node i sits at slot base + 1 + i; depth d + 1 belongs at base + 1 + d
                    mv_rows.append(r)
                    mv_src.append(base[r] + 1 + node)
                    mv_dst.append(base[r] + 1 + d)
        if mv_rows:
            as_t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
            cache.move(as_t(mv_rows), as_t(mv_src), as_t(mv_dst))
        a_max = max(keep.values())
        q = [1 + t.n for t in trees]
        st.forwards += 1
        st.input_tokens += sum(q)
        if self.mode != "unpadded":
            st.input_padding += sum(max(q) - n for n in q)
        for r, seq, tree, acc, h in zip(rows, seqs, trees, results, hidden):
            m = len(acc.path)
            cache.valid[r, base[r] : base[r] + keep[r]] = True
            cache.lengths[r] += keep[r]
            st.kv_tokens += keep[r]
            if self.mode == "padded":
                st.kv_padding += a_max - keep[r]
            # statistics
            st.seq_steps += 1
            st.tree_nodes += tree.n
            st.accept_hist[m] = st.accept_hist.get(m, 0) + 1
            for d in range(1, tree.max_depth + 1):
                if m >= d - 1:
                    st.depth_attempts[d] = st.depth_attempts.get(d, 0) + 1
                    st.depth_accepts[d] = st.depth_accepts.get(d, 0) + int(m >= d)
            # emit accepted drafts + bonus, up to a stop token and max_new_tokens
            new = tree.tokens[acc.path].tolist() + ([acc.bonus] if acc.bonus is not None else [])
            full = list(new)
            stop_at = next((i for i, t in enumerate(new) if t in self.stop_ids), None)
            if stop_at is not None:
                new = new[: stop_at + 1]
            new = new[: seq.cap - len(seq.generated)]
            seq.result.tokens.extend(new)
            seq.result.steps += 1
            seq.result.emitted += len(new)
            seq.result.accept_lengths.append(m)
            st.emitted += len(new)
            seq.pending = full[-1]
            fed = [0] + [p + 1 for p in acc.path]  # rows of [root, path] in this step's input
            stopped = stop_at is not None and stop_at < len(new)
            if stopped or len(seq.generated) >= seq.cap:
                if self._finish_hook is not None:  # the items of the emitted tokens before the last one
                    seq.result.features = self._finish_hook(seq.slot, h[fed[: len(new)]])
                self._finish(r, "stop" if stopped else "length")
            else:
                self.proposer.commit(seq.slot, full, h[fed[: len(full)]])
        if self.mode == "padded":
            self._write_ptr += a_max
        if self.recurrent and max(q) > 1:
            self._settle_states(rows, seqs, trees, results, q, base, keep, roots)
            if self._observation is not None:  # the planner sees the verification with its replay
                report, n_rows, n_tokens, dt = self._observation
                self._observation = None
                report(n_rows, n_tokens, dt)

    # =============================================================================================
    # the target forward (packed or batched)
    # =============================================================================================
    def _settle_states(self, rows, seqs, trees, results, q, base, keep, roots) -> None:
        """Recurrent layers after a verification forward (docs/design.md, "Recurrent state and rollback"): a row whose
        inputs were all committed and not padded (every draft accepted in a forward of equal-length rows) keeps the
        forward's states; every other row's states stay as they were before the forward (the snapshot), and its
        committed tokens (root + accepted drafts) are replayed in forwards of equal-length rows, so the state ends
        exactly where plain decoding of those tokens leaves it. Rows that finished this step are skipped."""
        q_max = max(q)
        exact = [keep[r] == q_max for r in rows]
        self.cache.end_states(exact)
        replay = [(r, seq, acc) for r, seq, acc, ok in zip(rows, seqs, results, exact)
                  if not ok and self.rows[r] is seq]  # fmt: skip
        if not replay:
            return
        t0 = time.perf_counter()
        toks, pos, masks, slots, sel, rr = [], [], [], [], [], []
        tree_of = dict(zip(rows, trees))
        for r, seq, acc in replay:
            n = keep[r]
            committed = ([roots[r]] + tree_of[r].tokens[acc.path].tolist())[:n]
            toks.append(torch.tensor(committed, dtype=torch.long, device=self.device))
            ar = torch.arange(n, device=self.device)
            pos.append(base[r] + ar)
            slots.append(base[r] + ar)
            masks.append(torch.ones(n, n, dtype=torch.bool, device=self.device).tril())
            sel.append(ar[:0])
            rr.append(r)
        self._forward(rr, toks, pos, masks, slots, sel, left_pad=False, states="commit", logits=False)
        self.stats.replay_forwards += len({t.numel() for t in toks})
        self.stats.replay_tokens += sum(t.numel() for t in toks)
        dt = time.perf_counter() - t0
        self.stats.replay_seconds += dt
        self._observation = self._observation and (*self._observation[:3], self._observation[3] + dt)

    def _forward(self, rows, toks, pos, masks, slots, sel, left_pad: bool, states: str = "commit",
                 logits: bool = True):  # fmt: skip
        """One target forward over per-row inputs; keys/values go to (row, slot); returns per row
        (features [q_i, F] of the proposer's feature layers, logits [len(sel_i), v]) for the real inputs.

        A target with recurrent layers runs batched (never packed: a recurrent layer reads its whole input row as
        one sequence). ``states="commit"``: rows are grouped by input length, one forward per group, so no row is
        padded and every row's states are exact afterwards (prefills, replays, plain steps). ``"snapshot"``: one
        forward; the states are left out of place until :meth:`_settle_states` decides which rows keep them."""
        if self.recurrent:
            if states == "commit":
                by_len: dict[int, list[int]] = {}
                for i, t in enumerate(toks):
                    by_len.setdefault(t.numel(), []).append(i)
                out_h: list = [None] * len(rows)
                out_l: list = [None] * len(rows)
                for group in by_len.values():
                    g_rows = [rows[i] for i in group]
                    self.cache.begin_states(g_rows, snapshot=False)
                    try:
                        h, f = self._forward_batched(g_rows, [toks[i] for i in group], [pos[i] for i in group],
                                                     [masks[i] for i in group], [slots[i] for i in group], left_pad)
                    except BaseException:
                        self.cache.end_states([False] * len(g_rows))
                        raise
                    self.cache.end_states(None)
                    for j, i in enumerate(group):
                        out_h[i], out_l[i] = f[j], h[j]
                hidden, feats = out_l, out_h
            else:
                self.cache.begin_states(rows, snapshot=True)
                hidden, feats = self._forward_batched(rows, toks, pos, masks, slots, left_pad)
            if not logits:
                return feats, None
            picked = torch.cat([h[s.to(h.device)] for h, s in zip(hidden, sel)])  # [M, d]
            lg = self.target.lm_head(picked).float()
            return feats, list(torch.split(lg, [s.numel() for s in sel]))
        plain = {t.numel() for t in toks} == {1}  # one input per row: [B, 1] through the model's own attention
        if self.compile_target:
            hidden, feats = self._forward_compiled(rows, toks, pos, masks, slots)
        elif self.mode == "unpadded" and self.packable and not (plain and self.pack_inputs == "auto"):
            hidden, feats = self._forward_packed(rows, toks, pos, masks, slots)
        else:
            hidden, feats = self._forward_batched(rows, toks, pos, masks, slots, left_pad)
        picked = torch.cat([h[s.to(h.device)] for h, s in zip(hidden, sel)])  # [M, d]
        logits = self.target.lm_head(picked).float()  # LM head only where logits are needed
        return feats, list(torch.split(logits, [s.numel() for s in sel]))

    def _target_forward(self, ids, **kwargs):
        """``Target.forward`` keeping the proposer's feature layers. Returns (hidden [1|B, q, d] post-norm,
        features [1|B, q, F])."""
        out = self.target.forward(ids, with_logits=False, use_cache=True, feature_layers=self.feature_layers, **kwargs)
        return out.hidden, out.features

    def _neg(self) -> float:
        return torch.finfo(self.dtype).min

    def _packed_mask(self, rows, slots, masks, width: int) -> torch.Tensor:
        """Additive mask [1, 1, N, width] (N = the rows' inputs concatenated) over the first ``width`` cache slots
        of each input's own row: the row's committed slots (``cache.valid``) plus the inputs' own tree/causal
        mask ``masks[i]`` [q_i, q_i] over their slots ``slots[i]`` [q_i]; 0 where attended, dtype min elsewhere."""
        n = sum(s.numel() for s in slots)
        allowed = torch.zeros(n, width, dtype=torch.bool, device=self.device)  # [N, kv] in each token's own row
        a = 0
        for r, s, m in zip(rows, slots, masks):
            b = a + s.numel()
            allowed[a:b] = self.cache.valid[r, :width]  # committed prefix
            allowed[a:b, s] = m  # tree / causal part over the new slots
            a = b
        mask = torch.zeros(1, 1, n, width, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed[None, None], self._neg())

    def _forward_packed(self, rows, toks, pos, masks, slots):
        """EMS-SD unpad input tokens: concatenate all inputs (Appendix D, Algorithm 1) and attend per sequence."""
        cache = self.cache
        q = [t.numel() for t in toks]
        hi = max(int(s[-1]) + 1 for s in slots)
        mask = self._packed_mask(rows, slots, masks, hi)
        starts = [0]
        for k in q:
            starts.append(starts[-1] + k)
        segs = RaggedSegments(starts[:-1], starts[1:], list(rows), [int(s[-1]) + 1 for s in slots])
        row_ids = torch.cat([torch.full((k,), r, dtype=torch.long, device=self.device) for r, k in zip(rows, q)])
        cache.set_plan(WritePlan(row_ids[None], torch.cat(slots)[None], None, 0, hi, packed=True))
        try:
            with attention_implementation(self.target.model, RAGGED_ATTENTION):
                hidden, feats = self._target_forward(
                    torch.cat(toks)[None], attention_mask=mask, position_ids=torch.cat(pos)[None],
                    cache=cache, ragged_segments=segs,
                )  # fmt: skip
        finally:
            cache.set_plan(None)
        h = list(torch.split(hidden[0], q))  # [q_i, d] each
        return h, (h if feats is hidden else list(torch.split(feats[0], q)))  # features [q_i, F] each

    def _forward_compiled(self, rows, toks, pos, masks, slots):
        """One row through the compiled backbone: inputs [1, q], additive mask [1, 1, q, cap] over the whole
        cache row (committed slots + the inputs' own tree/causal mask), keys/values written at ``slots``.

        Every tensor the graph sees has a shape of (q, cap) only, both dynamic, so one graph serves every
        step (plus one for q = 1, which dynamo specialises): no plan value reaches the graph as a Python int.
        """
        if len(rows) != 1 or self.cache.batch_size != 1:
            raise RuntimeError("compile_target: a forward of one cache row was expected")
        cache = self.cache
        row, s = rows[0], slots[0]
        q, cap = s.numel(), cache.capacity
        mask = self._packed_mask(rows, slots, masks, cap)  # [1, 1, q, cap] over the whole cache row
        for layer in cache.layers:  # any capacity reuses the graph (no recompile when the cache grows)
            torch._dynamo.maybe_mark_dynamic(layer.keys, 2)
            torch._dynamo.maybe_mark_dynamic(layer.values, 2)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        cache.set_plan(WritePlan(torch.full((1, q), row, dtype=torch.long, device=self.device), s[None], None, 0,
                                 cap, packed=True))  # fmt: skip
        try:
            with attention_implementation(self.target.model, "sdpa"):
                hidden, feats = self._target_forward(toks[0][None], attention_mask=mask, position_ids=pos[0][None],
                                                     cache=cache, compiled=True)  # fmt: skip
        finally:
            cache.set_plan(None)
        return [hidden[0]], [feats[0]]  # [q, d], [q, F]

    def warm_up_compiled(self, feature_layers: Sequence[int] | None = None) -> float:
        """Compile the backbone's graphs (a 2-token and a 1-token forward on a scratch cache) before any timed
        work, so that no decoding step (and no planner cost observation) pays for compilation.

        Args:
            feature_layers: the target layers whose states the graphs return (their set decides the graph:
                the final state alone, or every hidden state); default the engine's own proposer's. Lets one
                engine compile for another proposer's layers (the harness compiles before it builds them).

        Returns:
            seconds spent (minutes on the 2-core CPU the first time in a process; ~0 once compiled).

        Raises:
            RuntimeError: the engine was built without ``compile_target``.
            ValueError: a layer id outside the target.
        """
        from drafttrain.target import resolve_feature_layers

        if not self.compile_target:
            raise RuntimeError("warm_up_compiled needs compile_target=True")
        t0 = time.perf_counter()
        saved, saved_layers = self.cache, self.feature_layers
        if feature_layers is not None:
            self.feature_layers = resolve_feature_layers(feature_layers, self.target.num_hidden_layers)
        self.cache = RaggedKVCache(self.target.config, 1, 16, self.dtype, self.device, layout=self.layout)
        try:
            for q in (2, 1):
                tri = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
                ar = torch.arange(q, device=self.device)
                self._forward_compiled([0], [torch.zeros(q, dtype=torch.long, device=self.device)], [ar], [tri], [ar])
        finally:
            self.cache, self.feature_layers = saved, saved_layers
        return time.perf_counter() - t0

    def _forward_batched(self, rows, toks, pos, masks, slots, left_pad: bool):
        """[B, q_max] inputs; padding continues each row's slots on the padding side (padded mode counts it)."""
        lo = self._read_lo if self.mode == "padded" else 0
        lay = batched_layout(self.cache, rows, masks, slots, self.dtype, left_pad=left_pad, lo=lo)
        self.cache.set_plan(lay.plan)
        try:  # the engine's attention: sdpa, or the decode kernel at one input per row (verify/cache.py)
            with attention_implementation(self.target.model, RAGGED_ATTENTION):
                hidden, feats = self._target_forward(lay.scatter(toks), attention_mask=lay.mask,
                                                     position_ids=lay.scatter(pos), cache=self.cache)  # fmt: skip
        finally:
            self.cache.set_plan(None)
        h = lay.gather(hidden)
        return h, (h if feats is hidden else lay.gather(feats))
