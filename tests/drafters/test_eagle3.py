"""Tests of the EAGLE-3 drafter (tiny target): network and state-dict names, the training-time test (TTT)
against an autoregressive rollout, the loss and metrics against plain loops, and drafting.

The references here run one sequence and one anchor at a time with a ``DynamicCache``, the way inference
drafts: nothing in them uses :func:`drafttrain.layout.ttt_mask`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from drafttrain import layout as L
from drafttrain.drafters import build_drafter
from drafttrain.drafters.eagle3 import default_aux_layer_ids, feature_layer_ids, resolve_aux_layer_ids
from drafttrain.metrics import group_acceptance_sums
from helpers import make_batch

IGN = L.IGNORE_INDEX
K = 3  # TTT steps in the tests
D = 3  # draft depth


def target_features(target, ids, lengths, layers) -> torch.Tensor:
    """The given layers of f_0..f_{L-2} concatenated, straight from HF's output_hidden_states (id i =
    hidden_states[i]; id L = the final post-norm state)."""
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        hs = target.model.model(ids, attention_mask=attn, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], dim=-1)[:, :-1]


def make(target, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = {"ttt_steps": K, "draft_depth": D, "init_from_target_layer": False, **overrides}
    return build_drafter("eagle3", cfg, target)


def batch_for(target, dr, **kw):
    b = make_batch(target, **kw)
    b["features"] = target_features(target, b["input_ids"], b["lengths"], dr.feature_layer_ids)
    return b


def vocab_with_target_argmax(dr, batch, target, n=300, seed=0):
    """A draft vocabulary holding about half of the target's argmax tokens at the labelled positions (the
    other half is out of vocabulary: their rows leave the loss), padded with random ids."""
    tops = target.lm_head(dr.final_features(batch["features"])).argmax(-1).flatten().unique()
    g = torch.Generator().manual_seed(seed)
    keep = tops[torch.randperm(tops.numel(), generator=g)[: max(1, tops.numel() // 2)]]
    rest = [i for i in torch.randperm(dr.vocab_size, generator=g).tolist() if i not in set(tops.tolist())]
    dr.set_draft_vocab(torch.cat([keep, torch.tensor(rest[: n - keep.numel()])]))


@pytest.fixture(scope="module")
def drafter(tiny_target):
    dr = make(tiny_target, draft_vocab_size=300)
    with torch.no_grad():  # an informative network: every weight random, norms away from 1
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return dr.eval()


@pytest.fixture(scope="module")
def batch(tiny_target, drafter):
    b = batch_for(tiny_target, drafter)
    vocab_with_target_argmax(drafter, b, tiny_target)
    return b


# ---------------------------------------------------------------- network


def test_layer_ids_convention(tiny_target, drafter):
    """vLLM's ids; the drafter is handed the distinct ids of (low, mid, high, L) and reads them back in place."""
    assert default_aux_layer_ids(30) == (2, 15, 27)  # vLLM / speculators for SmolLM2's 30 layers
    assert feature_layer_ids([], 30) == (2, 15, 27, 30)
    assert feature_layer_ids([], 2) == (1, 0, 2) == drafter.feature_layer_ids
    d = tiny_target.config.hidden_size
    f = torch.randn(2, 3 * d)  # layers (1, 0, 2) of the tiny target
    assert torch.equal(drafter.aux_features(f), torch.cat([f[:, :d], f[:, :d], f[:, d : 2 * d]], -1))  # (1, 1, 0)
    assert torch.equal(drafter.final_features(f), f[:, 2 * d :])
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(2) == (1, 1, 0)  # clamped into [0, L - 1]
    assert resolve_aux_layer_ids([], 30) == (2, 15, 27)
    assert resolve_aux_layer_ids([0, 4, 9], 10) == (0, 4, 9)
    for bad in ([1, 2], [0, 1, 10], [-1, 2, 3]):
        with pytest.raises(ValueError, match="aux_layer_ids"):
            resolve_aux_layer_ids(bad, 10)


def test_state_dict_is_the_speculators_format(tiny_target):
    """Names and shapes map one-to-one to vLLM's speculators EAGLE-3 weights (docs/design.md, "Serving
    formats"); nothing of the target (embedding, its head) is saved; parameter count = fc + layer with 2d q/k/v + norms + head."""
    cfg = tiny_target.config
    d, n = cfg.hidden_size, 300
    dr = make(tiny_target, draft_vocab_size=n)
    hd = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    i = cfg.intermediate_size
    expected = {
        "fc.weight": (d, 3 * d),
        "layers.0.self_attn.q_proj.weight": (d, 2 * d),
        "layers.0.self_attn.k_proj.weight": (kv, 2 * d),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * d),
        "layers.0.self_attn.o_proj.weight": (d, d),
        "layers.0.mlp.gate_proj.weight": (i, d),
        "layers.0.mlp.up_proj.weight": (i, d),
        "layers.0.mlp.down_proj.weight": (d, i),
        "layers.0.input_layernorm.weight": (d,),
        "layers.0.hidden_norm.weight": (d,),
        "layers.0.post_attention_layernorm.weight": (d,),
        "norm.weight": (d,),
        "lm_head.weight": (n, d),
        "d2t": (n,),
        "t2d": (cfg.vocab_size,),
    }
    assert {k: tuple(v.shape) for k, v in dr.state_dict().items()} == expected
    assert sum(p.numel() for p in dr.parameters()) == sum(
        torch.Size(s).numel() for k, s in expected.items() if k not in ("d2t", "t2d"))  # fmt: skip


def test_init_from_target(tiny_target):
    """lm_head = the target head's draft rows (re-copied by set_draft_vocab), the g half of q/k/v and the
    MLP = the target's last layer, fc's high block = I."""
    dr = make(tiny_target, draft_vocab_size=50, init_from_target_layer=True)
    ids = torch.arange(100, 150)
    dr.set_draft_vocab(ids)
    assert torch.equal(dr.lm_head.weight, tiny_target.lm_head.weight[ids])
    src = tiny_target.last_layer
    d = tiny_target.config.hidden_size
    assert torch.equal(dr.layer.self_attn.q_proj.weight[:, d:], src.self_attn.q_proj.weight)
    assert torch.equal(dr.layer.mlp.down_proj.weight, src.mlp.down_proj.weight)
    eye = dr.fc.weight[:, 2 * d :] - torch.eye(d)
    assert eye.abs().max() < 0.2 and dr.fc.weight[:, :d].abs().max() < 0.2


def test_items_width_dispatch(tiny_target, drafter):
    d = tiny_target.config.hidden_size
    ids = torch.tensor([[5, 6]])
    target_f, own_h = torch.randn(1, 2, 3 * d), torch.randn(1, 2, d)  # tiny target: layers (1, 0, 2)
    x = drafter.items(ids, target_f)
    torch.testing.assert_close(x[..., d:], drafter.fc(drafter.aux_features(target_f)))
    torch.testing.assert_close(x[..., :d], tiny_target.embed_tokens(ids))
    assert torch.equal(drafter.items(ids, own_h)[..., d:], own_h)
    with pytest.raises(ValueError, match="width"):
        drafter.items(ids, torch.randn(1, 2, 4 * d))


# ---------------------------------------------------------------- TTT == autoregressive rollout


def rollout(dr, ids, feats, anchor: int, feed: list[int]) -> list[torch.Tensor]:
    """Inference drafting from item ``anchor`` of one sequence: items 0..anchor (causal, DynamicCache), then
    one forward per step reading (feed[k - 1], the drafter's own h of step k - 1). Returns K [N] logits."""
    cache = DynamicCache()
    pos, mask = L.inference_layout(anchor + 1, 0, torch.float32)
    logits, h = dr.draft_step(ids[None, 1 : anchor + 2], feats[None, : anchor + 1], pos, mask, cache)
    out, h = [logits[0, -1]], h[:, -1:]
    for tok in feed:
        pos, mask = L.inference_layout(1, 0, torch.float32, past=cache.get_seq_length())
        logits, h = dr.draft_step(torch.tensor([[tok]]), h, pos, mask, cache)
        out.append(logits[0, -1])
    return out


def test_ttt_steps_equal_autoregressive_rollout(drafter, batch):
    """THE invariant of the TTT mask: step k's logits at row j of the unrolled training pass equal
    inference drafting from item j fed the ground-truth tokens x_{j+1..j+k} with its own hidden states."""
    ids, feats, lengths = batch["input_ids"], batch["features"], batch["lengths"]
    with torch.no_grad():
        hs = drafter.ttt_hidden(ids, feats)
        assert len(hs) == K
        checked = 0
        for i in range(ids.shape[0]):
            t = int(lengths[i]) - 1
            for j in range(t):
                steps = min(K, t - j)  # step k reads x_{j+k+1}, which exists for j + k < t
                ref = rollout(drafter, ids[i], feats[i], j, [int(ids[i, j + k + 1]) for k in range(1, steps)])
                for k in range(steps):
                    torch.testing.assert_close(drafter.vocab_logits(hs[k][i, j]), ref[k], atol=1e-5, rtol=0,
                                               msg=f"seq {i} row {j} step {k}")  # fmt: skip
                    checked += 1
    assert checked >= 40


def reference_loss_and_sums(dr, batch, target):
    """The TTT loss and metric sums by loops over (sequence, anchor, step) with :func:`rollout`."""
    ids, feats, lengths, mask = batch["input_ids"], batch["features"], batch["lengths"], batch["loss_mask"]
    d = target.config.hidden_size
    t2d = {int(tok): n for n, tok in enumerate(dr.draft_token_ids)}
    rows = target.lm_head.weight[dr.draft_token_ids]
    kls: dict[int, list[float]] = {}
    rows_c, rows_v = [], []
    for i in range(ids.shape[0]):
        n = int(lengths[i])
        t = n - 1
        y = L.item_labels(ids[i, :n], mask[i, :n]).tolist() + [IGN] * K
        for j in range(t):
            steps = min(K, t - j)
            logits = rollout(dr, ids[i], feats[i], j, [int(ids[i, j + k + 1]) for k in range(1, steps)])
            for k in range(steps):
                p = j + k
                if y[p] == IGN:
                    continue
                f = dr.final_features(feats[i, p + 1])  # the target's final state f_{p+1}: its head gives y_p's distribution
                if int(target.lm_head(f).argmax()) not in t2d:
                    continue
                logp = torch.log_softmax((rows @ f).double(), 0)
                kls.setdefault(k, []).append(float((logp.exp() * (logp - torch.log_softmax(logits[k].double(), 0))).sum()))
            if y[j] != IGN:  # a group: anchor j, positions k = 0..D-1
                rows_v.append([y[j + k] != IGN for k in range(D)])
                rows_c.append([y[j + k] != IGN and y[j + k] in t2d and k < steps
                               and int(logits[k].argmax()) == t2d[y[j + k]] for k in range(D)])  # fmt: skip
    loss = sum(0.8**k * sum(v) / len(v) for k, v in kls.items())
    return loss, kls, group_acceptance_sums(torch.tensor(rows_c), torch.tensor(rows_v))


def test_loss_and_metrics_match_plain_loops(tiny_target, drafter, batch):
    """sum_k 0.8^k mean KL(p || q) over rows whose label is loss-masked in and whose target argmax is a
    draft id; acc / cond_acc / tau_sim sums of the same rows; some rows are out of vocabulary."""
    with torch.no_grad():
        out = drafter(batch)
        ref, kls, sums = reference_loss_and_sums(drafter, batch, tiny_target)
    assert float(out.loss) == pytest.approx(ref, rel=1e-5)
    assert out.sums["kl_count"].tolist() == [float(len(kls.get(k, []))) for k in range(K)]
    assert min(out.sums["kl_count"].tolist()) > 0
    for key, v in sums.items():
        assert torch.equal(out.sums[key].float(), v.float()), key
    assert float(sums["acc_den"][0]) > out.sums["kl_count"][0]  # out-of-vocabulary rows left the loss


def test_gradients_reach_every_parameter_not_the_target(tiny_target, drafter, batch):
    dr = make(tiny_target, seed=1, draft_vocab_size=300, init_from_target_layer=True)
    dr.set_draft_vocab(drafter.draft_token_ids)
    dr.train()
    dr(batch).loss.backward()
    assert all(p.grad is None for p in tiny_target.model.parameters())
    for name, p in dr.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------- inference


def test_propose_is_the_greedy_rollout_and_keeps_the_cache(drafter, batch):
    """propose() drafts D rows, row k + 1 fed row k's argmax; the cache holds only the real items after."""
    ids, feats = batch["input_ids"][0], batch["features"][0]
    cache = DynamicCache()
    got = drafter.propose(ids[None, 1:8], feats[None, :7], cache)
    assert got.shape == (1, D, drafter.vocab_size) and cache.get_seq_length() == 7
    feed = got[0].argmax(-1)[: D - 1].tolist()
    ref = rollout(drafter, ids, feats, 6, feed)
    for k in range(D):
        torch.testing.assert_close(got[0, k][drafter.draft_token_ids], ref[k], atol=1e-5, rtol=0)
    outside = ~drafter.t2d
    assert torch.isinf(got[0][:, outside]).all()
    more = drafter.propose(ids[None, 8:10], feats[None, 7:9], cache)  # incremental == from scratch
    torch.testing.assert_close(more, drafter.propose(ids[None, 1:10], feats[None, :9], DynamicCache()), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- parallel drafting on EAGLE-3

KP = 3  # [MASK] slots


def make_parallel(target, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = {"num_mask_tokens": KP, "init_from_target_layer": False, **overrides}
    return build_drafter("parallelspec_eagle3", cfg, target)


@pytest.fixture(scope="module")
def pdrafter(tiny_target, drafter):
    dr = make_parallel(tiny_target, draft_vocab_size=300)
    dr.set_draft_vocab(drafter.draft_token_ids)
    with torch.no_grad():
        for p in dr.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return dr.eval()


def _groups(lay, i):
    out = {}
    for s in range(lay.slot_kind.shape[1]):
        if int(lay.slot_kind[i, s]) > 0:
            a = int(lay.slot_anchor[i, s])
            out.setdefault(a, [a]).append(s)
    return out


def test_parallel_state_dict_and_mask_inputs(tiny_target, pdrafter):
    """EAGLE-3's tensors + one mask hidden state of the fc input size; every mask slot reads the same
    cat(e(mask_token_id), fc(mask_hidden))."""
    d = tiny_target.config.hidden_size
    sd = pdrafter.state_dict()
    assert sd["mask_hidden"].shape == (3 * d,) and "fc.weight" in sd and "layers.0.hidden_norm.weight" in sd
    assert pdrafter.mask_token_id == tiny_target.config.vocab_size - 1 and pdrafter.draft_depth == KP + 1
    m = pdrafter.draft_inputs()
    assert m.shape == (KP, 2 * d) and torch.equal(m[0], m[-1])
    torch.testing.assert_close(m[0, :d], tiny_target.embed_tokens.weight[-1])
    torch.testing.assert_close(m[0, d:], pdrafter.fc(pdrafter.mask_hidden))
    with pytest.raises(ValueError, match="mask_token_id"):
        make_parallel(tiny_target, mask_token_id=tiny_target.config.vocab_size)


def test_parallel_training_layout_equals_inference(pdrafter, batch):
    """ParallelSpec's invariant on the EAGLE-3 network: the group-wise layout's logits at anchor a's
    [item, mask 1..K] slots equal one inference pass over items <= a + K mask slots (propose)."""
    ids, feats = batch["input_ids"], batch["features"]
    t = ids.shape[1] - 1
    checked = 0
    with torch.no_grad():
        lay = pdrafter.layouts(batch, ratio=1.0)
        h = pdrafter.forward_layout(pdrafter.items(ids[:, 1:], feats[:, :t]), lay)
        for i in range(ids.shape[0]):
            for a, slots in _groups(lay, i).items():
                got = pdrafter.propose(ids[i : i + 1, 1 : a + 2], feats[i : i + 1, : a + 1], DynamicCache())[0]
                torch.testing.assert_close(got, pdrafter.full_vocab_logits(pdrafter.vocab_logits(h[i, slots])),
                                           atol=1e-5, rtol=0)  # fmt: skip
                checked += 1
    assert checked >= 8


def test_parallel_loss_and_metrics_match_plain_loops(tiny_target, pdrafter, batch):
    """Section 4.3 with the KL objective by loops: every labelled item (position 0) from a causal pass,
    mask slot k of every candidate anchor from an inference pass over items <= a + K masks; slots whose
    label is masked or whose target argmax is out of the draft vocabulary leave the loss; plain sum."""
    ids, feats, lengths, lmask = batch["input_ids"], batch["features"], batch["lengths"], batch["loss_mask"]
    d = tiny_target.config.hidden_size
    t2d = {int(tok): n for n, tok in enumerate(pdrafter.draft_token_ids)}
    rows = tiny_target.lm_head.weight[pdrafter.draft_token_ids]
    kls: dict[int, list[float]] = {}
    rows_c, rows_v = [], []

    def term(k, logits, p, y):  # one slot: label y_p, target state f_{p+1}
        if y == IGN:
            return False
        f = pdrafter.final_features(feats[i, p + 1])
        if int(tiny_target.lm_head(f).argmax()) not in t2d:
            return False
        logp = torch.log_softmax((rows @ f).double(), 0)
        kls.setdefault(k, []).append(float((logp.exp() * (logp - torch.log_softmax(logits.double(), 0))).sum()))
        return y in t2d and int(logits.argmax()) == t2d[y]

    with torch.no_grad():
        out = pdrafter(batch)
        for i in range(ids.shape[0]):
            n = int(lengths[i])
            t = n - 1
            y = L.item_labels(ids[i, :n], lmask[i, :n]).tolist()
            ok0 = {}
            for a in range(t):  # position 0: the causal pass over the items
                lg = pdrafter.propose(ids[i : i + 1, 1 : a + 2], feats[i : i + 1, : a + 1], DynamicCache())[0]
                ok0[a] = term(0, lg[0, pdrafter.draft_token_ids], a, y[a])
                if not any(a + j < t and y[a + j] != IGN for j in range(1, KP + 1)):
                    continue  # not a candidate anchor
                c, v = [ok0[a]], [y[a] != IGN]
                for j in range(1, KP + 1):
                    lab = y[a + j] if a + j < t else IGN
                    c.append(lab != IGN and term(j, lg[j, pdrafter.draft_token_ids], a + j, lab))
                    v.append(lab != IGN)
                rows_c.append(c)
                rows_v.append(v)
    ref = sum(sum(v) / len(v) for v in kls.values())
    assert float(out.loss) == pytest.approx(ref, rel=1e-5)
    assert out.sums["kl_count"].tolist() == [float(len(kls.get(k, []))) for k in range(KP + 1)]
    sums = group_acceptance_sums(torch.tensor(rows_c), torch.tensor(rows_v))
    for key in ("acc_num", "acc_den", "tau_len_sum", "tau_groups"):
        assert torch.equal(out.sums[key].float(), sums[key].float()), key


def test_parallel_gradients(tiny_target, drafter, batch):
    dr = make_parallel(tiny_target, seed=2, draft_vocab_size=300, init_from_target_layer=True)
    dr.set_draft_vocab(drafter.draft_token_ids)
    dr.train()
    dr(batch, torch.Generator().manual_seed(0)).loss.backward()
    assert all(p.grad is None for p in tiny_target.model.parameters())
    for name, p in dr.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------- through the batched engine

NEW = 16


def _engine_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 11, 25, 7)]


@pytest.mark.parametrize("which", ["tiny", "varied"])
def test_engine_greedy_equals_plain(tiny_target, varied_target, which):
    """EAGLE-3 chains, static trees and EAGLE-2 dynamic trees (EagleProposer, batched over a ragged
    drafter cache) and parallel drafting on EAGLE-3 (ParallelSpecProposer, one forward per step) output
    exactly plain greedy decoding at batch 3 with 4 prompts of different lengths (a slot is refilled). The
    tiny target as loaded accepts drafts (accepted keys move), the varied one mostly rejects them."""
    from drafttrain.verify import EAGLE_DEFAULT_CHOICES, PlainProposer, SpecEngine, proposer_for

    target = tiny_target if which == "tiny" else varied_target
    prompts = _engine_prompts()
    e3 = make(target, draft_vocab_size=0, init_from_target_layer=True).eval()
    p3 = make_parallel(target, draft_vocab_size=0, init_from_target_layer=True).eval()
    variants = {
        "eagle3-chain": lambda: proposer_for(e3),
        "eagle3-tree": lambda: proposer_for(e3, choices=EAGLE_DEFAULT_CHOICES),
        "eagle3-dynamic": lambda: proposer_for(e3, widths=[3, 2, 1], budget=7),
        "parallelspec_eagle3-chain": lambda: proposer_for(p3),
        "parallelspec_eagle3-tree": lambda: proposer_for(p3, widths=[2, 2, 1, 1], budget=6),
    }
    ref = SpecEngine(target, PlainProposer(), batch_size=3, max_new_tokens=NEW, stop_token_ids=[-1]).run(prompts)
    ref_tokens = [r.tokens for r in ref.results]
    taus = {}
    for name, make_prop in variants.items():
        prop = make_prop()
        assert prop.feature_layers == e3.feature_layer_ids  # the engine hands the declared layers
        run = SpecEngine(target, prop, batch_size=3, max_new_tokens=NEW, stop_token_ids=[-1]).run(prompts)
        assert [r.tokens for r in run.results] == ref_tokens, name
        taus[name] = run.stats.tau
    if which == "tiny":
        assert taus["eagle3-chain"] > 1.2 and taus["parallelspec_eagle3-chain"] > 1.2, taus
