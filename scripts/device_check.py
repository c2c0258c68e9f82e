"""The measurements of scripts/device_check.sh: training and decoding with a Llama-3.1-8B-shaped target on a GPU.

    python -m scripts.device_check out=DIR [dry_run=true]

Needs torch, transformers and omegaconf (the project's key=value CLI; scripts/device_check.sh installs
it from the wheelhouse first); no hydra-core, datasets, wandb or deepspeed are imported here; drafttrain's drafters and engine are). The target is built from a config with random weights in bf16
on the device (no weights travel). Measured:

- training: tokens/s, step time and peak GiB (``torch.cuda.max_memory_allocated``) of the ``eagle3``,
  ``parallelspec_eagle3`` and ``parallelspec`` drafters at sequence length 2048 and 4096, micro-batch 1-4,
  with ``attention`` dense and flex. A step = the frozen target's forward for the features (no grad), the
  drafter's loss forward + backward and an AdamW step; median of ``--steps`` steps after a warm-up (compile).
  A point that runs out of memory is recorded as ``oom``. MFU = (2 N_target + 6 N_drafter) x tokens / step
  time / the GPU's dense bf16 peak (:data:`BF16_PEAK`); attention FLOPs are left out (an undercount).
- decoding: plain greedy tokens/s of drafttrain's engine (:func:`drafttrain.generation.engine.engine_generate`)
  beside Hugging Face ``generate`` at batch 1 and 16 on the same prompts, and whether their tokens are equal.

``dry_run=true``: the same steps on the CPU with a tiny Llama config (d = 64, 2 layers), sequence length 32,
micro-batch 1-2, dense only (flex attention has no backward on CPU), 4 new tokens; no timings are
reported (every time field is null). Writes ``gpu.json`` and ``gpu.md`` into ``out``.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

#: dense bf16 tensor-core peak FLOP/s by device-name substring (vendor data sheets, SXM parts; no sparsity)
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
RECIPES = {"eagle3": {}, "parallelspec_eagle3": {}, "parallelspec": {}}  # each recipe's shipped defaults


def build_target(shape: dict, device: str, dtype: torch.dtype):
    """A random-init Llama of ``shape`` built directly on ``device`` in ``dtype`` (sdpa attention), wrapped as a
    :class:`drafttrain.target.Target` without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafttrain.target import Target

    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    model.eval().requires_grad_(False)
    return Target(model, None)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_point(target, name: str, seq: int, mbs: int, attention: str, steps: int, device: str, dry: bool) -> dict:
    """One (recipe, sequence length, micro-batch, attention) training measurement."""
    from drafttrain.drafters import build_drafter

    row = {"recipe": name, "seq": seq, "micro_batch": mbs, "attention": attention}
    dr = None
    try:
        torch.manual_seed(0)
        dr = build_drafter(name, dict(RECIPES[name], init_from_target_layer=False), target)
        dr.set_attention(attention, device=device)
        dr.train()
        opt = torch.optim.AdamW([p for p in dr.parameters() if p.requires_grad], lr=1e-4)
        v = target.config.vocab_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, v, (mbs, seq), generator=g).to(device)
        loss_mask = torch.ones_like(ids)
        loss_mask[:, : seq // 8] = 0
        lengths = torch.full((mbs,), seq, device=device)
        layers = tuple(dr.feature_layers)
        n_target = sum(p.numel() for p in target.model.parameters())
        n_drafter = sum(p.numel() for p in dr.parameters() if p.requires_grad)

        def step():
            with torch.no_grad():
                feats = target.forward(ids, with_logits=False, feature_layers=layers).features[:, :-1]
            batch = {"input_ids": ids, "loss_mask": loss_mask, "lengths": lengths, "features": feats}
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=not dry):
                out = dr.training_loss(batch, torch.Generator().manual_seed(0))
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out

        out = step()  # warm-up: compiles flex, allocates
        row["loss"] = float(out.loss.detach())
        row["drafter_tokens"] = int(out.num_tokens)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        st = statistics.median(times)
        tokens = mbs * seq
        flops = (2 * n_target + 6 * n_drafter) * tokens
        peak = next((p for k, p in BF16_PEAK.items() if device.startswith("cuda") and k in torch.cuda.get_device_name()), None)
        row.update(
            step_s=None if dry else round(st, 4),
            tokens_per_s=None if dry else round(tokens / st, 1),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None,
            mfu=None if dry or peak is None else round(flops / st / peak, 4),
            drafter_params=n_drafter, status="ok")  # fmt: skip
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    except NotImplementedError as err:  # flex backward where the platform has none
        row["status"] = f"unsupported: {err}"
    finally:
        del dr
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def decode_point(target, batch: int, prompt_len: int, new_tokens: int, device: str, dry: bool) -> dict:
    """Plain greedy decoding of ``batch`` equal-length random prompts: our engine vs HF ``generate``."""
    from drafttrain.generation.engine import engine_generate

    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, target.config.vocab_size, (batch, prompt_len), generator=g)
    row = {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens}
    res = {}
    for name in ("engine", "hf"):
        for rep in range(2):  # the first run warms up
            _sync(device)
            t0 = time.perf_counter()
            if name == "engine":
                outs = engine_generate(target, prompts.tolist(), new_tokens, stop_token_ids=-1, return_features=False,
                                       batch_size=batch)  # fmt: skip
                toks = [o["tokens"][prompt_len:] for o in outs]
            else:
                with torch.no_grad():
                    gen = target.model.generate(prompts.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
                toks = gen[:, prompt_len:].tolist()
            _sync(device)
            dt = time.perf_counter() - t0
        res[name] = (toks, dt)
    (te, de), (th, dh) = res["engine"], res["hf"]
    row.update(engine_tokens_per_s=None if dry else round(batch * new_tokens / de, 1),
               hf_tokens_per_s=None if dry else round(batch * new_tokens / dh, 1),
               greedy_equal_rows=sum(a == b for a, b in zip(te, th)), rows=batch)  # fmt: skip
    return row


def markdown(result: dict, command: str) -> str:
    env = result["environment"]
    lines = ["# GPU check (training and decoding with a Llama-3.1-8B-shaped target)", "",
             f"Device: {env['device_name']}; torch {env['torch']}, transformers {env['transformers']}; target "
             f"{result['target']['shape']} with random bf16 weights ({result['target']['params'] / 1e9:.2f} B parameters). "
             + ("**Dry run on the CPU: tiny shapes, no timings.**" if result["dry_run"] else ""), "",
             "## Training", "",
             "| recipe | seq | micro-batch | attention | status | step (s) | tokens/s | peak GiB | MFU |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["training"]:
        lines.append(f"| {r['recipe']} | {r['seq']} | {r['micro_batch']} | {r['attention']} | {r['status']} | "
                     f"{r.get('step_s')} | {r.get('tokens_per_s')} | {r.get('peak_gib')} | {r.get('mfu')} |")  # fmt: skip
    lines += ["", "MFU = (2 N_target + 6 N_drafter) x tokens / step time / the GPU's dense bf16 peak; attention FLOPs "
              "are not counted.", "", "## Decoding (plain greedy)", "",
              "| batch | new tokens | engine tokens/s | HF generate tokens/s | greedy-equal rows |", "|---|---|---|---|---|"]
    for r in result["decoding"]:
        lines.append(f"| {r['batch']} | {r['new_tokens']} | {r['engine_tokens_per_s']} | {r['hf_tokens_per_s']} | "
                     f"{r['greedy_equal_rows']}/{r['rows']} |")
    lines += ["", f"Tests (`pytest -m cuda`): {result.get('tests', 'not run')}", "", "Reproduce:", "", "```bash", command, "```", ""]
    return "\n".join(lines)


@dataclass
class DeviceCheckConfig:
    """``python -m scripts.device_check`` (scripts/device_check.sh runs it after the CUDA tests)."""

    out: str = "device_check_out"  # folder for gpu.json and gpu.md
    dry_run: bool = False  # the same steps on the CPU, tiny shapes, no timings (CI)
    steps: int = 3  # timed training steps per point (median), after a warm-up
    seqs: str = "2048,4096"  # training sequence lengths, comma-separated
    micro_batches: str = "1,2,4"  # micro-batch sizes, comma-separated
    budget_s: float = 330.0  # stop starting training points after this many seconds
    tests: str = "not run"  # the CUDA tests' summary line (device_check.sh passes it)


def main(argv: list[str] | None = None) -> dict:
    import transformers

    from drafttrain.cliconfig import parse_cli

    a = parse_cli(DeviceCheckConfig, argv)
    dry = a.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run on a CPU machine)")
    shape = TINY if dry else LLAMA_8B
    target = build_target(shape, device, torch.float32 if dry else torch.bfloat16)
    seqs = [32] if dry else [int(s) for s in a.seqs.split(",")]
    mbs_list = [1, 2] if dry else [int(m) for m in a.micro_batches.split(",")]
    modes = ["dense"] if dry else ["dense", "flex"]
    t_start = time.time()
    training = []
    for name in RECIPES:
        for seq in seqs:
            for mbs in mbs_list:
                for mode in modes:
                    if time.time() - t_start > a.budget_s:
                        training.append({"recipe": name, "seq": seq, "micro_batch": mbs, "attention": mode,
                                         "status": "skipped (time budget)"})  # fmt: skip
                        continue
                    training.append(train_point(target, name, seq, mbs, mode, 1 if dry else a.steps, device, dry))
                    print(json.dumps(training[-1]), flush=True)
    decoding = [decode_point(target, b, 16 if dry else 128, 4 if dry else 64, device, dry) for b in (1, 16)]
    for r in decoding:
        print(json.dumps(r), flush=True)
    result = {
        "dry_run": dry,
        "environment": {"device_name": torch.cuda.get_device_name() if not dry else f"CPU ({platform.processor() or platform.machine()})",
                        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "target": {"shape": "tiny Llama (d=64, 2 layers)" if dry else "Llama-3.1-8B (d=4096, 32 layers, GQA 32/8, vocab 128256)",
                   "params": sum(p.numel() for p in target.model.parameters()), "dtype": "fp32" if dry else "bf16"},
        "training": training, "decoding": decoding, "tests": a.tests,
    }  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "bash scripts/device_check.sh" + (" --dry-run" if dry else "") + " --out OUT_DIR"
    (out / "gpu.json").write_text(json.dumps({**result, "command": command}, indent=1))
    (out / "gpu.md").write_text(markdown(result, command))
    print(f"wrote {out / 'gpu.json'} and {out / 'gpu.md'}")
    return result


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
