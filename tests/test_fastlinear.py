"""Tests of drafttrain.target.fastlinear (the target's linears on prepacked weights): both
backends, drafttrain's AVX2 kernel (where it builds) and oneDNN.

The swap must be invisible except in speed: same parameters (tied LM head included, so drafters that
share it keep working and training still gets gradients), same state_dict, logits equal up to float
reassociation, and greedy decoding through the engine equal to Hugging Face ``generate`` on the
unpacked model, token for token.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from drafttrain.target import fastlinear
from drafttrain.config import ConfigError, TargetConfig
from drafttrain.target import Target

pytestmark = pytest.mark.skipif(not fastlinear.available(), reason="neither the kernel nor oneDNN is available")
HERE = [b for b in fastlinear.BACKENDS if fastlinear.available(b)]
needs_kernel = pytest.mark.skipif(not fastlinear.kernel_available(), reason=f"no kernel: {fastlinear.kernel_unavailable_reason()}")


def _varied(model: nn.Module) -> nn.Module:
    """A copy with its 2-D weights redrawn (std 0.3): greedy outputs change at every step."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    return model


@pytest.fixture(scope="module", params=HERE)
def pair(tiny_target, request):
    """(packed, plain) tiny varied targets with equal weights, once per available backend."""
    plain = _varied(tiny_target.model)
    fastlinear.unpack_linears(plain)
    packed = copy.deepcopy(plain)
    n = fastlinear.pack_linears(packed, request.param)
    assert fastlinear.backend_of(packed) == request.param
    assert n == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    return Target(packed, tiny_target.tokenizer), Target(plain, tiny_target.tokenizer)


@pytest.mark.parametrize("backend", HERE)
def test_layer_matches_f_linear_and_shares_parameters(backend):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200)
    pl = fastlinear.PackedLinear.from_linear(lin, backend)
    assert pl.backend == backend and f"packed={backend}" in repr(pl)
    assert isinstance(pl, nn.Linear) and pl.weight is lin.weight and pl.bias is lin.bias
    for shape in [(1, 96), (9, 96), (2, 5, 96), (0, 96)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            ref, out = lin(x), pl(x)
        assert out.shape == ref.shape
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 96)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # changed in place (load_state_dict, a training step): repacked on the next call
        assert torch.allclose(pl(x), lin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", HERE)
def test_gradients_fall_back_to_f_linear(backend):
    """A drafter's loss goes through the shared LM head with grad on: the op has no backward, so F.linear runs."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 50, bias=False).requires_grad_(False)
    pl = fastlinear.PackedLinear.from_linear(lin, backend)
    x = torch.randn(4, 32, requires_grad=True)
    pl(x).square().sum().backward()
    g1 = x.grad.clone()
    x.grad = None
    lin(x).square().sum().backward()
    assert torch.allclose(g1, x.grad)
    with torch.no_grad():
        assert pl(x).grad_fn is None


def test_pack_keeps_ties_state_dict_and_deepcopy(pair):
    packed, plain = pair
    m = packed.model
    assert isinstance(m.lm_head, fastlinear.PackedLinear)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied: drafters read lm_head.weight
    assert all(type(x) is not nn.Linear for x in m.modules())
    assert list(m.state_dict()) == list(plain.model.state_dict())
    m2 = copy.deepcopy(m)
    assert isinstance(m2.lm_head, fastlinear.PackedLinear) and m2.lm_head.weight is m2.model.embed_tokens.weight
    assert fastlinear.backend_of(m2) == fastlinear.backend_of(m)
    assert m2.lm_head.weight is not m.lm_head.weight
    assert fastlinear.is_packed(m2) and not fastlinear.is_packed(plain.model)


def test_logits_match_unpacked(pair):
    packed, plain = pair
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 49152, (2, 23), generator=g)
    a, b = packed.forward(ids).logits, plain.forward(ids).logits
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_engine_on_packed_equals_hf_generate_unpacked(pair, make_drafter):
    """Greedy speculative and plain decoding on the packed target == HF generate on the plain one."""
    from drafttrain.verify import ParallelSpecProposer, PlainProposer, SpecEngine

    packed, plain = pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 9)]
    new = 16
    runs = [
        SpecEngine(packed, PlainProposer(), batch_size=2, max_new_tokens=new, stop_token_ids=-1).run(prompts),
        SpecEngine(packed, ParallelSpecProposer(make_drafter(seed=1).eval(), widths=[2, 2, 1], budget=5),
                   batch_size=3, max_new_tokens=new, stop_token_ids=-1).run(prompts),  # fmt: skip
    ]
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        hf = plain.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                  min_new_tokens=new, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert len(set(hf)) > 3  # the varied target changes token: an off-by-one would show
        for run in runs:
            assert run.results[i].tokens == hf


def test_resolve_modes():
    assert fastlinear.resolve("off", "cpu", torch.float32) is None
    assert fastlinear.resolve("auto", "cpu", torch.float32) == fastlinear.best_backend() == HERE[0]
    assert fastlinear.resolve("on", "cpu", torch.float32) == HERE[0]
    for b in HERE:
        assert fastlinear.resolve(b, "cpu", torch.float32) == b
    assert fastlinear.resolve("auto", "cpu", torch.bfloat16) is None
    assert fastlinear.resolve("auto", "meta", torch.float32) is None
    with pytest.raises(ValueError, match="fast_linear=on"):
        fastlinear.resolve("on", "cpu", torch.float16)
    with pytest.raises(ValueError, match="fast_linear=kernel cannot apply: dtype"):
        fastlinear.resolve("kernel", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="fast_linear must be"):
        fastlinear.resolve("yes", "cpu", torch.float32)


def test_tiny_target_is_packed_by_default_and_off_is_plain(tiny_target):
    from drafttrain.target import load_target

    assert fastlinear.is_packed(tiny_target.model)  # auto on CPU: every test runs the packed path
    assert fastlinear.backend_of(tiny_target.model) == fastlinear.best_backend()  # the kernel where it builds
    off = load_target(TargetConfig(random_init=True, fast_linear="off"))
    assert not fastlinear.is_packed(off.model)
    with pytest.raises(ValueError, match="fast_linear"):
        load_target(TargetConfig(random_init=True, fast_linear="sometimes"))


def test_config_rejects_bad_fast_linear():
    from tests.helpers import compose_dict
    from drafttrain.validation import validate

    d = compose_dict("train", ["target=tiny", "target.fast_linear=maybe"])
    with pytest.raises(ConfigError, match="fast_linear"):
        validate(d)


def test_pack_for_inference_packs_the_drafter_and_its_draft_head(tiny_target, make_drafter):
    """On a packed target, Drafter.pack_for_inference packs the drafter's own linears and runs its
    draft-vocabulary head packed: the same logits up to float reassociation, the same state_dict, and
    training still gets gradients (the packed layers fall back to F.linear under autograd); on a target
    left unpacked (fast_linear=off) it does nothing."""
    from drafttrain.drafters import build_drafter
    from drafttrain.target import load_target

    assert fastlinear.is_packed(tiny_target.model)
    drafter = make_drafter(seed=5, draft_vocab_size=300)
    drafter.set_draft_vocab(torch.arange(7, 307))
    keys = sorted(drafter.state_dict())
    feats = torch.randn(2, 5, int(tiny_target.model.config.hidden_size))
    w, b = drafter.draft_head_rows()
    before = torch.nn.functional.linear(feats, w, b).float()  # the draft head on F.linear
    with torch.no_grad():
        assert torch.equal(drafter.vocab_logits(feats), before)  # not packed yet: F.linear
    assert not fastlinear.is_packed(drafter)
    assert drafter.pack_for_inference() > 0
    assert fastlinear.is_packed(drafter) and sorted(drafter.state_dict()) == keys
    with torch.no_grad():
        after = drafter.vocab_logits(feats)
    assert isinstance(drafter.__dict__["_head_rows_packed"][1], fastlinear.PackedLinear)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    x = feats.clone().requires_grad_(True)
    drafter.vocab_logits(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    off = load_target(TargetConfig(random_init=True, fast_linear="off"))
    plain = build_drafter("parallelspec", {"num_mask_tokens": 2}, off)
    assert plain.pack_for_inference() == 0 and not fastlinear.is_packed(plain)


# ==================================================================================================
# drafttrain's AVX2 kernel (drafttrain/target/csrc/small_m_linear.cpp)
# ==================================================================================================


@needs_kernel
@pytest.mark.parametrize("k,n", [(96, 200), (13, 77), (1, 121), (40, 8), (64, 300)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_f_linear_at_every_row_count(k, n, bias):
    """Every tile shape of the build this machine gets (1-9 rows, the 6- and 9-row tiles, the 192-row chunks) and ragged out_features
    (tails of a 8-column vector and of a tile) against F.linear."""
    torch.manual_seed(k * n)
    lin = nn.Linear(k, n, bias=bias)
    if bias:
        with torch.no_grad():
            lin.bias.normal_()
    pl = fastlinear.PackedLinear.from_linear(lin, "kernel")
    for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 17, 18, 33, 64, 200, 389]:
        x = torch.randn(m, k)
        with torch.no_grad():
            ref, out = lin(x), pl(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()))


@needs_kernel
def test_kernel_rows_are_batch_invariant():
    """A row's output is bitwise the same computed alone, in any batch and at any position: every
    output is one in-order FMA chain whatever the tile shape (unlike F.linear / oneDNN)."""
    torch.manual_seed(3)
    lin = nn.Linear(576, 200)
    pl = fastlinear.PackedLinear.from_linear(lin, "kernel")
    x = torch.randn(203, 576)
    with torch.no_grad():
        full = pl(x)
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 64]:
            for start in (0, 1, 100):
                assert torch.equal(pl(x[start : start + m]), full[start : start + m]), (m, start)


@needs_kernel
def test_kernel_rejects_bad_input_with_a_clear_error():
    mod = fastlinear._kernel_module()
    w = torch.randn(10, 6)
    wp = mod.pack(w)
    with pytest.raises(RuntimeError, match="float32"):
        mod.linear(torch.randn(2, 6, dtype=torch.float64), wp, 10, None)
    with pytest.raises(RuntimeError, match="does not match in_features"):
        mod.linear(torch.randn(2, 7), wp, 10, None)
    with pytest.raises(RuntimeError, match="pack: expected a 2-D float32"):
        mod.pack(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="not available|backend"):
        fastlinear.PackedLinear.from_linear(nn.Linear(3, 4), "cuda-magic")


@needs_kernel
def test_the_kernel_builds_this_machine_gets():
    """AVX-512 machines get the AVX-512 build (32 registers, larger tiles), others the AVX2 one; the
    module says which it is."""
    isa = fastlinear.kernel_isa()
    cap = fastlinear.cpu_capability()
    assert isa == ("avx512" if cap.startswith("AVX512") else "avx2")
    assert fastlinear._kernel_module().isa == isa


def test_kernel_isa_follows_the_environment(monkeypatch):
    monkeypatch.setattr(fastlinear, "cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("DRAFTTRAIN_KERNEL_ISA", raising=False)
    assert fastlinear.kernel_isa() == "avx512"
    monkeypatch.setenv("DRAFTTRAIN_KERNEL_ISA", "avx2")
    assert fastlinear.kernel_isa() == "avx2"
    monkeypatch.setattr(fastlinear, "cpu_capability", lambda: "AVX2")
    assert fastlinear.kernel_isa() == "avx2"
    monkeypatch.setenv("DRAFTTRAIN_KERNEL_ISA", "avx512")
    assert fastlinear.kernel_isa() is None  # never run AVX-512 code on a CPU without it
    monkeypatch.setenv("DRAFTTRAIN_KERNEL_ISA", "sse")
    with pytest.raises(ValueError, match="DRAFTTRAIN_KERNEL_ISA"):
        fastlinear.kernel_isa()
    monkeypatch.setattr(fastlinear, "cpu_capability", lambda: "DEFAULT")
    monkeypatch.delenv("DRAFTTRAIN_KERNEL_ISA")
    assert fastlinear.kernel_isa() is None


@pytest.mark.skipif(fastlinear.kernel_isa() != "avx512" or not fastlinear.kernel_available(),
                    reason="needs an AVX-512 CPU (the AVX-512 build cannot run elsewhere)")
def test_avx512_build_equals_avx2_build_bitwise():
    """Both builds compute every output as the same in-order FMA chain, whatever their tile shapes, so
    their results are bitwise equal at every row count (the AVX-512 build's 4-6, 7-9 and split 10-17
    row tiles included) and at ragged out_features."""
    builds = {isa: fastlinear._kernel_build(isa) for isa in fastlinear.KERNEL_ISAS}
    assert not any(isinstance(m, str) for m in builds.values()), builds
    assert builds["avx2"].isa == "avx2" and builds["avx512"].isa == "avx512"
    torch.manual_seed(5)
    for k, n in [(576, 200), (13, 77), (64, 300)]:
        w, b = torch.randn(n, k), torch.randn(n)
        packed = {isa: m.pack(w) for isa, m in builds.items()}
        assert torch.equal(packed["avx2"], packed["avx512"])
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 17, 33, 64, 200]:
            x = torch.randn(m, k)
            out = {isa: mod.linear(x, packed[isa], n, b) for isa, mod in builds.items()}
            assert torch.equal(out["avx2"], out["avx512"]), (k, n, m)
            torch.testing.assert_close(out["avx512"], x @ w.T + b, rtol=1e-4, atol=1e-4)


def test_a_failed_avx512_build_falls_back_to_the_avx2_build(monkeypatch):
    """An AVX-512 machine whose compiler cannot build the AVX-512 variant still gets the kernel (its AVX2
    build), not oneDNN; where neither builds, the reason is the AVX-512 build's."""
    monkeypatch.setattr(fastlinear, "kernel_isa", lambda: "avx512")
    monkeypatch.setattr(fastlinear.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("DRAFTTRAIN_NO_KERNEL", raising=False)
    avx2 = object()
    monkeypatch.setattr(fastlinear, "_kernel_build", lambda isa: avx2 if isa == "avx2" else "no -mavx512vl")
    assert fastlinear._kernel_module.__wrapped__() is avx2
    monkeypatch.setattr(fastlinear, "_kernel_build", lambda isa: f"{isa} failed")
    assert fastlinear._kernel_module.__wrapped__() == "avx512 failed"


def test_describe_names_the_backend_and_the_kernel_build(tiny_target):
    """Run records (launch.json, docs/benchmarks/main_job.md) name how the target's linears ran."""
    plain = copy.deepcopy(tiny_target.model)
    fastlinear.unpack_linears(plain)
    assert fastlinear.describe(plain) == "F.linear"
    for backend in HERE:
        packed = copy.deepcopy(plain)
        fastlinear.pack_linears(packed, backend)
        expect = f"kernel ({fastlinear._kernel_module().isa} build)" if backend == "kernel" else backend
        assert fastlinear.describe(packed) == expect
