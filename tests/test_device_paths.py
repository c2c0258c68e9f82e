"""The CPU kernels step aside off CPU, and every path is device-agnostic.

Why: drafttrain's fast paths (drafttrain/target/csrc through fastattention.py and fastlinear.py) are fp32 CPU
kernels; a CUDA run must take SDPA or flex instead. Without a GPU here, the gates are checked with
CUDA-shaped fakes (``meta`` tensors: a device that is not the CPU, with shapes and dtypes and no data).

The whole paths cannot run on ``meta`` tensors: they read lengths and anchors on the host (``.item()``),
which a meta tensor has no value for. So the model, drafter and batch stay on the CPU and each path runs
with ``meta`` as torch's *default* device (:func:`meta_default`): a tensor the path creates without an
explicit ``device=`` (``torch.arange(n)``, ``torch.zeros(...)``, ``torch.tensor([...])``) lands on meta and
fails where it meets a real tensor, or shows up as a meta tensor in the outputs. That is the CUDA bug of a
CPU tensor created inside a CUDA step (the CPU is torch's default there). Host-side bookkeeping is built
with an explicit ``device="cpu"`` and moved where needed. Covered here: one training step (loss, backward,
metric sums, also of a batch without any label) of every recipe; the layout/mask builders; the engine's
speculative decoding (chain, tree, sampling) of every recipe's proposer; self-distillation's generation
backends (engine, hf) and its teacher-forced features; export in every format; the evaluation harness.
Each also gives the same output as the run without the meta default. Not covered: creations that do not
go through torch's factory functions (``*_like``, ``new_*`` follow their input, so they are right by
construction), the multi-process training loop (its ``get_batch`` moves batches explicitly), vLLM. The
``cuda`` tests (scripts/device_check.sh) run every recipe's training step and plain greedy decoding on
the GPU itself.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from drafttrain.target import fastattention, fastlinear


@pytest.mark.parametrize("device,dtype", [("meta", torch.float32), ("meta", torch.bfloat16), ("cpu", torch.bfloat16)])
def test_decode_attention_kernel_is_cpu_fp32_only(device, dtype):
    q = torch.zeros(2, 4, 1, 64, device=device, dtype=dtype)
    kv = torch.zeros(2, 2, 10, 64, device=device, dtype=dtype)
    mask = torch.zeros(2, 1, 1, 10, device=device, dtype=dtype)
    assert not fastattention.usable(q, kv, kv, mask)


def test_decode_attention_kernel_is_taken_on_cpu_fp32():
    """The positive case of the gate above (where the kernel is built): the test can tell the two apart."""
    if fastattention.backend() != "kernel":
        pytest.skip(f"decode-attention backend here: {fastattention.backend()}")
    q, kv = torch.zeros(2, 4, 1, 64), torch.zeros(2, 2, 10, 64)
    assert fastattention.usable(q, kv, kv, torch.zeros(2, 1, 1, 10))


@pytest.mark.parametrize("device", ["cuda", "meta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_linear_never_packs_off_cpu(device, dtype):
    assert fastlinear.resolve("auto", device, dtype) is None
    with pytest.raises(ValueError, match="not CPU|not float32"):
        fastlinear.resolve("kernel", device, dtype)


# -- on the GPU (scripts/device_check.sh) ----------------------------------------------------------------

RECIPES = ["eagle3", "parallelspec", "parallelspec_eagle", "parallelspec_eagle3", "dflash", "eagle", "medusa"]


@pytest.mark.cuda
@pytest.mark.parametrize("name", RECIPES)
def test_training_step_on_cuda_bf16(name):
    from drafttrain.drafters import build_drafter
    from scripts.device_check import TINY, build_target

    target = build_target(TINY, "cuda", torch.bfloat16)
    torch.manual_seed(0)
    dr = build_drafter(name, {}, target).train()
    ids = torch.randint(3, TINY["vocab_size"], (2, 24), device="cuda")
    lengths = torch.tensor([24, 17], device="cuda")
    feats = target.forward(ids, with_logits=False, feature_layers=tuple(dr.feature_layers)).features[:, :-1]
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": lengths, "features": feats}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dr.training_loss(batch, torch.Generator().manual_seed(0))
    out.loss.backward()
    assert out.loss.device.type == "cuda" and torch.isfinite(out.loss)
    grads = [p.grad for p in dr.parameters() if p.grad is not None]
    assert grads and all(g.device.type == "cuda" and torch.isfinite(g).all() for g in grads)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_engine_plain_decoding_greedy_equal_on_cuda(batch):
    from drafttrain.generation.engine import engine_generate
    from scripts.device_check import TINY, build_target

    target = build_target(TINY, "cuda", torch.float32)
    prompts = torch.randint(3, TINY["vocab_size"], (batch, 10), generator=torch.Generator().manual_seed(batch))
    ours = [o["tokens"][10:] for o in engine_generate(target, prompts.tolist(), 12, stop_token_ids=-1,
                                                      return_features=False, batch_size=batch)]  # fmt: skip
    hf = target.model.generate(prompts.cuda(), max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[:, 10:].tolist()  # fmt: skip
    assert ours == hf


# -- every path with `meta` as the default device (no GPU needed) -------------------------------------------


@contextlib.contextmanager
def meta_default():
    """torch's default device is ``meta`` inside (restored after): a device-less creation lands there."""
    with torch.device("meta"):
        yield


def _on_cpu(x) -> bool:
    """Every tensor inside ``x`` (nested dicts / lists / tuples / dataclass-like objects) is a CPU tensor."""
    if isinstance(x, torch.Tensor):
        return x.device.type == "cpu"
    if isinstance(x, dict):
        return all(_on_cpu(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_on_cpu(v) for v in x)
    return True


TRAIN_CONFIGS = {
    "medusa": {"num_heads": 3},
    "eagle": {"draft_depth": 3, "init_from_target_layer": False},
    "eagle3": {"draft_depth": 3, "ttt_steps": 3, "init_from_target_layer": False, "draft_vocab_size": 300},
    "parallelspec": {"num_mask_tokens": 3, "anchor_ratio": 1.0, "init_from_target_layer": False},
    "parallelspec_eagle": {"num_mask_tokens": 3, "anchor_ratio": 1.0, "init_from_target_layer": False},
    "parallelspec_eagle3": {"num_mask_tokens": 3, "anchor_ratio": 1.0, "init_from_target_layer": False,
                            "draft_vocab_size": 300},
    "dflash": {"block_size": 4, "num_layers": 2, "init_from_target_layer": False},
}  # fmt: skip


def _drafter_and_batch(target, name: str, loss_mask: bool = True):
    """A seed-0 drafter of ``name`` on the CPU and a 2-row batch with the features it declares (restricted
    vocabularies hold half of the target's argmax tokens). ``loss_mask=False``: no position has a label."""
    from drafttrain.drafters import build_drafter
    from helpers import make_batch

    torch.manual_seed(0)
    dr = build_drafter(name, TRAIN_CONFIGS[name], target)
    batch = make_batch(target)
    ids, lengths = batch["input_ids"], batch["lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        batch["features"] = target.features(ids, attn, tuple(dr.feature_layers))[:, :-1]
        if dr.restricted_vocab:
            tops = target.lm_head(dr.final_features(batch["features"])).argmax(-1).flatten().unique()
            keep = tops[: max(1, tops.numel() // 2)].tolist()
            rest = [i for i in range(3, dr.vocab_size) if i not in set(tops.tolist())][: 300 - len(keep)]
            dr.set_draft_vocab(torch.tensor(keep + rest))
    if not loss_mask:
        batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    return dr, batch


def _train_step(dr, batch):
    dr.zero_grad(set_to_none=True)
    out = dr.training_loss(batch, torch.Generator().manual_seed(0))
    out.loss.backward()
    return out


@pytest.mark.parametrize("name", list(TRAIN_CONFIGS))
def test_training_step_creates_no_tensor_on_the_default_device(tiny_target, name):
    dr, batch = _drafter_and_batch(tiny_target, name)
    dr.train()
    ref = _train_step(dr, batch)
    ref_grads = [p.grad.clone() for p in dr.parameters() if p.grad is not None]
    with meta_default():
        out = _train_step(dr, batch)
    assert _on_cpu(out.loss) and _on_cpu(out.sums) and torch.isfinite(out.loss)
    grads = [p.grad for p in dr.parameters() if p.grad is not None]
    assert grads and _on_cpu(grads)
    assert torch.equal(out.loss, ref.loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(out.sums[k], ref.sums[k]) for k in ref.sums)


@pytest.mark.parametrize("name", list(TRAIN_CONFIGS))
def test_metric_sums_of_a_batch_without_labels_stay_on_the_step_device(tiny_target, name):
    """The empty-group sums (metrics.empty_group_sums) are merged with other steps' sums and all-reduced:
    they must be on the step's device, not the default one."""
    from drafttrain.metrics import merge_sums

    dr, batch = _drafter_and_batch(tiny_target, name)
    _, empty = _drafter_and_batch(tiny_target, name, loss_mask=False)
    dr.eval()
    with torch.no_grad(), meta_default():
        full = dr.training_loss(batch).sums
        none = dr.training_loss(empty).sums
        merged = merge_sums(merge_sums(None, none), full)
    assert _on_cpu(none) and _on_cpu(merged)


def test_layout_builders_build_on_the_given_device():
    from drafttrain import layout as L

    with meta_default():
        pos, mask = L.inference_layout(3, 2, torch.float32, past=4, device="cpu")
        tpos, tmask = L.ttt_step_layout(5, 2, torch.float32, device="cpu")
    assert _on_cpu([pos, mask, tpos, tmask])
    assert torch.equal(mask, L.inference_layout(3, 2, torch.float32, past=4)[1])
    assert torch.equal(tmask, L.ttt_step_layout(5, 2, torch.float32)[1])
    pos, mask = L.inference_layout(3, 2, torch.float32, past=4, device="meta")
    assert pos.device.type == mask.device.type == "meta" and mask.shape == (1, 1, 5, 9)
    pos, mask = L.ttt_step_layout(5, 2, torch.float32, device="meta")
    assert pos.device.type == mask.device.type == "meta" and mask.shape == (1, 1, 5, 15)


ENGINE_CONFIGS = {
    "medusa": {"num_heads": 3},
    "eagle": {"draft_depth": 3},
    "eagle3": {"draft_depth": 3, "draft_vocab_size": 300},
    "parallelspec": {"num_mask_tokens": 3},
    "parallelspec_eagle": {"num_mask_tokens": 3},
    "parallelspec_eagle3": {"num_mask_tokens": 3, "draft_vocab_size": 300},
    "dflash": {"block_size": 4, "num_layers": 1},
}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _decode(target, dr, prompts, mode, widths, sampling):
    from drafttrain.verify import SpecEngine, proposer_for

    run = SpecEngine(target, proposer_for(dr, widths=widths), batch_size=2, max_new_tokens=6, mode=mode,
                     stop_token_ids=[-1], sampling=sampling, seed=1).run(prompts)  # fmt: skip
    return [r.tokens for r in run.results]


@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_engine_creates_no_tensor_on_the_default_device(varied_target, prompts, name):
    """Chain and tree drafting in every engine mode, and sampling (acceptance draws from the engine's
    generator, which lives on the target's device): same tokens as without the meta default."""
    from drafttrain.drafters import build_drafter
    from drafttrain.verify import MODES, SamplingParams

    torch.manual_seed(0)
    dr = build_drafter(name, ENGINE_CONFIGS[name], varied_target).eval()
    runs = [(m, None, None) for m in MODES] + [("unpadded", [2, 1], None), ("padded", [2, 1], None),
                                               ("unpadded", [2, 1], SamplingParams(temperature=1.0))]  # fmt: skip
    for mode, widths, sampling in runs:
        ref = _decode(varied_target, dr, prompts, mode, widths, sampling or SamplingParams())
        with meta_default():
            got = _decode(varied_target, dr, prompts, mode, widths, sampling or SamplingParams())
        assert got == ref, (mode, widths, sampling)


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_self_distillation_generation_creates_no_tensor_on_the_default_device(tiny_target, prompts, backend):
    from drafttrain.data.selfdistill import teacher_forced_features
    from drafttrain.generation import generator_for
    from drafttrain.sampling import SamplingParams

    gen = generator_for(backend, tiny_target, batch_size=2)
    kw = {"stop_token_ids": -1, "return_features": True, "feature_layers": (1, 2)}
    ref = gen.generate(prompts, 5, **kw)
    with meta_default():
        got = gen.generate(prompts, 5, **kw)
        feats = teacher_forced_features(tiny_target, [r["tokens"] for r in got], feature_layers=(1, 2))
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref] and _on_cpu(got) and _on_cpu(feats)
    assert all(torch.equal(a["features"], b["features"]) for a, b in zip(got, ref))
    if backend == "hf":  # sampling: one CPU generator per row
        sampling = SamplingParams(temperature=1.0)
        gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(prompts))]  # noqa: E731
        ref = gen.generate(prompts, 5, stop_token_ids=-1, return_features=False, sampling=sampling, generators=gens())
        with meta_default():
            got = gen.generate(prompts, 5, stop_token_ids=-1, return_features=False, sampling=sampling,
                               generators=gens())  # fmt: skip
        assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]


@pytest.fixture(scope="module")
def four_layer_target():
    """A tiny random target with 4 layers: EAGLE-3's three feature layers are distinct there (export)."""
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target
    from helpers import need_input

    return need_input(lambda: load_target(TargetConfig(random_init=True, num_hidden_layers=4)))


@pytest.mark.parametrize("name", ["medusa", "eagle3", "parallelspec_eagle3", "dflash"])
def test_export_creates_no_tensor_on_the_default_device(tiny_target, four_layer_target, tmp_path, name):
    from safetensors.torch import load_file

    from drafttrain.drafters import build_drafter
    from drafttrain.export import export_drafter, formats_for

    target = four_layer_target if "eagle3" in name else tiny_target
    cfg = {**ENGINE_CONFIGS[name], **({"aux_layer_ids": [0, 1, 2]} if "eagle3" in name else {})}
    torch.manual_seed(0)
    dr = build_drafter(name, cfg, target)
    if dr.restricted_vocab:
        dr.set_draft_vocab(torch.randperm(dr.vocab_size, generator=torch.Generator().manual_seed(0))[:300])
    opts = {} if name == "medusa" else {"target_config": target.config}
    for fmt in formats_for(name):
        export_drafter(dr, fmt, tmp_path / fmt / "ref", **opts)
        with meta_default():
            export_drafter(dr, fmt, tmp_path / fmt / "meta", **opts)
        ref, got = (load_file(tmp_path / fmt / d / "model.safetensors") for d in ("ref", "meta"))
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), fmt


def _on_cpu_default(fn):
    """``fn`` run with the CPU as torch's default device (loading a model builds its modules: not a step)."""

    def wrapped(*a, **k):
        with torch.device("cpu"):
            return fn(*a, **k)

    return wrapped


def test_eval_harness_creates_no_tensor_on_the_default_device(checkpoint, tmp_path, monkeypatch):
    """Everything the harness runs after loading the target and the drafter (the loaders build modules)."""
    import drafttrain.eval.harness as harness
    import drafttrain.target
    from helpers import compose_dict

    monkeypatch.setattr(drafttrain.target, "load_target", _on_cpu_default(drafttrain.target.load_target))
    monkeypatch.setattr(harness, "load_drafter", _on_cpu_default(harness.load_drafter))
    evaluate = harness.evaluate

    def run(out):
        return evaluate(compose_dict("evaluate", [
            f"checkpoint={checkpoint}", "target=tiny", "num_prompts=2", "max_new_tokens=6", "batch_sizes=[2]",
            "tree.widths=[2,1]", f"output_dir={out}", "progress=false", "warmup=false",
        ]))  # fmt: skip

    ref = run(tmp_path / "ref")
    with meta_default():
        got = run(tmp_path / "meta")
    assert got["greedy_equal"] is True
    assert [r["generated_tokens"] for r in got["runs"]] == [r["generated_tokens"] for r in ref["runs"]]
    assert (tmp_path / "meta" / "outputs.jsonl").read_text() == (tmp_path / "ref" / "outputs.jsonl").read_text()


# -- the check catches the mistake it is for ---------------------------------------------------------------


def _forgets_device(monkeypatch):
    """layout.inference_layout as if written without ``device=`` (every creation takes the default device)."""
    from drafttrain import layout as L

    real = L.inference_layout
    monkeypatch.setattr(L, "inference_layout", lambda *a, device="cpu", **k: real(*a, **k, device=None))


def test_a_device_less_creation_in_a_training_step_fails_the_check(tiny_target, monkeypatch):
    dr, batch = _drafter_and_batch(tiny_target, "eagle")
    dr.train()
    _forgets_device(monkeypatch)
    out = _train_step(dr, batch)  # on the CPU the mistake is invisible (default device = the CPU)...
    assert _on_cpu(out.loss)
    with pytest.raises((RuntimeError, NotImplementedError)), meta_default():
        _train_step(dr, batch)  # ...the meta default catches it


def test_a_device_less_creation_in_an_engine_step_fails_the_check(varied_target, prompts, monkeypatch):
    from drafttrain.drafters import build_drafter
    from drafttrain.verify import SamplingParams, SpecEngine

    torch.manual_seed(0)
    dr = build_drafter("eagle", ENGINE_CONFIGS["eagle"], varied_target).eval()
    real = SpecEngine._forward

    def forgets_device(self, rows, toks, pos, *rest, **kw):  # positions offset by a tensor made without device=
        return real(self, rows, toks, [p + torch.zeros(p.numel(), dtype=p.dtype) for p in pos], *rest, **kw)

    monkeypatch.setattr(SpecEngine, "_forward", forgets_device)
    _decode(varied_target, dr, prompts, "unpadded", None, SamplingParams())
    with pytest.raises((RuntimeError, NotImplementedError)), meta_default():
        _decode(varied_target, dr, prompts, "unpadded", None, SamplingParams())
