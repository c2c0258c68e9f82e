"""Tests of the batched verifier engine (drafttrain.verify.engine) on tiny targets (< 60 s).

The "varied" target (the tiny target with its 2-D weights redrawn at std 0.3) changes its greedy
token at every step, so token bookkeeping errors cannot hide behind a repeated token. Proposers:

- ``OracleProposer`` drafts the target's own greedy continuation inside a tree of ``width``
  siblings per depth, the true token at a sibling position that changes every step (so accepted
  nodes are rarely at index depth - 1 and their keys/values must be moved); ``correct(step)``
  limits how many depths contain the true token. It also checks every (token, feature) item the
  engine hands it against the target's own features of the true sequence.
- ``correct=lambda s: 0`` makes it the always-wrong proposer; together they pin the acceptance
  rule from both sides.
- ``ParallelSpecProposer`` with a random drafter, as shipped.
- ``PlainProposer``: plain decoding through the same engine.
"""

from __future__ import annotations


import pytest
import torch

from drafttrain.verify import MODES, DraftTree, ParallelSpecProposer, PlainProposer, SamplingParams, SpecEngine

PROMPT_LENGTHS = (3, 11, 30, 7, 19)
NEW = 24
DEPTH, WIDTH = 3, 2
ENGINES = [(m, "auto") for m in MODES] + [("unpadded", "always")]  # (mode, pack_inputs)


@pytest.fixture(scope="module")
def target(varied_target):
    """The tiny target with redrawn weights (conftest.varied_target): its greedy token changes every step."""
    return varied_target


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def continuations(target, prompts):
    """Each prompt's plain greedy continuation (no stop token), one prompt at a time, and its features."""
    out = {}
    for p in prompts:
        full = target.generate_greedy([p], NEW + DEPTH + 2, stop_token_id=-1, return_features=False)[0]["tokens"]
        out[tuple(p)] = (full[len(p) :], target.features(torch.tensor([full]))[0])
    return out


@pytest.fixture(scope="module")
def stops(continuations, prompts):
    """Stop ids that end prompts 0 and 3 early at different steps; the others run to the length cap."""
    a = continuations[tuple(prompts[0])][0]
    b = continuations[tuple(prompts[3])][0]
    return [a[6], b[13]]


def _plain_reference(target, prompts, stop_ids, n=NEW):
    """Plain greedy decoding one prompt at a time with HF-style stopping (the reference every mode must equal)."""
    out = []
    for p in prompts:
        cont = target.generate_greedy([p], n, stop_token_id=-1, return_features=False)[0]["tokens"][len(p) :]
        cut = next((i for i, t in enumerate(cont) if t in stop_ids), None)
        out.append(cont if cut is None else cont[: cut + 1])
    return out


class OracleProposer:
    name = "oracle"

    def __init__(self, continuations, depth=DEPTH, width=WIDTH, correct=lambda step: DEPTH, vocab=49152):
        self.conts, self.depth, self.width, self.correct, self.vocab = continuations, depth, width, correct, vocab
        self.state = {}
        self.chosen = []

    def _check_items(self, st, tokens, hidden):
        cont, feats = st["cont"], st["feats"]
        n0 = st["items"]  # items seen so far; item i = (x_{i+1}, f_i)
        full = st["prompt"] + cont
        assert list(tokens) == full[n0 + 1 : n0 + 1 + len(tokens)], "items carry the wrong tokens"
        torch.testing.assert_close(hidden.float(), feats[n0 : n0 + len(tokens)].float(), atol=1e-4, rtol=1e-4)
        st["items"] += len(tokens)

    def start(self, slot, prompt_ids, hidden, first_token):
        cont, feats = self.conts[tuple(prompt_ids)]
        assert first_token == cont[0]
        st = {"prompt": list(prompt_ids), "cont": cont, "feats": feats, "items": 0, "step": 0}
        self._check_items(st, list(prompt_ids[1:]) + [first_token], hidden)
        self.state[slot] = st

    def draft(self, slots, sampling=None, generator=None):
        trees = []
        for slot in slots:
            st = self.state[slot]
            g = st["items"] - len(st["prompt"]) + 1  # tokens generated so far (the root is cont[g - 1])
            r = self.correct(st["step"])
            self.chosen.append(r)
            toks, parents, true_node = [], [], -1
            for t in range(self.depth):
                true_tok = st["cont"][g + t]
                pos = (st["step"] + t) % self.width  # where the true token sits among the siblings
                first = len(toks)
                for j in range(self.width):
                    ok = t < r and j == pos
                    toks.append(true_tok if ok else (true_tok + 1 + j) % self.vocab)
                    parents.append(true_node)
                if t >= r:
                    break
                true_node = first + pos
            st["step"] += 1
            trees.append(DraftTree(torch.tensor(toks), torch.tensor(parents)))
        return trees

    def commit(self, slot, tokens, hidden):
        self._check_items(self.state[slot], tokens, hidden)

    def release(self, slot):
        self.state.pop(slot)


def _proposers(continuations, make_drafter):
    return {
        "plain": lambda: PlainProposer(),
        "parallelspec": lambda: ParallelSpecProposer(make_drafter(seed=0).eval(), widths=[3, 2, 1, 1], budget=6),
        "oracle": lambda: OracleProposer(continuations),
        "wrong": lambda: OracleProposer(continuations, correct=lambda s: 0),
        "partial": lambda: OracleProposer(continuations, correct=lambda s: [2, 0, 3, 1][s % 4]),
    }


# --------------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("mode, pack", ENGINES)
def test_greedy_equals_plain_for_every_proposer(target, prompts, continuations, stops, make_drafter, mode, pack):
    """Greedy speculative output == plain greedy output, token for token, for every proposer, with a batch
    of prompts of different lengths finishing at different steps (stop tokens, length cap) and more
    prompts than slots (continuous batching refills)."""
    ref = _plain_reference(target, prompts, stops)
    assert len({len(r) for r in ref}) >= 3  # they do finish at different steps
    for name, make in _proposers(continuations, make_drafter).items():
        for bs in (1, 3) if name in ("plain", "parallelspec") else (3,):
            run = SpecEngine(target, make(), batch_size=bs, max_new_tokens=NEW, mode=mode, stop_token_ids=stops,
                             pack_inputs=pack).run(prompts)  # fmt: skip
            assert [r.tokens for r in run.results] == ref, f"{name} bs={bs}"
            for r, rf in zip(run.results, ref):
                assert r.finish_reason == ("stop" if rf[-1] in stops else "length")
                assert r.emitted == len(r.tokens) - 1 and r.steps == len(r.accept_lengths)
            if name == "oracle":  # all DEPTH drafts + the bonus accepted at every step but the capped last
                assert all(a == DEPTH for r in run.results for a in r.accept_lengths)
            if name in ("wrong", "plain"):
                assert run.stats.tau == 1.0 and set(run.stats.accept_hist) == {0}


def test_greedy_equals_hf_generate(target, prompts, continuations, make_drafter):
    """The engine's output equals Hugging Face generate() greedy output for the same prompts."""
    eos = target.eos_token_id
    run = SpecEngine(target, OracleProposer(continuations, correct=lambda s: [2, 0, 3][s % 3]), batch_size=2,
                     max_new_tokens=NEW, mode="unpadded").run(prompts)  # fmt: skip
    run2 = SpecEngine(target, ParallelSpecProposer(make_drafter(seed=1).eval()), batch_size=4,
                      max_new_tokens=NEW, mode="padded").run(prompts)  # fmt: skip
    for p, r, r2 in zip(prompts, run.results, run2.results):
        ids = torch.tensor([p])
        hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                   eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist()  # fmt: skip
        assert r.tokens == hf and r2.tokens == hf


def test_parallelspec_chain_matches_single_sequence_reference(target, prompts, make_drafter):
    """ParallelSpecProposer with its default chain tree takes exactly the steps of the in-training reference
    loop (tests/reference_decoding.speculative_greedy): the drafter gets the same items and its cache stays in
    step. An oracle drafter (tests/eval/test_spec_eval.py) with a cycle of right-prefix lengths makes every
    accept length occur; a random drafter runs two sequences interleaved."""
    from reference_decoding import speculative_greedy
    from eval.test_spec_eval import K, OracleDrafter

    prompts = prompts[:3]
    cycle = [2, 0, 4, 1, 3]
    oracle = OracleDrafter(target, prompts, horizon=NEW, correct=lambda step: cycle[step % len(cycle)])
    oracle.num_mask_tokens = K
    for mode in MODES:
        run = SpecEngine(target, ParallelSpecProposer(oracle), batch_size=1, max_new_tokens=NEW, mode=mode).run(prompts)
        for r in run.results:
            assert r.accept_lengths == [cycle[i % len(cycle)] for i in range(r.steps)], mode
    drafter = make_drafter(seed=2).eval()
    refs = [speculative_greedy(target, drafter, p, NEW) for p in prompts]
    for mode in MODES:
        run = SpecEngine(target, ParallelSpecProposer(drafter), batch_size=2, max_new_tokens=NEW, mode=mode).run(prompts)
        for r, ref in zip(run.results, refs):
            assert r.tokens == ref.tokens and r.accept_lengths == ref.accept_lengths, mode


# --------------------------------------------------------------------------------- the KV cache


def _assert_cache_matches_fresh_forward(engine, target):
    from transformers import DynamicCache

    for ls in engine.live():
        ref = DynamicCache()
        target.forward(torch.tensor([ls.committed]), cache=ref, use_cache=True, with_logits=False)
        assert int(engine.cache.lengths[ls.row]) == len(ls.committed)
        for layer in range(target.config.num_hidden_layers):
            k, v = engine.cache.row_kv(ls.row, layer)
            torch.testing.assert_close(k, ref.layers[layer].keys[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, ref.layers[layer].values[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode, pack", ENGINES)
def test_cache_equals_fresh_forward_after_every_step(target, prompts, continuations, mode, pack):
    """After every step, each sequence's committed keys/values (in slot order, padding skipped) equal
    those of a fresh forward over its accepted tokens: moves of accepted nodes, overwrites of
    rejected ones, refills and row compaction all keep the cache exact."""
    proposer = OracleProposer(continuations, correct=lambda s: [1, 3, 0, 2][s % 4])
    engine = SpecEngine(target, proposer, batch_size=3, max_new_tokens=14, mode=mode, pack_inputs=pack)
    engine.submit(prompts)
    steps = 0
    while not engine.done:
        engine.admit()
        _assert_cache_matches_fresh_forward(engine, target)
        if engine.live():
            engine.step()
            steps += 1
            _assert_cache_matches_fresh_forward(engine, target)
    assert steps >= 5 and len(engine.results) == len(prompts)


@pytest.mark.parametrize("mode", MODES)
def test_tree_attention_node_logits_equal_path_alone(target, prompts, mode):
    """Each node's logits in the batched tree forward equal those of running its root-to-node path alone
    after the sequence's committed tokens (random trees of different sizes per sequence)."""
    engine = SpecEngine(target, PlainProposer(), batch_size=3, max_new_tokens=50, mode=mode, pack_inputs="always")
    engine.submit(prompts[:3])
    engine.admit()
    engine.step()  # one plain step so that the rows' cache lengths differ from their prompt lengths
    g = torch.Generator().manual_seed(0)
    trees = []
    for n in (6, 1, 9):
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
        trees.append(DraftTree(torch.randint(3, 49152, (n,), generator=g), torch.tensor(parents)))
    logits, hidden = engine.forward_trees(trees)
    for ls, tree, lg in zip(engine.live(), trees, logits):
        prefix = ls.committed + [ls.pending]
        for node in range(-1, tree.n):
            path = tree.tokens[tree.path_to(node)].tolist() if node >= 0 else []
            ref = target.forward(torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(lg[node + 1], ref, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------- padding (EMS-SD)


class ScheduleProposer(OracleProposer):
    """Chains with a scheduled (length, correct drafts) per step and prompt: EMS-SD Table 1."""

    def __init__(self, continuations, schedules):
        super().__init__(continuations)
        self.schedules = schedules

    def draft(self, slots, sampling=None, generator=None):
        trees = []
        for slot in slots:
            st = self.state[slot]
            g = st["items"] - len(st["prompt"]) + 1
            length, correct = self.schedules[tuple(st["prompt"])][st["step"]]
            toks = [st["cont"][g + t] if t < correct else (st["cont"][g + t] + 1) % self.vocab for t in range(length)]
            st["step"] += 1
            trees.append(DraftTree.chain(toks))
        return trees


@pytest.mark.parametrize("mode", MODES)
def test_ems_sd_worked_example_padding(target, prompts, continuations, mode):
    """EMS-SD Fig. 2 / Table 1: sample 0 predicts 5 then 2 and accepts 4 then 2; sample 1 predicts 2 then 5
    and accepts 1 then 6 (accepted counts include the bonus token). Vanilla padding: 3 input pads and
    3 cache pads in step 1, 3 input pads and 4 cache pads in step 2; unpadded: none."""
    pair = [prompts[1], prompts[2]]
    sched = {tuple(pair[0]): [(5, 3), (2, 1)], tuple(pair[1]): [(2, 0), (5, 5)]}
    engine = SpecEngine(target, ScheduleProposer(continuations, sched), batch_size=2, max_new_tokens=NEW, mode=mode)
    engine.submit(pair)
    engine.admit()
    per_step = []
    for _ in range(2):
        before = (engine.stats.input_padding, engine.stats.kv_padding)
        engine.step()
        per_step.append((engine.stats.input_padding - before[0], engine.stats.kv_padding - before[1]))
    lens = [len(engine.rows[0].generated), len(engine.rows[1].generated)]
    assert lens == [1 + 4 + 2, 1 + 1 + 6]  # prefill token + accepted per step
    expected = {"padded": [(3, 3), (3, 4)], "unpadded": [(0, 0), (0, 0)], "unpadded_kv": [(3, 0), (3, 0)]}
    assert per_step == expected[mode]
    _assert_cache_matches_fresh_forward(engine, target)


# --------------------------------------------------------------------------------- continuous batching


@pytest.mark.parametrize("mode", MODES)
def test_continuous_batching_refills_slots(target, prompts, continuations, stops, mode):
    """With 5 prompts and 2 slots, a finished sequence's slot is refilled from the queue at the next step:
    the batch stays full while prompts wait, slots are reused, and every output is right."""
    engine = SpecEngine(target, OracleProposer(continuations, correct=lambda s: s % 3), batch_size=2,
                        max_new_tokens=NEW, mode=mode, stop_token_ids=stops)  # fmt: skip
    engine.submit(prompts)
    seen_slots, sizes, order = set(), [], []
    while not engine.done:
        engine.admit()
        live = engine.live()
        if engine.queue:
            assert len(live) == 2  # full while prompts are waiting
        sizes.append(len(live))
        for ls in live:
            seen_slots.add(ls.slot)
            if ls.index not in order:
                order.append(ls.index)
        if live:
            engine.step()
    assert seen_slots == {0, 1} and order == [0, 1, 2, 3, 4]
    assert engine.stats.prefill_forwards >= 4  # refills happen one wave at a time
    assert sizes[-1] == 1  # the tail runs with the batch shrunk to the last sequence
    ref = _plain_reference(target, prompts, stops)
    assert [engine.results[i].tokens for i in range(5)] == ref


def test_decode_tokens_per_s_leaves_the_prompt_forwards_out(target, prompts, stops, monkeypatch):
    """``EngineStats.decode_tokens_per_s``: the prompt forwards' time lands in ``prefill_seconds`` (part of
    ``seconds``) and not in the decoding steps' rate, and the first tokens (sampled from the prompt forward)
    are not counted as decoded. A fake clock that only moves inside target forwards (10 s per prompt
    forward, 1 s per verification forward) makes every figure exact."""
    import types

    from drafttrain.verify import engine as engine_mod

    clock = [0.0]
    monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = SpecEngine(target, PlainProposer(), batch_size=2, max_new_tokens=NEW, stop_token_ids=stops)
    forward, prefill, in_prefill = engine._forward, engine._prefill, []

    def timed_prefill(*a, **k):
        in_prefill.append(True)
        try:
            return prefill(*a, **k)
        finally:
            in_prefill.pop()

    def timed_forward(*a, **k):
        clock[0] += 10.0 if in_prefill else 1.0
        return forward(*a, **k)

    engine._prefill, engine._forward = timed_prefill, timed_forward
    run = engine.run(prompts)
    st = run.stats
    assert [r.tokens for r in run.results] == _plain_reference(target, prompts, stops)
    assert st.prefill_emitted == len(prompts) and st.prefill_forwards >= 4  # 5 prompts, 2 slots: refill waves
    assert st.generated - st.prefill_emitted == sum(len(r.tokens) - 1 for r in run.results)
    assert st.prefill_seconds == 10.0 * st.prefill_forwards
    assert st.seconds == st.prefill_seconds + 1.0 * st.forwards
    assert st.tokens_per_s == st.generated / st.seconds
    assert st.decode_tokens_per_s == (st.generated - len(prompts)) / st.forwards  # 1 s per decoding step
    assert st.to_dict()["decode_tokens_per_s"] == st.decode_tokens_per_s


# --------------------------------------------------------------------------------- sampling


def test_sampling_runs_and_is_reproducible(target, prompts, make_drafter):
    """Sampling through the engine: same seed -> same output; the three modes consume randomness in the
    same order, so they agree too; every sequence ends by stop or cap."""
    drafter = make_drafter(seed=3).eval()
    params = SamplingParams(temperature=0.8)  # top-p (a full-vocabulary sort per row) is covered by test_acceptance
    outs = []
    for mode in MODES:
        prop = ParallelSpecProposer(drafter, widths=[2, 2, 1, 1], budget=5)
        run = SpecEngine(target, prop, batch_size=3, max_new_tokens=10, mode=mode, sampling=params, seed=7).run(prompts)
        outs.append([r.tokens for r in run.results])
        assert all(len(r.tokens) == 10 or r.finish_reason == "stop" for r in run.results)
    assert outs[0] == outs[1] == outs[2]


def test_bad_arguments(target):
    with pytest.raises(ValueError, match="mode"):
        SpecEngine(target, PlainProposer(), mode="nope")
    with pytest.raises(ValueError, match="empty"):
        SpecEngine(target, PlainProposer()).run([[1, 2], []])


@pytest.mark.parametrize("mode", MODES)
def test_replay_proposer_controls_acceptance(target, prompts, mode):
    """The benchmark proposer: p = 1 accepts the whole chain every step, p = 0 nothing, p = 0.6 in between;
    the output is plain greedy in every case, and only the padded mode pads its cache."""
    from drafttrain.verify.proposers import ReplayProposer

    ref = _plain_reference(target, prompts, stop_ids=[-1])
    refs = {tuple(p): r for p, r in zip(prompts, ref)}
    taus = {}
    for p_right in (1.0, 0.0, 0.6):
        run = SpecEngine(target, ReplayProposer(refs, depth=4, accept_prob=p_right), batch_size=3,
                         max_new_tokens=NEW, mode=mode, stop_token_ids=[-1]).run(prompts)  # fmt: skip
        assert [r.tokens for r in run.results] == ref
        taus[p_right] = run.stats.tau
        if p_right == 0.6:
            assert (run.stats.kv_padding > 0) == (mode == "padded")
    assert taus[0.0] == 1.0 and taus[1.0] > 4.5 and 1.3 < taus[0.6] < 3.5


@pytest.mark.parametrize("mode", MODES)
def test_tiny_initial_capacity_grows_and_shifts(target, prompts, continuations, mode):
    """A cache that starts with 4 slots per row must grow (and, padded, shift its common leading padding
    out) many times; every step's cache and the outputs stay exact."""
    shifts = []
    engine = SpecEngine(target, OracleProposer(continuations, correct=lambda s: [2, 0, 1][s % 3]), batch_size=2,
                        max_new_tokens=16, mode=mode, initial_capacity=4, stop_token_ids=[-1])  # fmt: skip
    original = engine.cache.shift_left
    engine.cache.shift_left = lambda offset: (shifts.append(offset), original(offset))
    engine.submit(prompts)
    while not engine.done:
        engine.admit()
        if engine.live():
            engine.step()
            _assert_cache_matches_fresh_forward(engine, target)
    assert [engine.results[i].tokens for i in range(5)] == _plain_reference(target, prompts, [], n=16)
    assert engine.cache.capacity > 4
    assert (len(shifts) > 0) == (mode == "padded")


def test_batched_drafting_equals_propose_per_sequence(target, prompts, continuations, make_drafter):
    """ParallelSpecProposer's one-forward-per-step batched path gives the drafter's per-sequence ``propose``
    logits (each sequence at its own drafter-cache offset), over several steps of different item counts."""
    drafter = make_drafter(seed=4, draft_vocab_size=512).eval()  # a restricted draft vocabulary as in training
    batched, single = ParallelSpecProposer(drafter), ParallelSpecProposer(drafter, batched=False)
    assert batched.batched and not single.batched
    slots = [0, 1, 2]
    for slot, p in zip(slots, prompts[:3]):
        cont, feats = continuations[tuple(p)]
        for prop in (batched, single):
            prop.start(slot, p, feats[: len(p)], cont[0])
    done = {s: 1 for s in slots}  # generated tokens per slot
    for step, take in enumerate([[2, 0, 3], [1, 3, 0], [0, 1, 2]]):
        order = slots if step != 1 else [2, 0]  # a step may draft only some sequences, in any order
        lb = batched._draft_logits_batched(order)
        ls = [single._draft_logits_one(s) for s in order]
        for a, b in zip(lb, ls):
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a))
            torch.testing.assert_close(a[finite], b[finite], atol=1e-4, rtol=1e-4)
        for s in order:
            p = prompts[s]
            cont, feats = continuations[tuple(p)]
            g, m = done[s], take[s] + 1
            toks, hid = cont[g : g + m], feats[len(p) + g - 1 : len(p) + g - 1 + m]
            for prop in (batched, single):
                prop.commit(s, toks, hid)
            done[s] += m


@pytest.mark.parametrize("rows", [[0, 1, 2], [3, 0, 2]], ids=["contiguous", "gathered"])
def test_ragged_attention_one_call_equals_per_sequence(rows):
    """The one-call packed attention (queries gathered to [B, h, q_max, hd], grouped heads) gives the
    per-sequence loop's output (EMS-SD Algorithm 2 as written) for unequal inputs per sequence,
    unequal read lengths, a tree mask and grouped-query heads; rows in cache order use a key view,
    others a gather."""
    from drafttrain.verify.cache import RaggedSegments, ragged_attention

    g = torch.Generator().manual_seed(0)
    h, h_kv, hd, cap = 4, 2, 8, 12
    q = [3, 1, 4]
    kv = [7, 5, 12]
    n = sum(q)
    starts = [0, 3, 4]
    query = torch.randn(1, h, n, hd, generator=g)
    key, value = torch.randn(4, h_kv, cap, hd, generator=g), torch.randn(4, h_kv, cap, hd, generator=g)
    allowed = torch.zeros(n, cap, dtype=torch.bool)
    for s, k, m in zip(starts, kv, q):
        allowed[s : s + m, : k - m] = torch.rand(k - m, generator=g) > 0.3  # committed prefix with holes
        allowed[s : s + m, k - m : k] = torch.ones(m, m, dtype=torch.bool).tril()  # own new slots
    mask = torch.zeros(1, 1, n, cap).masked_fill_(~allowed[None, None], torch.finfo(torch.float32).min)
    outs = {}
    for batched in (False, True):
        seg = RaggedSegments(starts, [s + m for s, m in zip(starts, q)], rows, kv, batched=batched)
        outs[batched] = ragged_attention(None, query, key, value, mask, scaling=0.3, ragged_segments=seg)[0]
        assert outs[batched].shape == (1, n, h, hd)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)
    # and the per-sequence loop itself is attention of each sequence against its own row only
    s, m, r = starts[2], q[2], rows[2]
    ref = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s : s + m], key[r : r + 1], value[r : r + 1], attn_mask=mask[:, :, s : s + m], scale=0.3,
        enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(outs[True][0, s : s + m], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "tree"])
def test_ragged_attention_prefill_causal_kernel(causal):
    """A packed prefill (every sequence's inputs are its whole row) with a plain causal mask runs as
    sdpa's is_causal kernel and equals the per-sequence loop, although the slots past a shorter
    sequence's end hold large stale values (finite, as in the zero-initialised cache a refilled row
    reuses); a non-causal mask of the same shape is not taken for causal."""
    from drafttrain.verify.cache import RaggedSegments, ragged_attention

    g = torch.Generator().manual_seed(1)
    h, h_kv, hd, cap = 6, 2, 8, 10
    q = [5, 2, 7]
    n, starts = sum(q), [0, 5, 7]
    query = torch.randn(1, h, n, hd, generator=g)
    key, value = torch.randn(3, h_kv, cap, hd, generator=g), torch.randn(3, h_kv, cap, hd, generator=g)
    for r, m in enumerate(q):  # slots past a sequence's inputs: stale values no real query may read
        key[r, :, m:], value[r, :, m:] = 50.0, 1e4
    allowed = torch.zeros(n, cap, dtype=torch.bool)
    for s, m in zip(starts, q):
        own = torch.ones(m, m, dtype=torch.bool).tril()
        if not causal:
            own[m - 1, 0] = False  # a tree-like hole: the last input does not see the first
        allowed[s : s + m, :m] = own
    mask = torch.zeros(1, 1, n, cap).masked_fill_(~allowed[None, None], torch.finfo(torch.float32).min)
    outs = {}
    for batched in (False, True):
        seg = RaggedSegments(starts, [s + m for s, m in zip(starts, q)], [0, 1, 2], list(q), batched=batched)
        outs[batched] = ragged_attention(None, query, key, value, mask, scaling=0.3, ragged_segments=seg)[0]
        if batched:
            assert seg.gather_plan(mask)["causal"] is causal
    assert outs[True].abs().max() < 100
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)

