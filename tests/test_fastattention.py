"""Tests of drafttrain.target.fastattention (decode / verification attention on CPU, grouped-query heads read once).

It must be invisible except in speed: equal to sdpa up to float reassociation at every shape the engine
makes (one query or a draft tree's nodes per sequence, views into a larger cache, per-row, per-query or
shared masks, GQA ratios, every supported head dim), a query's output independent of its batch and of
the other queries in its call, clean refusals (``usable``) where it does not apply, and
greedy decoding through the engine unchanged: equal to Hugging Face ``generate`` and to the same engine
on sdpa, token for token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafttrain.target import fastattention, fastlinear

needs_kernel = pytest.mark.skipif(not fastattention.available(), reason=f"no decode kernel: {fastattention.unavailable_reason()}")
NEG = torch.finfo(torch.float32).min


def _inputs(b, h, h_kv, t, hd, cap_extra=5, seed=0, mask="rows", nq=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, hd, generator=g)
    kb = torch.randn(b + 1, h_kv, t + cap_extra, hd, generator=g)  # a larger cache: k, v are views into it
    vb = torch.randn(b + 1, h_kv, t + cap_extra, hd, generator=g)
    k, v = kb[1:, :, :t], vb[1:, :, :t]
    if mask == "none":
        m = None
    elif mask == "shared":
        m = torch.zeros(1, 1, 1, t)
        m[..., : t // 3] = NEG
    else:  # each row its own committed slots, as RaggedKVCache rows have; each query its own tree mask row
        m = torch.zeros(b, 1, 1, t)
        for i in range(b):
            m[i, ..., torch.randperm(t, generator=g)[: (i * t) // (b + 1)]] = NEG
        if nq > 1:
            m = m.repeat(1, 1, nq, 1)
            m[:, 0, :, t - nq :] = torch.where(torch.rand(nq, nq, generator=g) < 0.5, NEG, 0.0).fill_diagonal_(0.0)
    return q, k, v, m


@needs_kernel
@pytest.mark.parametrize("b,h,h_kv,t,hd", [(1, 9, 3, 300, 64), (16, 9, 3, 210, 64), (3, 4, 2, 17, 16),
                                            (2, 8, 8, 33, 32), (1, 16, 4, 100, 128), (5, 6, 1, 1, 64)])  # fmt: skip
@pytest.mark.parametrize("mask", ["rows", "shared", "none"])
def test_kernel_matches_sdpa(b, h, h_kv, t, hd, mask):
    q, k, v, m = _inputs(b, h, h_kv, t, hd, mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=h != h_kv)
    assert fastattention.usable(q, k, v, m)
    out = fastattention.decode_attention(q, k, v, m)
    assert out.shape == (b, h, 1, hd) and out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 2e-5
    scaled = fastattention.decode_attention(q, k, v, m, scale=0.5)  # the scale is honoured
    assert (scaled - F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.5, enable_gqa=h != h_kv)).abs().max() < 2e-5
    if t > 1:  # one key: softmax is 1 whatever the scale
        assert (scaled - out).abs().max() > 1e-3


@needs_kernel
@pytest.mark.parametrize("b,nq,t", [(1, 4, 300), (1, 2, 37), (16, 2, 210), (3, 8, 9)])
def test_kernel_matches_sdpa_with_a_tree_per_sequence(b, nq, t):
    q, k, v, m = _inputs(b, 9, 3, t, 64, nq=nq)
    assert fastattention.usable(q, k, v, m) is (nq <= fastattention.MAX_QUERIES)  # the kernel itself takes any count
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    out = fastattention.decode_attention(q, k, v, m)
    assert out.shape == (b, 9, nq, 64)
    assert (out - ref).abs().max().item() < 2e-5
    shared = fastattention.decode_attention(q, k, v, m[:, :, :1])  # one mask row for every query: broadcast
    assert (shared - F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, :, :1], enable_gqa=True)).abs().max() < 2e-5


@needs_kernel
def test_a_query_depends_neither_on_its_batch_nor_on_its_call():
    q, k, v, m = _inputs(6, 9, 3, 121, 64, nq=4)
    whole = fastattention.decode_attention(q, k, v, m)
    for i in (0, 3, 5):
        alone = fastattention.decode_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], m[i : i + 1])
        assert torch.equal(alone, whole[i : i + 1])
        for j in (0, 2):  # a tree node alone == within its tree (same keys, same mask row)
            one = fastattention.decode_attention(q[i : i + 1, :, j : j + 1], k[i : i + 1], v[i : i + 1], m[i : i + 1, :, j : j + 1])
            assert torch.equal(one, whole[i : i + 1, :, j : j + 1])


def test_usable_refuses_what_the_kernel_does_not_take():
    q, k, v, m = _inputs(2, 4, 2, 10, 16)
    ok = fastattention.available() and fastattention.backend() == "kernel"
    assert fastattention.usable(q, k, v, m) is ok
    many = torch.randn(2, 4, fastattention.MAX_QUERIES + 1, 16)
    assert not fastattention.usable(many, k, v, None)  # a prefill-sized call keeps sdpa
    two = torch.randn(2, 4, 2, 16)
    assert fastattention.usable(two, k, v, None) is ok
    five = torch.randn(2, 4, 5, 16)  # a tree of 5 queries: only under a larger limit (one sequence's tree)
    assert not fastattention.usable(five, k, v, None)
    assert fastattention.usable(five, k, v, None, max_queries=fastattention.MAX_QUERIES_ONE) is ok
    assert not fastattention.usable(two, k, v, torch.zeros(2, 1, 3, 10))  # 3 mask rows for 2 queries
    assert not fastattention.usable(q.double(), k.double(), v.double(), None)
    assert not fastattention.usable(q[..., :8], k[..., :8], v[..., :8], None)  # head dim 8 is not built
    assert not fastattention.usable(q, k, v, m.bool())  # a boolean mask
    assert not fastattention.usable(q, k, v, torch.zeros(2, 1, 1, 11))  # the mask's width is not the keys'
    assert not fastattention.usable(q, k[:, :1].expand(2, 3, 10, 16), v[:, :1].expand(2, 3, 10, 16), None)  # 4 % 3
    qg = q.clone().requires_grad_()
    assert not fastattention.usable(qg, k, v, m)  # autograd stays on sdpa
    with torch.no_grad():
        assert fastattention.usable(qg, k, v, m) is ok


def test_backend_switch_and_clear_errors(monkeypatch):
    with fastattention.use("sdpa"):
        assert fastattention.backend() == "sdpa"
        assert not fastattention.usable(*_inputs(2, 4, 2, 10, 16))
    with pytest.raises(ValueError, match="one of"):
        with fastattention.use("flash"):
            pass
    monkeypatch.setattr(fastattention, "_module", lambda: "no compiler here")
    assert fastattention.backend() == "sdpa"  # auto falls back
    assert fastattention.unavailable_reason() == "no compiler here" and not fastattention.available()
    with pytest.raises(ValueError, match="no compiler here"):
        with fastattention.use("kernel"):
            pass
    with pytest.raises(RuntimeError, match="no compiler here"):
        fastattention.decode_attention(*_inputs(2, 4, 2, 10, 16))
    fastattention._configured.cache_clear()
    monkeypatch.setenv("DRAFTTRAIN_DECODE_ATTENTION", "fast")
    try:
        with pytest.raises(ValueError, match="DRAFTTRAIN_DECODE_ATTENTION"):
            fastattention.backend()
    finally:
        fastattention._configured.cache_clear()


@needs_kernel
def test_kernel_rejects_bad_input_with_a_clear_error():
    q, k, v, m = _inputs(2, 4, 2, 10, 24)
    with pytest.raises(RuntimeError, match="head dim 24"):
        fastattention.decode_attention(q, k, v, m)
    q, k, v, m = _inputs(2, 4, 2, 10, 16)
    with pytest.raises(RuntimeError, match="mask"):
        fastattention.decode_attention(torch.cat([q, q], 2), k, v, torch.zeros(2, 1, 3, 10))
    with pytest.raises(RuntimeError, match="mask"):
        fastattention.decode_attention(q, k, v, torch.zeros(2, 1, 1, 9))


@needs_kernel
def test_engine_greedy_unchanged_by_the_kernel(varied_target, make_drafter):
    """Plain and speculative greedy decoding (continuous batching: more prompts than rows) through the
    engine on the kernel == the same engine on sdpa == Hugging Face generate, token for token; and the
    kernel did run for all three (its calls are counted: one query per row, batched 2-query steps, and one
    sequence's tree at batch 1)."""
    from drafttrain.verify import ParallelSpecProposer, PlainProposer, SpecEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 9, 12)]
    new = 12

    def runs():
        return [
            SpecEngine(varied_target, PlainProposer(), batch_size=3, max_new_tokens=new, stop_token_ids=-1).run(prompts),
            SpecEngine(varied_target, ParallelSpecProposer(make_drafter(seed=1).eval(), widths=[2, 1], budget=3),
                       batch_size=2, max_new_tokens=new, stop_token_ids=-1).run(prompts),  # fmt: skip
            SpecEngine(varied_target, ParallelSpecProposer(make_drafter(seed=2).eval(), widths=[1], budget=1),
                       batch_size=3, max_new_tokens=new, stop_token_ids=-1).run(prompts),  # fmt: skip (root + 1 draft)
            SpecEngine(varied_target, ParallelSpecProposer(make_drafter(seed=3).eval(), widths=[2, 2, 1], budget=5),
                       batch_size=1, max_new_tokens=new, stop_token_ids=-1).run(prompts),  # fmt: skip (one sequence's tree)
        ]

    calls = []
    real = fastattention.decode_attention

    def counted(*a, **kw):
        calls.append(tuple(a[0].shape[::2]))  # (rows, queries per row)
        return real(*a, **kw)

    fastattention.decode_attention = counted
    try:
        with fastattention.use("kernel"):
            on_kernel = runs()
    finally:
        fastattention.decode_attention = real
    assert (3, 1) in calls  # the batch-3 plain steps
    assert any(b > 1 and nq == 2 for b, nq in calls)  # batched verification steps (root + one draft per row)
    assert any(b == 1 and nq > 2 for b, nq in calls)  # batch 1: one sequence's tree (up to MAX_QUERIES_ONE queries)
    with fastattention.use("sdpa"):
        on_sdpa = runs()
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        hf = varied_target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                          min_new_tokens=new, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert len(set(hf)) > 3
        for run in on_kernel + on_sdpa:
            assert run.results[i].tokens == hf


def test_engine_attention_routes_only_what_the_kernel_means(tiny_target):
    """``ragged_attention`` (the engine's attention) without segments: one query, or two with a mask, take the
    kernel and equal transformers' sdpa call; two queries without a mask stay on sdpa (causal there)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from drafttrain.verify.cache import ragged_attention

    attn = tiny_target.model.model.layers[0].self_attn
    cfg = tiny_target.config
    h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // h
    for nq, masked in ((1, True), (2, True), (1, False), (2, False)):
        q, k, v, m = _inputs(3, h, h_kv, 11, hd, nq=nq)
        m = m if masked else None
        ref, _ = sdpa_attention_forward(attn, q, k, v, m, scaling=hd**-0.5)
        out, _ = ragged_attention(attn, q, k, v, m, scaling=hd**-0.5)
        assert out.shape == ref.shape == (3, nq, h, hd)
        assert (out - ref).abs().max().item() < 2e-5, (nq, masked)


def test_host_checks_shared_with_the_linear_kernel(monkeypatch):
    """Both kernels refuse a host for the same reasons, with the same words (fastlinear.host_reason)."""
    monkeypatch.setenv("DRAFTTRAIN_NO_KERNEL", "1")
    assert fastlinear.host_reason() == "DRAFTTRAIN_NO_KERNEL is set"
    assert fastattention._module.__wrapped__() == fastlinear._kernel_module.__wrapped__() == "DRAFTTRAIN_NO_KERNEL is set"
    monkeypatch.delenv("DRAFTTRAIN_NO_KERNEL")
    monkeypatch.setattr(fastlinear, "kernel_isa", lambda: None)
    reason = fastlinear.host_reason()
    assert reason is not None and "no AVX2/FMA" in reason
    assert fastattention._module.__wrapped__() == fastlinear._kernel_module.__wrapped__() == reason


def test_engine_loads_the_kernel_before_its_first_timed_step(tiny_target, monkeypatch):
    """A float32 CPU engine asks for the decode-attention backend when it is built, so that a first build
    (~20 s) or load never lands inside a timed decoding step."""
    from drafttrain.verify import PlainProposer, SpecEngine

    calls = []
    monkeypatch.setattr(fastattention, "_module", lambda: calls.append(1) or "counted here")
    SpecEngine(tiny_target, PlainProposer(), batch_size=2)
    assert calls
