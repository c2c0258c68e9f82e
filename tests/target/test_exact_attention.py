"""The engine's attention for families with their own softmax: attention sinks (gpt-oss, MiMo-V2-Flash, Granite-SWA)
and logit soft-capping (Gemma-2), against transformers' own eager attention of those families, and a Gemma-2 target
whose final logits are soft-capped decoding greedy-equal through the engine.

Why: these families were refused by name ("attention sinks / logit soft-capping are not in drafttrain's engine
attention"); :func:`drafttrain.verify.cache.exact_attention` computes their softmax as the family does.
"""

from __future__ import annotations

import torch

from drafttrain.verify.cache import exact_attention


def _qkv(b=2, h=4, h_kv=2, q=3, kv=7, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q, hd, generator=g), torch.randn(b, h_kv, kv, hd, generator=g),
            torch.randn(b, h_kv, kv, hd, generator=g))  # fmt: skip


def _mask(b, q, kv):
    m = torch.zeros(b, 1, q, kv)
    m[..., -1] = torch.finfo(torch.float32).min  # one masked key per query
    m[0, 0, 0, :3] = torch.finfo(torch.float32).min
    return m


def test_sinks_equal_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv()
    mask = _mask(2, 3, 7)
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.randn(4))
    module.num_key_value_groups = 2
    module.training = False
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=0.0)  # [b, q, h, hd]
    got = exact_attention(q, k, v, mask, 0.3, sinks=module.sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    plain = exact_attention(q, k, v, mask, 0.3)
    assert (plain - got).abs().max() > 1e-3  # the sinks change the output: the comparison above can fail


def test_softcap_equals_gemma2_eager_attention():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = _qkv(seed=1)
    q = q * 4  # large logits: the cap matters
    mask = _mask(2, 3, 7)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    module.training = False
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=0.0, softcap=5.0)
    got = exact_attention(q, k, v, mask, 0.3, softcap=5.0)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    assert (exact_attention(q, k, v, mask, 0.3) - got).abs().max() > 1e-3


def test_mla_values_of_their_own_size():
    q, k, _ = _qkv(hd=12)
    v = torch.randn(2, 2, 7, 5)  # values of another head size than the keys (MLA)
    out = exact_attention(q, k, v, _mask(2, 3, 7), None)
    assert out.shape == (2, 4, 3, 5)


def test_gemma2_final_softcap_target_decodes_greedy_equal(tiny_target):
    """Gemma-2 soft-caps its attention logits and its final logits: drafttrain's logits are the model's own
    (:class:`drafttrain.target.model.SoftcappedHead`) and the sweep's check passes (both drafters trained and decoded
    greedy-equal through the engine)."""
    from drafttrain import sweep

    row = sweep.sweep_one("Gemma2ForCausalLM", tiny_target.tokenizer)
    assert row.status == "trains" and all(row.greedy_equal.values()), row
