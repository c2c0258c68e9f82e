"""Greedy and sampled decoding side by side, for every recipe and for the lossy methods.

    python -m scripts.bench_sampling                      # after training one run per recipe (below)

One harness run (:func:`drafttrain.eval.harness.evaluate`, batch 1, the drafter's own proposer with a
chain and the online planner) per (drafter, decoding), each timing plain decoding of the same prompts
beside it in the same engine, so every speedup is a side-by-side ratio:

- every recipe's drafter (``<runs>/<recipe>``; the parallelspec row falls back to ``main_run``, the
  README's main job) under greedy decoding and under sampling at ``temperature`` / ``top_p`` (0.7 / 0.9,
  fixed seed);
- the lossy methods on the parallelspec drafter: MTAD (joint-likelihood acceptance) under greedy and
  with the paper's warping, top-k 20 then top-p 0.9 (MTAD App. F), at ``temperature``; improved MCSD
  (W_t = 1 lossless, W_t = 2 target-initialised, lossy) under greedy and at T = 0.7 without top-p (the
  paper's setting, MCSD-improved §4).

Every run reports τ (tokens per verification step), tokens/s, the speedup over plain decoding and the
output perplexity under the target (MTAD Eq. 1, teacher-forced), beside plain decoding's perplexity
under the same distribution: a lossless method's outputs are samples of the same distribution, so
their perplexity differs from plain sampling's only by noise; a lossy method's shift is what it costs.
Under greedy decoding every lossless run is also compared token for token with plain greedy.

Train the runs first (each resumable; 300 steps of the main job's self-distilled data, which the first
run generates and the others reuse)::

    for r in medusa eagle parallelspec_eagle eagle3 parallelspec_eagle3; do
      accelerate launch --config_file conf/accelerate/cpu.yaml train.py +recipe=$r trainer.max_steps=300 \\
        trainer.max_minutes=7 trainer.eval_every=0 trainer.spec_eval.num_prompts=0 output_dir=outputs/sampling/$r
    done

Each harness run is kept under ``cache_dir`` (JSON): an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from drafttrain.config import ConfigError

RECIPES = ["parallelspec", "parallelspec_eagle", "medusa", "eagle", "eagle3", "parallelspec_eagle3"]


@dataclass
class BenchSamplingConfig:
    """Schema of ``python -m scripts.bench_sampling`` (key=value overrides, validated before any work)."""

    runs: str = "outputs/sampling"  # one training run per recipe: <runs>/<recipe>/drafter
    recipes: list[str] = field(default_factory=lambda: list(RECIPES))
    main_run: str | None = "outputs/parallelspec-smollm2-135m-instruct"  # parallelspec when <runs>/parallelspec is absent
    lossy: bool = True  # also MTAD and MCSD on the parallelspec drafter
    prompts: str = "mt_bench"
    num_prompts: int = 8
    prompt_stride: int = 10  # MT-bench: one question from each of its 8 categories
    max_new_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 0.9
    mtad_top_k: int = 20  # MTAD App. F: top-k 20, then top-p
    seed: int = 0
    # the noise of a sampled perplexity: plain + the parallelspec drafter at temperature/top_p, once per extra seed
    noise_seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    threads: int | None = None
    overrides: list[str] = field(default_factory=list)  # more harness overrides for every run (e.g. target=tiny)
    cache_dir: str = "outputs/bench_sampling"  # one results JSON per harness run (resume)
    out: str = "docs/benchmarks/sampling"


def _checkpoint(cfg: BenchSamplingConfig, recipe: str) -> str | None:
    run = Path(cfg.runs) / recipe
    if (run / "drafter").is_dir():
        return str(run)
    if recipe == "parallelspec" and cfg.main_run and (Path(cfg.main_run) / "drafter").is_dir():
        return cfg.main_run
    return None


def jobs(cfg: BenchSamplingConfig) -> list[dict]:
    """Every harness run of the benchmark: ``{"key", "row", "checkpoint", "methods", "decoding", "sampling": {...}}``.

    Raises:
        ConfigError: an unknown recipe, or no drafter at all.
    """
    bad = sorted(set(cfg.recipes) - set(RECIPES))
    if bad:
        raise ConfigError(f"unknown recipe(s) {bad}; choose from {RECIPES}")
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    sampled = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    out = []
    for recipe in cfg.recipes:
        ckpt = _checkpoint(cfg, recipe)
        if ckpt is None:
            print(f"skipping {recipe}: no drafter under {cfg.runs}/{recipe}", flush=True)
            continue
        for name, s in (("greedy", greedy), ("sampled", sampled)):
            out.append({"key": f"{recipe}-{name}", "row": recipe, "checkpoint": ckpt, "methods": ["drafter"],
                        "decoding": name, "sampling": s})  # fmt: skip
    ps = _checkpoint(cfg, "parallelspec")
    if cfg.lossy and ps is not None:
        out += [
            {"key": "lossy-greedy", "row": "parallelspec", "checkpoint": ps, "methods": ["mtad", "mcsd"],
             "decoding": "greedy", "sampling": greedy},
            {"key": "mtad-warped", "row": "parallelspec", "checkpoint": ps, "methods": ["mtad"],
             "decoding": "mtad_warp", "sampling": {**sampled, "top_k": cfg.mtad_top_k}},
            {"key": "mcsd-sampled", "row": "parallelspec", "checkpoint": ps, "methods": ["mcsd"],
             "decoding": "mcsd_T", "sampling": {"temperature": cfg.temperature, "top_p": 1.0, "top_k": 0}},
        ]  # fmt: skip
    for seed in cfg.noise_seeds if ps is not None else []:
        out.append({"key": f"noise-seed{seed}", "row": "parallelspec", "checkpoint": ps, "methods": ["drafter"],
                    "decoding": "sampled", "sampling": sampled, "seed": seed, "noise": True})  # fmt: skip
    if not out:
        raise ConfigError(f"no drafter found under {cfg.runs} (nor main_run={cfg.main_run}): train the runs first")
    return out


def _overrides(cfg: BenchSamplingConfig, job: dict) -> list[str]:
    s = job["sampling"]
    o = [f"checkpoint={job['checkpoint']}", f"methods=[{','.join(job['methods'])}]", f"prompts={cfg.prompts}",
         f"num_prompts={cfg.num_prompts}", f"prompt_stride={cfg.prompt_stride}", f"max_new_tokens={cfg.max_new_tokens}",
         "batch_sizes=[1]", "modes=[unpadded]", "perplexity=true", f"seed={job.get('seed', cfg.seed)}", f"temperature={s['temperature']}",
         f"top_p={s['top_p']}", f"top_k={s['top_k']}", f"output_dir={Path(cfg.cache_dir) / job['key']}", "plots=false",
         "progress=false"]  # fmt: skip
    return o + ([f"num_threads={cfg.threads}"] if cfg.threads else []) + list(cfg.overrides)


def _rows(job: dict, results: dict) -> list[dict]:
    plain = next(r for r in results["runs"] if r["method"] == "plain")
    rows = []
    for r in results["runs"]:
        if r["method"] == "plain":
            continue
        rows.append({"row": job["row"], "method": r["method"], "decoding": job["decoding"], **job["sampling"],
                     "tau": r["tau"], "speedup": r["speedup"], "nodes_per_step": r["mean_tree_nodes"],
                     "depth1_acceptance": r["depth_acceptance"].get("1", r["depth_acceptance"].get(1)),
                     "tokens_per_s": r["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
                     "perplexity": r.get("perplexity"),
                     "plain_perplexity": plain.get("perplexity"), "lossless": r["lossless"],
                     "greedy_equal": r.get("greedy_equal"), "generated_tokens": r["generated_tokens"],
                     "drafter": results["drafter"]["name"], "checkpoint": job["checkpoint"]})  # fmt: skip
    return rows


def bench(cfg: BenchSamplingConfig) -> dict:
    from scripts.common import cached, run_eval

    todo = jobs(cfg)
    rows, noise, prompts = [], [], None
    for i, job in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {job['key']}: {job['methods']} {job['sampling']}", flush=True)
        res = cached(Path(cfg.cache_dir) / f"{job['key']}.json", lambda job=job: run_eval(_overrides(cfg, job)))
        prompts = res["prompts"]["ids"]
        if job.get("noise"):
            noise += [{**r, "seed": job["seed"]} for r in _rows(job, res)]
            continue
        for row in _rows(job, res):
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("row", "method", "decoding", "tau", "speedup", "perplexity",
                                                  "plain_perplexity")}), flush=True)  # fmt: skip
    if noise:  # seed cfg.seed's run is the table's row
        noise = [{**r, "seed": cfg.seed} for r in rows if r["decoding"] == "sampled" and r["row"] == "parallelspec"] + noise
    return {"rows": rows, "noise": noise, "prompts": prompts, "prompt_set": cfg.prompts, "max_new_tokens": cfg.max_new_tokens}


DECODING = {
    "greedy": "greedy",
    "sampled": "T {temperature}, top-p {top_p}",
    "mtad_warp": "T {temperature}, top-k {top_k}, top-p {top_p}",
    "mcsd_T": "T {temperature}",
}


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    def f(x, d=3):
        return "" if x is None else f"{x:.{d}f}"

    lines = ["# Greedy and sampled decoding: τ, speedup and output perplexity per recipe and lossy method", "",
             f"Measured {res['date']}: {machine_line(res.get('machine'))}, 1-minute load "
             f"average {res['machine']['loadavg_1min']} at the start. Prompts: {res['prompt_set']} {', '.join(map(str, res['prompts'] or []))} "
             f"(one per category), {res['max_new_tokens']} new tokens, batch 1, seed {res['config']['seed']}.", "",
             "Each row is one speculative run beside plain decoding of the same prompts under the same distribution, "
             "in the same process (speedup = its tokens/s over plain's). τ = tokens emitted per verification step "
             "(the online planner verifies only the draft tokens expected to pay for their cost, none in many steps: "
             "draft nodes / step is what it verified on average); depth-1 acceptance = the fraction of verified "
             "first draft tokens the target accepted. Perplexity = exp(mean -log p) of the outputs under "
             "the target (MTAD Eq. 1); plain = plain decoding's outputs under the same decoding settings. Lossless "
             "rows sample the same distribution as plain decoding, so their perplexity differs from plain's by "
             "noise only (8 prompts x 64 tokens: a few percent); under greedy they are also checked token for "
             "token (greedy-equal).", "",
             "| drafter / method | decoding | lossless | τ | draft nodes / step | depth-1 acceptance | speedup b1 | tok/s (plain) | perplexity | plain perplexity | greedy-equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["rows"]:
        label = r["row"] if r["method"] == r["drafter"] else f"{r['method']} ({r['row']} drafter)"
        dec = DECODING[r["decoding"]].format(**r)
        eq = "" if r["greedy_equal"] is None else ("yes" if r["greedy_equal"] else "no")
        lines.append(f"| {label} | {dec} | {'yes' if r['lossless'] else '**no**'} | {f(r['tau'])} | {f(r['nodes_per_step'], 2)} | "
                     f"{f(r.get('depth1_acceptance'), 2)} | {f(r['speedup'], 2)}x | "
                     f"{f(r['tokens_per_s'], 1)} ({f(r['plain_tokens_per_s'], 1)}) | {f(r['perplexity'], 2)} | "
                     f"{f(r['plain_perplexity'], 2)} | {eq} |")  # fmt: skip
    if res.get("noise"):
        import statistics

        lines += ["", "How much a sampled perplexity moves from seed to seed (plain decoding and the parallelspec "
                  "drafter, same prompts and settings, one run per seed):", "",
                  "| seed | plain perplexity | parallelspec perplexity | τ |", "|---|---|---|---|"]  # fmt: skip
        for r in res["noise"]:
            lines.append(f"| {r['seed']} | {f(r['plain_perplexity'], 2)} | {f(r['perplexity'], 2)} | {f(r['tau'])} |")
        pl, sp = [r["plain_perplexity"] for r in res["noise"]], [r["perplexity"] for r in res["noise"]]
        if len(pl) > 1:
            lines.append(f"| mean ± sd | {statistics.mean(pl):.2f} ± {statistics.stdev(pl):.2f} | "
                         f"{statistics.mean(sp):.2f} ± {statistics.stdev(sp):.2f} | |")  # fmt: skip
    lines += ["", "Reproduce (from the repository root, after training the runs as the script's docstring says):", "",
              "```bash", command, "```", "", analysis, ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchSamplingConfig, bench, markdown, "bench_sampling", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
