"""All four recipes side by side on the real target: same data, steps, seed and optimizer.

    for r in parallelspec parallelspec_eagle medusa eagle; do   # the first run self-distils the data, the others reuse it
        python -m scripts.bench_recipes phase=train recipe=$r
        python -m scripts.bench_recipes phase=eval recipe=$r
    done
    python -m scripts.bench_recipes phase=report

``train`` launches the real CLI (``accelerate launch train.py +recipe=NAME`` with the shared overrides
below, so every recipe trains on the same self-distilled sequences in the same order for the same
number of steps); the run ends with held-out ``eval/tau_sim`` and greedy chain speculative decoding of
MT-bench questions, checked token for token against plain greedy. ``eval`` decodes GSM8K questions
with the saved drafter (``Drafter.from_pretrained``), the same check. ``report`` writes
``docs/benchmarks/recipes.json`` and the marked table section of ``docs/benchmarks/recipes.md``: trainable parameters, training sequence tokens/s, peak memory
(resident set size of the training process: target + data + drafter + optimizer), held-out tau_sim,
and eval tau on both prompt sets with their greedy-equality flags.

Each step is a separate command of less than 10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["parallelspec", "parallelspec_eagle", "medusa", "eagle"]
# shared by every recipe: same steps, seed, batch, schedule and in-run MT-bench evaluation
COMMON = [
    "seed=0",
    "data.max_conversations=1150",  # 943 self-distilled first turns (927 train + 16 held out)
    "trainer.max_steps=180",
    "drafter.draft_vocab_size=8192",  # one draft vocabulary for every recipe (the main job's ParallelSpec uses 4096)
    "trainer.spec_eval.batch_size=1",  # batch-1 chain decoding, as the GSM8K evaluation below
    "trainer.spec_eval.tree.widths=null",
    "trainer.spec_eval.tree.budget=null",
    "trainer.max_minutes=7",  # a safety cap only: every recipe is meant to finish its 180 steps
    "trainer.eval_every=0",  # held-out eval/tau_sim once, at the end
    "trainer.save_every=0",  # final checkpoint only
    "trainer.spec_eval.prompts=mt_bench",
    "trainer.spec_eval.num_prompts=10",
    "trainer.spec_eval.max_new_tokens=128",
    "trainer.progress=false",
    "logging.wandb=false",
]
GSM8K_PROMPTS = 10
START, END = "<!-- bench_recipes table: start -->", "<!-- bench_recipes table: end -->"  # report rewrites only this


def run_dir(out_root: Path, recipe: str) -> Path:
    return out_root / recipe


def cmd_train(recipe: str, out_root: Path, extra: list[str]) -> None:
    out = run_dir(out_root, recipe)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml", "train.py",
           f"+recipe={recipe}", *COMMON, f"output_dir={out}", f"run_name=bench-{recipe}", *extra]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode != 0:
        raise SystemExit(f"training {recipe} failed ({proc.returncode})")
    (out / "bench_command.json").write_text(json.dumps({"argv": cmd[2:], "wall_seconds": round(time.time() - t0, 1)}))


def cmd_eval(recipe: str, out_root: Path, prompts: str, num: int) -> dict:
    """Greedy chain speculative decoding of ``num`` prompts of ``prompts`` with the run's saved drafter."""
    import torch

    from drafttrain.config import upgrade_saved, validate
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids
    from drafttrain.drafters import Drafter
    from drafttrain.eval.spec import evaluate_prompts
    from drafttrain.target import load_target

    out = run_dir(out_root, recipe)
    c = validate(upgrade_saved(json.loads((out / "config.json").read_text())))  # runs saved before keys moved too
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    target = load_target(c.target)
    drafter = Drafter.from_pretrained(out / "drafter", target).eval()
    rows = load_eval_prompts(prompts, limit=num)
    ids = [prompt_ids(target.tokenizer, r["messages"]) for r in rows]
    r = evaluate_prompts(target, drafter, ids, c.trainer.spec_eval.max_new_tokens, progress=False)
    result = {k: r[k] for k in ("tau", "greedy_equal", "mismatches", "accept_hist", "speedup", "spec_tokens_per_s",
                                "plain_tokens_per_s", "num_prompts", "generated_tokens")}  # fmt: skip
    result["prompts"] = f"{prompts}[0:{len(ids)}]"
    (out / f"eval_{prompts}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


def summarize(out_root: Path, recipe: str) -> dict:
    out = run_dir(out_root, recipe)
    final = json.loads((out / "final_metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "train/loss" in r]
    tok = [r["train/seq_tokens_per_s"] for r in train_rows[1:]] or [train_rows[-1]["train/seq_tokens_per_s"]]
    gsm = out / "eval_gsm8k.json"
    gsm8k = json.loads(gsm.read_text()) if gsm.is_file() else {}
    config = json.loads((out / "config.json").read_text())
    launch = out / "bench_command.json"
    return {
        "recipe": recipe,
        "launch": json.loads(launch.read_text()) if launch.is_file() else None,  # argv (extra overrides included)
        "drafter": config["drafter"],
        "steps": final["step"],
        "stopped_by_time_budget": final["stopped_by_time_budget"],
        "train_seconds": final["train_seconds"],
        "trainable_params": final["trainable_params"],
        "train_seq_tokens_per_s": sum(tok) / len(tok),
        "step_seconds": final["train_seconds"] / max(final["step"], 1),
        "peak_memory_mb": final.get("peak_memory_mb"),
        "train_tau_sim_last": train_rows[-1].get("train/tau_sim"),
        "heldout_tau_sim": final.get("eval/tau_sim"),
        "heldout_acc": {k.split("/")[1]: v for k, v in final.items() if k.startswith("eval/acc_")},
        "heldout_cond_acc": {k.split("/")[1]: v for k, v in final.items() if k.startswith("eval/cond_acc_")},
        "mt_bench": {"tau": final.get("eval/tau"), "greedy_equal": final.get("eval/greedy_equal"),
                     "accept_hist": final.get("eval/accept_hist"), "speedup": final.get("eval/speedup"),
                     "prompts": final.get("eval/prompts")},  # fmt: skip
        "gsm8k": gsm8k,
    }


def cmd_report(out_root: Path, dest: Path, recipes: list[str]) -> None:
    import torch

    rows = [summarize(out_root, r) for r in recipes if (run_dir(out_root, r) / "final_metrics.json").is_file()]
    data = {
        "date": time.strftime("%Y-%m-%d"),
        "common_overrides": COMMON,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},  # fmt: skip
        "runs": rows,
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.with_suffix(".json").write_text(json.dumps(data, indent=1))

    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    def eq(x):
        return "yes" if x is True else ("**NO**" if x is False else "n/a")

    lines = [
        "| recipe | drafts / step | trainable params | train tokens/s | step (s) | peak RSS (MiB) | held-out τ_sim | MT-bench τ (= greedy) | GSM8K τ (= greedy) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["drafter"]
        depth = {"medusa": d["num_heads"], "eagle": d["draft_depth"]}.get(r["recipe"], d["num_mask_tokens"] + 1)
        passes = f"{depth} ({depth} passes)" if r["recipe"] == "eagle" else f"{depth} (1 pass)"
        lines.append(
            f"| {r['recipe']} | {passes} | {r['trainable_params'] / 1e6:.2f}M | {r['train_seq_tokens_per_s']:.0f} | "
            f"{r['step_seconds']:.2f} | {f(r['peak_memory_mb'], '{:.0f}')} | {f(r['heldout_tau_sim'])} | "
            f"{f(r['mt_bench']['tau'])} ({eq(r['mt_bench']['greedy_equal'])}) | "
            f"{f(r['gsm8k'].get('tau'))} ({eq(r['gsm8k'].get('greedy_equal'))}) |"
        )
    acc = ["", "Held-out per-position accuracy acc_k (cond_acc_k):", "",
           "| recipe | " + " | ".join(f"k={k}" for k in range(5)) + " |", "|---|" + "---|" * 5]  # fmt: skip
    for r in rows:
        cells = [f"{r['heldout_acc'][f'acc_{k}']:.3f} ({r['heldout_cond_acc'].get(f'cond_acc_{k}', 0):.3f})"
                 if f"acc_{k}" in r["heldout_acc"] else "" for k in range(5)]  # fmt: skip
        acc.append(f"| {r['recipe']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines + acc)
    md = dest.with_suffix(".md")
    text = md.read_text() if md.is_file() else f"# Recipes side by side\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        raise SystemExit(f"{md} has no {START} ... {END} section to update")
    head, rest = text.split(START, 1)
    md.write_text(head + START + "\n" + table + "\n" + END + rest.split(END, 1)[1])
    print(table)


@dataclass
class BenchRecipesConfig:
    """Schema of ``python -m scripts.bench_recipes`` (key=value overrides, validated before any work)."""

    phase: str = "report"  # train | eval | report
    recipe: str | None = None  # train / eval: one of RECIPES
    out_root: str = "outputs/bench_recipes"  # one training run folder per recipe
    dest: str = "docs/benchmarks/recipes"
    gsm8k_prompts: int = GSM8K_PROMPTS
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every training run


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import ConfigError, parse_cli

    args = parse_cli(BenchRecipesConfig, argv)
    if args.phase not in ("train", "eval", "report"):
        raise ConfigError(f"phase must be train, eval or report, got {args.phase!r}")
    if args.phase in ("train", "eval") and args.recipe not in RECIPES:
        raise ConfigError(f"phase={args.phase} needs recipe= one of {RECIPES}")
    out_root, dest = Path(args.out_root).resolve(), Path(args.dest)
    if args.phase == "train":
        cmd_train(args.recipe, out_root, args.overrides)
    elif args.phase == "eval":
        cmd_eval(args.recipe, out_root, "gsm8k", args.gsm8k_prompts)
    else:
        cmd_report(out_root, dest, RECIPES)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
