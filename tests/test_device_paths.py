"""The CPU kernels step aside off CPU, and the training and decoding paths run on CUDA.

Why: drafttrain's fast paths (drafttrain/csrc through fastattention.py and fastlinear.py) are fp32 CPU
kernels; a CUDA run must take SDPA or flex instead. Without a GPU here, the gates are checked with
CUDA-shaped fakes (``meta`` tensors: a device that is not the CPU, with shapes and dtypes and no data).
The whole paths cannot run on ``meta``: they read lengths and anchors on the host (``.item()``), which a
meta tensor has no value for. The ``cuda`` tests (scripts/device_check.sh) run every recipe's training step
and plain greedy decoding on the GPU itself.
"""

from __future__ import annotations

import pytest
import torch

from drafttrain import fastattention, fastlinear


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
