"""What a verified step costs on a target with recurrent layers, against a plain step, beside an attention-only target.

    python -m scripts.bench_hybrid_verify

Two random-weight targets of one size (``hidden_size`` / ``layers``: SmolLM2-135M's scale by default; no hybrid
checkpoint ships in a package here, and the cost of a step does not depend on the weights): a Qwen3.5 (three gated
delta-net layers then one full-attention layer, repeated) and a Qwen3 (every layer attention, the same widths).
Each decodes ``context``-token prompts at batch ``b`` through the engine; after a warm-up the same step is timed in
rounds, every variant once per round (lock-step, so a host whose speed drifts moves them together), the minimum
per variant reported:

- ``plain``: a decoding step, one input per row (no drafts);
- ``all_accepted``: a chain of K drafts, every one the target's own token (the forward's state is exact: no replay);
- ``accepted_<n>``: the same chain with draft n + 1 wrong: n of K accepted, the snapshot kept and the n + 1
  committed tokens replayed (recurrent target only; the attention-only target overwrites the rejected slots).

Drafting is free (scripted chains): this is the verifier's cost alone. Writes ``<out>.json`` / ``.md``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch


@dataclass
class BenchHybridVerifyConfig:
    """Schema of ``python -m scripts.bench_hybrid_verify`` (key=value overrides)."""

    hidden_size: int = 576
    layers: int = 24
    heads: int = 9
    kv_heads: int = 3
    intermediate_size: int = 1536
    vocab_size: int = 49152
    draft_tokens: int = 4  # K
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    context: int = 128  # prompt tokens per row
    rounds: int = 7
    threads: int = 2
    out: str = "docs/benchmarks/hybrid_verify"


class _Script:
    """Drafts the chain it was given for every row each step (the caller swaps it between timed steps)."""

    name = "scripted"

    def __init__(self):
        self.chains: dict[int, list[int]] = {}

    def start(self, *a):
        pass

    def draft(self, slots, sampling=None, generator=None):
        from drafttrain.verify.tree import DraftTree

        return [DraftTree.chain(self.chains[s]) if self.chains.get(s) else DraftTree.empty() for s in slots]

    def commit(self, *a):
        pass

    def release(self, *a):
        pass


def _targets(c: BenchHybridVerifyConfig):
    import transformers

    from drafttrain.target import Target

    common = dict(hidden_size=c.hidden_size, num_hidden_layers=c.layers, num_attention_heads=c.heads,
                  num_key_value_heads=c.kv_heads, head_dim=c.hidden_size // c.heads, intermediate_size=c.intermediate_size,
                  vocab_size=c.vocab_size, max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    hybrid = transformers.Qwen3_5TextConfig(**common, linear_num_key_heads=c.heads // 3 or 1,
                                            linear_num_value_heads=c.heads, linear_key_head_dim=64,
                                            linear_value_head_dim=64,
                                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (c.layers // 4))  # fmt: skip
    dense = transformers.Qwen3Config(**common)
    out = {}
    for name, cfg, cls in (("Qwen3.5 (gated delta-net 3:1 attention)", hybrid, transformers.Qwen3_5ForCausalLM),
                           ("Qwen3 (attention only)", dense, transformers.Qwen3ForCausalLM)):  # fmt: skip
        torch.manual_seed(0)
        cfg.architectures = [cls.__name__]
        model = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
        out[name] = Target(model)
    return out


def _step_time(engine, script, chains) -> float:
    """Time one engine step with ``chains`` (row slot -> draft chain) on a fresh copy of the engine's state is not
    possible cheaply, so the step runs on the live engine: the caller keeps the sequences long enough."""
    script.chains = chains
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def bench(c: BenchHybridVerifyConfig) -> dict:
    from drafttrain.target.families import recurrent_layers_text  # noqa: F401  (the target's kinds are read below)
    from drafttrain.compose import Run

    torch.set_num_threads(c.threads)
    rows = []
    for tname, target in _targets(c).items():
        recurrent = target.recurrent
        kinds = sorted({k.kind for k in target.cache_layout})
        for b in c.batch_sizes:
            g = torch.Generator().manual_seed(b)
            prompts = [torch.randint(3, c.vocab_size - 1, (c.context,), generator=g).tolist() for _ in range(b)]
            # the target's own continuation (plain engine) gives the right drafts
            n_new = 4 + c.rounds * (c.draft_tokens + 2) * (c.draft_tokens + 2)
            plain = Run(target).engine(_Script(), batch_size=b, max_new_tokens=n_new, stop_token_ids=[]).run(prompts)
            refs = [r.tokens for r in plain.results]
            script = _Script()
            eng = Run(target).engine(script, batch_size=b, max_new_tokens=n_new, stop_token_ids=[])
            eng.submit(prompts)
            eng.admit()
            variants = ["plain", "all_accepted"] + [f"accepted_{n}" for n in range(c.draft_tokens)]
            times: dict[str, list[float]] = {v: [] for v in variants}
            replays: dict[str, int] = {v: 0 for v in variants}
            for rnd in range(c.rounds + 1):  # round 0 is the warm-up
                for v in variants:
                    chains = {}
                    for seq in [s for s in eng.rows if s is not None]:
                        done = len(seq.generated)  # tokens emitted so far; the next root is refs[done - 1]
                        want = refs[seq.index][done : done + c.draft_tokens]
                        if v == "plain" or len(want) < c.draft_tokens:
                            chains[seq.slot] = []
                        elif v == "all_accepted":
                            chains[seq.slot] = want
                        else:
                            n = int(v.split("_")[1])
                            chains[seq.slot] = want[:n] + [(want[n] + 1) % c.vocab_size] + want[n + 1 :]
                    r0 = eng.stats.replay_forwards
                    dt = _step_time(eng, script, chains)
                    if rnd:
                        times[v].append(dt)
                        replays[v] += eng.stats.replay_forwards - r0
            plain_ms = min(times["plain"]) * 1e3
            for v in variants:
                ms = min(times[v]) * 1e3
                rows.append({"target": tname, "layer_kinds": kinds, "batch": b, "variant": v, "ms": ms,
                             "median_ms": sorted(times[v])[len(times[v]) // 2] * 1e3,
                             "all_ms": [round(t * 1e3, 1) for t in times[v]],
                             "vs_plain": ms / plain_ms, "replay_forwards_per_step": replays[v] / c.rounds,
                             "recurrent": recurrent})  # fmt: skip
                print(f"{tname:40s} b={b} {v:13s} {ms:8.1f} ms  {ms / plain_ms:5.2f}x plain", flush=True)
    return {"rows": rows}


def markdown(res: dict, cmd: str, analysis: str) -> str:
    from scripts.common import machine_line

    c = res["config"]
    out = ["# A verified step on a target with recurrent layers, against a plain step", "",
           f"`{cmd}` ({machine_line(res['machine'])}, {res['date']}). Random-weight targets of {c['layers']} layers, "
           f"d = {c['hidden_size']}, {c['heads']} heads ({c['kv_heads']} key/value), vocabulary {c['vocab_size']}, "
           f"fp32, {c['context']}-token prompts, K = {c['draft_tokens']} drafts per chain; the minimum over "
           f"{c['rounds']} lock-step rounds of each variant (drafting not counted).", "", analysis, "",
           "| target | batch | step | ms (min) | ms (median) | x plain step (min) | replay forwards per step |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["rows"]:
        out.append(f"| {r['target']} | {r['batch']} | {r['variant']} | {r['ms']:.1f} | {r['median_ms']:.1f} | "
                   f"{r['vs_plain']:.2f} | {r['replay_forwards_per_step']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchHybridVerifyConfig, bench, markdown, "bench_hybrid_verify", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
