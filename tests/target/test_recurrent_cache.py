"""The engine's cache kinds on targets with recurrent layers (gated delta-net: Qwen3.5, Qwen3-Next; Mamba-2:
Granite-4 hybrid, Falcon-H1's parallel blocks; short convolutions: LFM2) and MLA (DeepSeek-V3): tiny random targets
of the real transformers classes (:mod:`drafttrain.target.tiny`), weights redrawn so continuations vary.

Why: a recurrent layer's state has no slot per token, so a rejected draft cannot be overwritten later as a
key/value can. The rule these tests hold: a verified step that accepts n of K drafts leaves every layer's state
exactly where plain decoding of those n + 1 tokens leaves it (the snapshot kept out of place, the committed tokens
replayed), and speculative decoding is token-for-token the model's own greedy decoding at batch 1 and 3. A
rollback that keeps one rejected draft's state (the mutation below) breaks both.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from drafttrain.target import Target, tiny
from drafttrain.sweep import vary_weights
from drafttrain.verify.engine import SpecEngine
from drafttrain.verify.proposers import PlainProposer
from drafttrain.verify.tree import DraftTree

HYBRIDS = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM", "Lfm2ForCausalLM",
           "FalconH1ForCausalLM")  # fmt: skip
VOCAB = 512


@pytest.fixture(scope="module")
def targets():
    made = {}

    def get(name: str) -> Target:
        if name not in made:
            model = tiny.build(name, vocab_size=VOCAB)
            vary_weights(model)
            made[name] = Target(model)
        return made[name]

    return get


class _Chains:
    """Drafts a scripted chain per step (empty once the script runs out): the test decides what is accepted."""

    name = "scripted"

    def __init__(self, chains):
        self.chains = list(chains)

    def start(self, *a):
        pass

    def draft(self, slots, sampling=None, generator=None):
        return [DraftTree.chain(self.chains.pop(0)) if self.chains else DraftTree.empty() for _ in slots]

    def commit(self, *a):
        pass

    def release(self, *a):
        pass


@torch.no_grad()
def own_greedy(model, prompt, n):
    """The model's own greedy tokens, one cached step at a time (transformers' DynamicCache): plain decoding."""
    cache = transformers.DynamicCache(config=model.config)
    logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def _after_plain(target, prompt, steps):
    eng = SpecEngine(target, PlainProposer(), max_new_tokens=32, stop_token_ids=[])
    eng.submit([prompt])
    eng.admit()
    for _ in range(steps):
        eng.step()
    return eng


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_verified_step_leaves_the_state_plain_decoding_leaves(targets, name, accepted):
    """Prefill, then one verification of a chain of 3 drafts whose first ``accepted`` are the target's own tokens:
    every layer's recurrent states (conv and recurrent) and every attention layer's keys/values equal those of
    plain decoding of the accepted tokens + the root, within float reassociation; the next token is the same."""
    target = targets(name)
    prompt = [5, 9, 13, 2, 7, 11]
    want = own_greedy(target.model, prompt, 6)
    chain = want[1 : 1 + accepted] + [(t + 1) % VOCAB for t in want[1 + accepted : 4]]
    spec = SpecEngine(target, _Chains([chain]), max_new_tokens=32, stop_token_ids=[])
    spec.submit([prompt])
    spec.admit()
    spec.step()
    plain = _after_plain(target, prompt, accepted + 1)
    assert spec.rows[0].pending == plain.rows[0].pending == want[accepted + 1]
    assert int(spec.cache.lengths[0]) == int(plain.cache.lengths[0]) == len(prompt) + accepted + 1
    a, b = plain.cache.row_states(0), spec.cache.row_states(0)
    assert a and a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-4, msg=key)
    for i, layer in enumerate(plain.cache.layers):
        if getattr(layer, "keys", None) is not None:
            for x, y in zip(spec.cache.row_kv(0, i), plain.cache.row_kv(0, i)):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    assert spec.stats.replay_forwards == (0 if accepted == 3 else 1)  # all accepted: the forward's state is exact


class _Replay:
    """Drafts the reference continuation with a wrong token every ``wrong_every`` drafts (chains of 3)."""

    name = "replay"

    def __init__(self, refs, wrong_every=2):
        self.refs, self.wrong_every, self.state = refs, wrong_every, {}
        self.k = 0

    def start(self, slot, prompt, hidden, first):
        self.state[slot] = [self.refs[tuple(prompt)], 1]

    def draft(self, slots, sampling=None, generator=None):
        out = []
        for slot in slots:
            ref, n = self.state[slot]
            chain = []
            for j in range(3):
                self.k += 1
                t = ref[n + j] if n + j < len(ref) else 0
                chain.append((t + 1) % VOCAB if self.k % self.wrong_every == 0 else t)
            out.append(DraftTree.chain(chain))
        return out

    def commit(self, slot, tokens, hidden):
        self.state[slot][1] += len(tokens)

    def release(self, slot):
        self.state.pop(slot, None)


PROMPTS = [[5, 9, 13, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [17, 1, 1], [40, 41]]


def speculative_equals_own_greedy(target, batch_size, new=12) -> bool:
    want = [own_greedy(target.model, p, new) for p in PROMPTS]
    refs = {tuple(p): w for p, w in zip(PROMPTS, want)}
    for wrong_every in (2, 3, 5):
        eng = SpecEngine(target, _Replay(refs, wrong_every), batch_size=batch_size, max_new_tokens=new, stop_token_ids=[])
        run = eng.run(PROMPTS)
        if [r.tokens for r in run.results] != want:
            return False
        assert run.stats.replay_forwards > 0 and run.stats.tau > 1.0
    return True


@pytest.mark.parametrize("name", HYBRIDS + ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"))
@pytest.mark.parametrize("batch_size", [1, 3])
def test_speculative_decoding_is_the_models_own_greedy(targets, name, batch_size):
    """Chains of 3 drafts, a rejected one every 2nd / 3rd / 5th draft, 4 prompts of different lengths (continuous
    batching at batch 3): token for token the model's own cached greedy decoding. MLA targets (DeepSeek-V3, V3.2 with
    its sparse-attention indexer) hold their latent keys and values as the model writes them."""
    target = targets(name)
    if not target.recurrent:  # MLA: an attention-only target, no replay needed
        want = [own_greedy(target.model, p, 12) for p in PROMPTS]
        eng = SpecEngine(target, _Replay({tuple(p): w for p, w in zip(PROMPTS, want)}), batch_size=batch_size,
                         max_new_tokens=12, stop_token_ids=[])  # fmt: skip
        assert [r.tokens for r in eng.run(PROMPTS).results] == want
        layout = target.cache_layout
        assert all(c.key_shape != c.value_shape for c in layout)  # MLA: latent keys and rotary keys, other sizes
        return
    assert speculative_equals_own_greedy(target, batch_size)


def test_a_rollback_that_keeps_a_rejected_drafts_state_breaks_greedy_equality(targets, monkeypatch):
    """The mutation: replay one token more than was committed (the first rejected draft's state kept). The same
    check as above then fails, and the state after a step that rejected a draft differs from plain decoding's."""
    target = targets("Qwen3_5ForCausalLM")
    assert speculative_equals_own_greedy(target, 3)
    import dataclasses

    real = SpecEngine._settle_states

    def keeps_one_rejected(self, rows, seqs, trees, results, q, base, keep, roots):
        longer, more = [], {}
        for r, t, acc in zip(rows, trees, results):
            m = len(acc.path)
            if m < t.n:  # the chain's first rejected node joins the replayed tokens
                acc = dataclasses.replace(acc, path=list(acc.path) + [m])
                more[r] = keep[r] + 1
            longer.append(acc)
        return real(self, rows, seqs, trees, longer, q, base, {**keep, **more}, roots)

    monkeypatch.setattr(SpecEngine, "_settle_states", keeps_one_rejected)
    assert not speculative_equals_own_greedy(target, 3)


def test_a_tree_on_a_recurrent_target_is_refused_by_name(targets):
    """A recurrent state follows one sequence: a tree's branches would share it. The engine refuses a drafted tree
    on such a target, naming the class and its recurrent layers, and the padded mode (left padding) up front."""
    target = targets("Qwen3NextForCausalLM")

    class Tree(_Chains):
        def draft(self, slots, sampling=None, generator=None):
            return [DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1])) for _ in slots]

    eng = SpecEngine(target, Tree([]), max_new_tokens=8, stop_token_ids=[])
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM's recurrent layers \(0, 1, 2 of 4\).*drafted a tree"):
        eng.run([[1, 2, 3]])
    with pytest.raises(ValueError, match="mode='padded' left-pads prompts"):
        SpecEngine(target, PlainProposer(), mode="padded")


def test_layout_reads_each_layers_kind_and_shapes(targets):
    """The cache layout comes from transformers' own cache after one forward: Qwen3.5's 3 gated delta-net layers then
    full attention; Falcon-H1's parallel (hybrid) layers; DeepSeek-V3's MLA latents (512-style kv_lora_rank keys and
    rotary keys as the values, other sizes than the query head)."""
    q = targets("Qwen3_5ForCausalLM").cache_layout
    assert [c.kind for c in q] == ["recurrent", "recurrent", "recurrent", "attention"]
    assert q[0].conv_shapes[0][-1] == 4 and q[0].recurrent_shapes[0] is not None
    assert {c.kind for c in targets("FalconH1ForCausalLM").cache_layout} == {"hybrid"}
    d = targets("DeepseekV3ForCausalLM")
    assert [c.key_shape for c in d.cache_layout] == [(1, d.config.kv_lora_rank)] * 4
    assert [c.value_shape for c in d.cache_layout] == [(1, d.config.qk_rope_head_dim)] * 4
