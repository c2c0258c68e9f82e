"""The online planner's variants side by side on a trained run (speculation that never loses).

    python -m scripts.bench_planner run=outputs/parallelspec-smollm2-135m-instruct

The run's evaluation prompts, tree and SSSD candidates (``trainer.spec_eval``; ``sssd`` overrides the
source) decoded by the bundled engine at each batch size in ``batch_sizes`` (batch 1: the first
``b1_prompts`` prompts), once with plain decoding and once per planner variant
(:class:`~drafttrain.verify.planner.SpeculationPlanner`):

- ``mixed``: one calibration for every node source, a step priced by its forward and drafting time
  only, whether to draft decided by the prediction alone;
- ``per_source``: ``mixed`` with each node source (drafter, SSSD, both) calibrated on its own;
- ``full``: ``per_source`` with each step's measured overhead in its price;
- ``tree``: no planner, the whole tree verified every step (the reference the planner must beat);
- ``fixed_speed``: the default planner whose forward-cost model keeps each size at the time it was
  measured (the default follows the host's speed);
- ``realized``: ``full`` where the measured rates (drafting steps' tokens/s against plain steps') decide
  whether to keep drafting once enough are seen: the default planner;
- ``never``: the default planner that never drafts (its plain-first steps outlast the run): every step is
  a plain step of the planned engine, so its speedup is what keeping the drafter ready costs (the target's
  feature layers the drafter reads returned every step, the commits held for its catch-up, the planner's
  bookkeeping), the floor under any planner that drafts on this engine;
- ``every_row``: the default planner whose probe drafts every row (``probe_rows`` unbounded: the planner
  before probes; at batch 16 its first drafting runs the drafter over all 16 prompts).

Runs are interleaved so that a drifting machine hits every variant alike (this host's speed moves by
10-15% within a minute, so whole runs minutes apart compare badly): by default (``interleave=step``)
plain decoding and every variant advance in lock-step, one decoding step each in turn, the order
rotating from step to step (:func:`drafttrain.eval.driver.run_interleaved`); ``interleave=prompt``
decodes each prompt by every run in turn at batch 1 (whole runs at larger batches), ``run`` one run
after the other (plain, variants..., the reverse order in the next round); each speedup is the variant's tokens/s over the plain run's of the
same round, and the table reports the median over ``rounds``. Every output is compared token for token
with plain decoding (a difference is re-checked against single-sequence greedy decoding, as the
training evaluation does).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from drafttrain.config import TargetConfig

# Each variant is the one the module doc builds it on plus its change; `realized` is SpeculationPlanner()'s defaults.
_FULL = {"realized": False}
VARIANTS = {
    "mixed": {**_FULL, "per_source": False, "price_overhead": False},
    "per_source": {**_FULL, "price_overhead": False},
    "full": _FULL,
    "fixed_speed": {"drift": False},
    "realized": {},  # the default SpeculationPlanner
    "never": {"plain_first": 10**9},  # the default planner that never drafts: what keeping the drafter ready costs
    "every_row": {"probe_rows": 10**9},  # the default planner whose probe drafts every row (the planner before probes)
}


@dataclass
class BenchPlannerConfig:
    """Schema of ``python -m scripts.bench_planner`` (key=value overrides, validated before any work)."""

    run: str = "outputs/parallelspec-smollm2-135m-instruct"  # a finished training run (drafter/ + config.json)
    target: TargetConfig = field(default_factory=TargetConfig)  # the run's target (default SmolLM2; target.* keys)
    sssd: str | None = None  # none | input | data; null = the run's trainer.spec_eval.sssd.source
    nodes: int | None = None  # SSSD-only nodes per tree; null = the run's
    variants: list[str] = field(default_factory=lambda: ["full", "realized"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16])
    b1_prompts: int = 4  # batch 1 decodes the first prompts only (a batch-1 run is ~16x slower per token)
    num_prompts: int | None = None  # null = the run's trainer.spec_eval.num_prompts (0 in budget runs: set it)
    max_new_tokens: int | None = None  # null = the run's
    rounds: int = 2
    interleave: str = "step"  # step: plain and every variant advance in lock-step | prompt: at batch 1, each prompt in turn | run: one engine run each
    out: str = "docs/benchmarks/planner"


def bench(cfg: BenchPlannerConfig) -> dict:
    from drafttrain.config import ConfigError
    from drafttrain.validation import validate
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids
    from drafttrain.eval.driver import plain_greedy, run_interleaved
    from drafttrain.compose import build_run
    from drafttrain.eval.in_training import sssd_for_eval
    from drafttrain.compose import Run
    from drafttrain.verify.planner import PlannedProposer, SpeculationPlanner
    from drafttrain.verify.proposers import PlainProposer, proposer_for
    from scripts.common import load_run_config, run_train_data

    if bad := sorted(set(cfg.variants) - set(VARIANTS) - {"tree"}):
        raise ConfigError(f"variants: unknown {bad}; choose from {sorted(VARIANTS) + ['tree']}")
    if cfg.interleave not in ("step", "prompt", "run"):
        raise ConfigError(f"interleave must be step, prompt or run, got {cfg.interleave!r}")
    if cfg.sssd not in (None, "none", "input", "data"):
        raise ConfigError(f"sssd must be none, input or data, got {cfg.sssd!r}")
    if cfg.rounds < 1 or cfg.b1_prompts < 1 or not cfg.batch_sizes or min(cfg.batch_sizes) < 1:
        raise ConfigError("rounds, b1_prompts and every batch size must be >= 1")
    saved = load_run_config(cfg.run)
    sssd_d = saved.setdefault("trainer", {}).setdefault("spec_eval", {}).setdefault("sssd", {})
    if cfg.sssd is not None:
        sssd_d["source"] = cfg.sssd
    if cfg.nodes is not None:
        sssd_d["nodes"] = cfg.nodes
    c = validate(saved)
    se = c.trainer.spec_eval
    built = build_run(cfg, drafter=cfg.run)  # the run's drafter, packed like its target
    target, drafter = built.target, built.drafter
    sssd = sssd_for_eval(c, run_train_data(c, target) if se.sssd.source == "data" else None)
    rows = load_eval_prompts(se.prompts, limit=cfg.num_prompts or se.num_prompts, offset=se.prompt_offset,
                             stride=se.prompt_stride)  # fmt: skip
    prompts = [prompt_ids(target.tokenizer, r["messages"]) for r in rows]
    if not prompts:
        raise ConfigError(f"no prompts: the run's trainer.spec_eval.num_prompts is {se.num_prompts}; set num_prompts=N")
    max_new = cfg.max_new_tokens or se.max_new_tokens
    stop = target.eos_token_id

    def engine(name: str, bs: int):
        if name == "plain":
            prop = PlainProposer()
        else:
            prop = proposer_for(drafter, widths=se.tree.widths, budget=se.tree.budget, sssd=sssd, sssd_nodes=se.sssd.nodes)
            if name != "tree":
                prop = PlannedProposer(prop, SpeculationPlanner(**VARIANTS[name]))
        return Run(target).engine(prop, batch_size=bs, max_new_tokens=max_new, mode="unpadded", stop_token_ids=stop)

    results = []
    for bs in cfg.batch_sizes:
        ps = prompts if bs > 1 else prompts[: cfg.b1_prompts]
        names = ["plain", *cfg.variants]
        per = {n: [] for n in names}
        reference = None
        for r in range(cfg.rounds):
            order = names if r % 2 == 0 else names[::-1]
            # a fresh engine (proposer, planner) per run and round, interleaved by step, prompt or run
            engines = {name: engine(name, bs) for name in order}
            unit = "run" if cfg.interleave == "prompt" and bs > 1 else cfg.interleave
            runs = run_interleaved(engines, ps, unit=unit, rotate=True)
            for name in order:
                run, st = runs[name], runs[name].stats
                outputs = [x.tokens for x in run.results]
                if name == "plain" and reference is None:
                    reference = outputs
                prop = engines[name].proposer
                rec = {"tokens_per_s": st.tokens_per_s, "decode_tokens_per_s": st.decode_tokens_per_s,
                       "seconds": round(st.seconds, 2), "tau": st.tau,
                       "nodes_per_step": st.tree_nodes / max(st.seq_steps, 1), "outputs": outputs,
                       "planner": prop.planner.summary() if isinstance(prop, PlannedProposer) else None}  # fmt: skip
                per[name].append(rec)
                print(json.dumps({"batch": bs, "round": r, "run": name, "tokens_per_s": round(rec["tokens_per_s"], 2),
                                  "tau": round(rec["tau"], 3)}), flush=True)  # fmt: skip
        for name in cfg.variants:
            mism = set()
            for rec in per[name]:
                for i, (a, b) in enumerate(zip(rec["outputs"], reference)):
                    if a != b and a != plain_greedy(target, ps[i], max_new, stop)[0]:
                        mism.add(i)
            ratios = [v["tokens_per_s"] / p["tokens_per_s"] for v, p in zip(per[name], per["plain"])]
            decode = [v["decode_tokens_per_s"] / p["decode_tokens_per_s"] for v, p in zip(per[name], per["plain"])]
            last = per[name][-1]
            results.append({
                "batch_size": bs, "variant": name, "prompts": len(ps),
                "speedup_median": statistics.median(ratios), "speedups": [round(x, 3) for x in ratios],
                "decode_speedup_median": statistics.median(decode), "decode_speedups": [round(x, 3) for x in decode],
                "tokens_per_s": statistics.median(v["tokens_per_s"] for v in per[name]),
                "plain_tokens_per_s": statistics.median(p["tokens_per_s"] for p in per["plain"]),
                "tau": statistics.median(v["tau"] for v in per[name]),
                "nodes_per_step": statistics.median(v["nodes_per_step"] for v in per[name]),
                "greedy_equal": not mism, "mismatches": sorted(mism), "planner_last_round": last["planner"],
            })  # fmt: skip
    return {"rows": results, "run": cfg.run, "sssd": f"{se.sssd.source}, {se.sssd.nodes} nodes",
            "tree": f"widths {se.tree.widths} budget {se.tree.budget}", "prompts": f"{se.prompts} ids {','.join(r['id'] for r in rows)}",
            "max_new_tokens": max_new}  # fmt: skip


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    lines = ["# The online planner: variants side by side", "",
             f"Measured {res['date']}: {machine_line(res.get('machine'))}, 1-minute load "
             f"average {res['machine']['loadavg_1min']} at the start.", "",
             f"Run `{res['run']}`, tree {res['tree']}, SSSD candidates: {res['sssd']}; prompts {res['prompts']} "
             f"(batch 1: the first ones), {res['max_new_tokens']} new tokens, greedy. Speedup = the variant's tokens/s over "
             f"plain decoding's in the same round (median over {res['config']['rounds']} interleaved rounds); "
             "`mixed` = one calibration for every node source, a step priced by forward + drafting only, whether to "
             "draft decided by the prediction alone; `per_source` = `mixed` with each source calibrated on its own; "
             "`full` = `per_source` with each step's measured overhead priced in; `tree` = no planner, the whole tree "
             "verified every step; `fixed_speed` = the default planner whose forward-cost model keeps each size at the "
             "time it was measured; `realized` = `full` where the measured rates (drafting steps' tokens/s against "
             "plain steps') decide whether to keep drafting (the default planner); `never` = the default planner that never "
             "drafts: what keeping the drafter ready costs; `every_row` = the default planner whose probe drafts every "
             "row (the planner before probes). "
             "Decoding steps alone = the same ratio with the prompt forwards (the same in every run) left "
             "out of both runs' time and their first tokens out of their counts (`EngineStats.decode_tokens_per_s`).", "",
             "| batch | variant | prompts | speedup (median) | speedup per round | decoding steps alone: speedup (median) | per round | tokens/s | plain tokens/s | τ | nodes / step | skipped drafting | overhead ms (plain / tree) | greedy-equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["rows"]:
        pl = r["planner_last_round"] or {}
        skipped = f"{pl.get('skipped_drafting', 0)}/{pl.get('steps', 0)}"
        oh = pl.get("overhead_ms", {})
        b = r["batch_size"]
        ovh = f"{oh.get(f'b{b}_plain', '')} / {oh.get(f'b{b}_drafted', '')}"
        dec = r.get("decode_speedups")  # absent from results written before the metric
        dec_cols = f"{r['decode_speedup_median']:.3f}x | {', '.join(f'{x:.3f}' for x in dec)}" if dec else "n/a | n/a"
        lines.append(f"| {b} | {r['variant']} | {r['prompts']} | **{r['speedup_median']:.2f}x** | "
                     f"{', '.join(f'{x:.2f}' for x in r['speedups'])} | {dec_cols} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                     f"{r['tau']:.3f} | {r['nodes_per_step']:.2f} | {skipped} | {ovh} | {r['greedy_equal']} |")  # fmt: skip
    lines += ["", "Reproduce (from the repository root, after a training run):", "", "```bash", command, "```", "", analysis, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchPlannerConfig, bench, markdown, "bench_planner", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
