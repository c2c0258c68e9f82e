"""The recipes side by side on the real target: same data, seed, optimizer and steps (or minutes).

    for r in parallelspec parallelspec_eagle medusa eagle; do   # the first run self-distils the data, the others reuse it
        python -m scripts.bench_recipes phase=train recipe=$r
        python -m scripts.bench_recipes phase=eval recipe=$r
    done
    python -m scripts.bench_recipes phase=report

Equal wall-clock budget instead of equal steps (``budget_minutes``: every run trains until that much
training time has passed, checkpointing every 100 steps, so a killed run resumes with ``resume=true``
in ``overrides`` and its clock where the checkpoint left it), evaluated with ``eval_suite=full``
(docs/benchmarks/eagle3.md)::

    B='out_root=outputs/bench_eagle3 budget_minutes=40'
    for r in eagle eagle3 parallelspec parallelspec_eagle3; do
        python -m scripts.bench_recipes phase=train recipe=$r $B
        python -m scripts.bench_recipes phase=eval recipe=$r $B eval_suite=full
    done
    python -m scripts.bench_recipes phase=report $B dest=docs/benchmarks/eagle3 'recipes=[eagle,eagle3,parallelspec,parallelspec_eagle3]'

``train`` launches the real CLI (``accelerate launch train.py +recipe=NAME`` with the shared overrides
below, so every recipe trains on the same self-distilled sequences in the same order for the same
number of steps); the run ends with held-out ``eval/tau_sim`` and greedy chain speculative decoding of
MT-bench questions, checked token for token against plain greedy. ``eval`` decodes GSM8K questions
with the saved drafter (``Drafter.from_pretrained``), the same check; ``eval_suite=full`` instead decodes
MT-bench and GSM8K prompts each with the batched verifier (:func:`drafttrain.eval.in_training.spec_eval`, no
SSSD candidates): the recipe's draft tree (EAGLE-2 dynamic tree for the autoregressive drafters, the
best-first static tree for the parallel ones, the same node budget) and the chain at batch 16, then
batch-1 latency (plain vs speculative, the online planner), every output checked against plain greedy. ``report`` writes
``docs/benchmarks/recipes.json`` and the marked table section of ``docs/benchmarks/recipes.md``: trainable parameters, training sequence tokens/s, peak memory
(resident set size of the training process: target + data + drafter + optimizer), held-out tau_sim,
and eval tau on both prompt sets with their greedy-equality flags.

Each step is a separate command of less than 10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["parallelspec_medusa", "parallelspec_eagle", "medusa", "eagle", "eagle3", "parallelspec_eagle3", "parallelspec", "dflash"]
# shared by every recipe: same data, seed, batch, schedule and in-run evaluation
COMMON = [
    "seed=0",
    "data.max_conversations=1150",  # 943 self-distilled first turns (927 train + 16 held out)
    "drafter.draft_vocab_size=8192",  # one draft vocabulary for every recipe (the main job's ParallelSpec uses 4096)
    "trainer.eval_every=0",  # held-out eval/tau_sim once, at the end
    "trainer.progress=false",
    "logging.wandb=false",
]
# equal steps (recipes.md): 180 steps, batch-1 chain evaluation of MT-bench at the end of the run
STEPS = [
    "trainer.max_steps=180",
    "trainer.max_minutes=20",  # a safety cap only: every recipe finishes its 180 steps (EAGLE-3: ~3.2 s a step on 2 cores)
    "trainer.save_every=0",  # final checkpoint only
    "trainer.spec_eval.batch_size=1",  # batch-1 chain decoding, as the GSM8K evaluation below
    "trainer.spec_eval.tree.widths=null",
    "trainer.spec_eval.tree.budget=null",
    "trainer.spec_eval.prompts=mt_bench",
    "trainer.spec_eval.num_prompts=10",
    "trainer.spec_eval.max_new_tokens=128",
]


#: Training objectives of one recipe, run as rows named ``RECIPE@VARIANT`` (docs/benchmarks/objectives.md): the
#: variant's overrides follow COMMON and the plan (``overrides=`` still wins).
#: On-policy rows take several times longer per step, so they evaluate the held-out set every 20 steps (evaluation
#: time is not training time) to give their τ_sim-by-minute curve as many points as the offline rows'.
ON_POLICY_EVAL = "trainer.eval_every=20"
VARIANTS = {
    "offline": [],
    "cut": ["loss.cut_at_first_miss=true"],
    "cut01": ["loss.cut_at_first_miss=true", "loss.cut_weight=0.1"],
    "on_policy": ["trainer.strategy=on_policy", ON_POLICY_EVAL],
    "on_policy_cut": ["trainer.strategy=on_policy", "loss.cut_at_first_miss=true", ON_POLICY_EVAL],
    "mixed": ["trainer.strategy=mixed", "trainer.on_policy.share=0.5", "trainer.on_policy.share_end=0.0", ON_POLICY_EVAL],
    # drafts sampled at temperature 0.7: the setting (with sampled verification at the same temperature) where the
    # drafter's own drafts differ from the target's greedy rows
    "on_policy_t07": ["trainer.strategy=on_policy", "trainer.on_policy.temperature=0.7", ON_POLICY_EVAL],
    # EAGLE-3.1 (drafter flags of the EAGLE-3 network: an RMSNorm per target layer before fc, norm(h) fed back)
    "eagle31": ["drafter.fc_norm=true", "drafter.norm_output=true"],
    "mixed_cut": ["trainer.strategy=mixed", "trainer.on_policy.share=0.5", "trainer.on_policy.share_end=0.0",
                  "loss.cut_at_first_miss=true", ON_POLICY_EVAL],
}


def split_row(name: str) -> tuple[str, list[str]]:
    """A row name ``RECIPE`` or ``RECIPE@VARIANT`` -> (recipe, the variant's overrides).

    Raises:
        ValueError: an unknown recipe or variant.
    """
    recipe, _, variant = name.partition("@")
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r} in {name!r}; choose from {RECIPES}")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} in {name!r}; choose from {sorted(VARIANTS)}")
    return recipe, VARIANTS.get(variant, [])


def budget_overrides(minutes: float) -> list[str]:
    """Equal wall-clock budget: train until ``minutes`` of training time (the loop's own clock, saved in
    every checkpoint, so a resumed run continues it), a checkpoint and a held-out evaluation every 100
    steps (the τ_sim curve; evaluation time is not training time), the learning rate's cosine over the
    minutes (``optim.decay_over=minutes``: every recipe ends its decay at the budget, whatever its step
    rate); no in-run speculative decoding (``eval_suite=full`` runs it afterwards, the same for every recipe)."""
    return ["trainer.max_steps=1000000", f"trainer.max_minutes={minutes:g}", "optim.decay_over=minutes",
            "trainer.save_every=100", "trainer.eval_every=100", "trainer.spec_eval.num_prompts=0"]  # fmt: skip


GSM8K_PROMPTS = 10
START, END = "<!-- bench_recipes table: start -->", "<!-- bench_recipes table: end -->"  # report rewrites only this


def run_dir(out_root: Path, recipe: str) -> Path:
    return out_root / recipe


def train_command(recipe: str, out_root: Path, extra: list[str], budget_minutes: float | None = None) -> list[str]:
    """The ``accelerate launch train.py`` argv of one run: COMMON, then STEPS or :func:`budget_overrides`,
    then ``extra`` (later overrides win)."""
    plan = STEPS if budget_minutes is None else budget_overrides(budget_minutes)
    out = run_dir(out_root, recipe)
    base, variant = split_row(recipe)  # a RECIPE@VARIANT row trains RECIPE with the variant's overrides
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml", "train.py",
            f"+recipe={base}", *COMMON, *plan, *variant, f"output_dir={out}", f"run_name=bench-{recipe.replace('@', '-')}",
            *extra]  # fmt: skip


def cmd_train(recipe: str, out_root: Path, extra: list[str], budget_minutes: float | None = None) -> None:
    out = run_dir(out_root, recipe)
    cmd = train_command(recipe, out_root, extra, budget_minutes)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode != 0:
        raise SystemExit(f"training {recipe} failed ({proc.returncode})")
    launch = out / "bench_command.json"  # every launch of the run (a resumed run has several)
    prev = json.loads(launch.read_text()) if launch.is_file() else {}
    launches = prev.get("launches", [{"argv": prev["argv"], "wall_seconds": prev["wall_seconds"]}] if prev else [])
    launches.append({"argv": cmd[2:], "wall_seconds": round(time.time() - t0, 1)})
    launch.write_text(json.dumps({"argv": cmd[2:], "wall_seconds": launches[-1]["wall_seconds"], "launches": launches}))


def load_run(out: Path):
    """(validated config, target, saved drafter) of a finished run folder (runs saved before keys moved too),
    with the run's torch thread count."""
    import torch

    from drafttrain.config import upgrade_saved
    from drafttrain.validation import validate
    from drafttrain.compose import build_run

    c = validate(upgrade_saved(json.loads((out / "config.json").read_text())))
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    built = build_run(c, drafter=out / "drafter", pack=False)  # the saved drafter as it is (unpacked)
    return c, built.target, built.drafter


def cmd_eval(recipe: str, out_root: Path, prompts: str, num: int) -> dict:
    """Greedy chain speculative decoding of ``num`` prompts of ``prompts`` with the run's saved drafter, one sequence at
    a time in the bundled engine against plain decoding in it (:func:`drafttrain.eval.in_training.drafter_eval`)."""
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids
    from drafttrain.eval.in_training import drafter_eval

    out = run_dir(out_root, recipe)
    c, target, drafter = load_run(out)
    rows = load_eval_prompts(prompts, limit=num)
    ids = [prompt_ids(target.tokenizer, r["messages"]) for r in rows]
    r = drafter_eval(target, drafter, ids, c.trainer.spec_eval.max_new_tokens, batch_size=1, progress=False)
    result = {k: r[k] for k in ("tau", "greedy_equal", "mismatches", "accept_hist", "speedup", "spec_tokens_per_s",
                                "plain_tokens_per_s", "num_prompts", "generated_tokens")}  # fmt: skip
    result["prompts"] = f"{prompts}[0:{len(ids)}]"
    (out / f"eval_{prompts}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


FULL_PROMPTS = {"mt_bench": dict(prompt_stride=5), "gsm8k": dict(prompt_stride=1)}  # MT-bench: 2 per category


def cmd_eval_full(recipe: str, out_root: Path, num_prompts: int, max_new_tokens: int, latency_prompts: int) -> dict:
    """MT-bench and GSM8K through the batched verifier (:func:`drafttrain.eval.in_training.spec_eval`) with the run's
    saved drafter: the recipe's draft tree (widths [4, 2, 1, 1, 1], at most 8 nodes: an EAGLE-2 dynamic
    tree for the autoregressive drafters, the best-first static tree for the parallel ones) and the chain,
    16 sequences at a time, then ``latency_prompts`` of them spread over the list one at a time (batch-1 latency, online
    planner), no SSSD candidates. Writes ``<run>/eval_full.json`` ({prompt set: spec_eval's metrics})."""
    import dataclasses

    from drafttrain.eval import in_training

    out = run_dir(out_root, recipe)
    c, target, drafter = load_run(out)
    path = out / "eval_full.json"
    result = json.loads(path.read_text()) if path.is_file() else {}  # resumes per prompt set
    for prompts, extra in FULL_PROMPTS.items():
        if prompts in result:
            continue
        se = dataclasses.replace(c.trainer.spec_eval, prompts=prompts, num_prompts=num_prompts, prompt_offset=0,
                                 max_new_tokens=max_new_tokens, batch_size=16, chain=True,
                                 latency_prompts=latency_prompts, **extra,
                                 tree=dataclasses.replace(c.trainer.spec_eval.tree, widths=[4, 2, 1, 1, 1], budget=8,
                                                          plan=True),
                                 sssd=dataclasses.replace(c.trainer.spec_eval.sssd, source="none"))  # fmt: skip
        c2 = dataclasses.replace(c, output_dir=str(out / f"eval_full_{prompts}"),
                                 trainer=dataclasses.replace(c.trainer, spec_eval=se, progress=False))  # fmt: skip
        Path(c2.output_dir).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        r = in_training.spec_eval(c2, target, drafter)
        result[prompts] = {**r, "seconds": round(time.time() - t0, 1)}
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps({prompts: {k: r.get(k) for k in ("eval/tau", "eval/tau_chain", "eval/speedup_b1", "eval/greedy_equal")}}))
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
        # argv (extra overrides included), paths relative to the repository (the page's commands run from its root)
        "launch": json.loads(launch.read_text().replace(f"{REPO}/", "")) if launch.is_file() else None,
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
        "full": json.loads((out / "eval_full.json").read_text()) if (out / "eval_full.json").is_file() else None,
        "train_data_sha": final.get("train_data_sha"),
        # held-out τ_sim after each evaluation, at ≈ minutes of training (step x the run's mean step time)
        "heldout_curve": [(r["step"], round(final["train_seconds"] / 60 * r["step"] / max(final["step"], 1), 2), r["eval/tau_sim"])
                          for r in rows if "eval/tau_sim" in r],  # fmt: skip
        "epochs": final["samples"] / final["train_rows"] if final.get("train_rows") else None,
        # on-policy rows: the target's labelling pass per step, and how often its labels equal the offline ones
        "label_seconds_per_step": (sum(r.get("train/label_seconds", 0.0) for r in train_rows) / max(final["step"], 1)
                                   if any("train/label_seconds" in r for r in train_rows) else None),  # fmt: skip
        "policy_label_agree": next((r["train/policy_label_agree"] for r in reversed(train_rows)
                                    if "train/policy_label_agree" in r), None),  # fmt: skip
    }


def drafts_per_step(recipe: str, d: dict) -> int:
    """Draft tokens one drafting step proposes in a chain, from a run's saved drafter config: Medusa's heads,
    an autoregressive drafter's depth, ParallelSpec's K [MASK] tokens + 1, DFlash's block size - 1."""
    if recipe.partition("@")[0] == "medusa":
        return d["num_heads"]
    if "block_size" in d:
        return d["block_size"] - 1
    return d.get("draft_depth", d.get("num_mask_tokens", 0) + 1)


def position_acceptance(hist: dict) -> list[float]:
    """Per-position acceptance of a chain from its histogram of accepted drafts per step ({count: steps}):
    entry k-1 is P(at least k drafts accepted), k = 1 .. the longest chain seen."""
    h = {int(k): v for k, v in hist.items()}
    total = sum(h.values())
    return [sum(v for j, v in h.items() if j >= k) / total for k in range(1, max(h) + 1)] if total else []


def decoding_table(full: list[dict], sets: list[str]) -> list[str]:
    """Batch-16 speedup, drafting ms per step (the online planner's measured cost of drafting the most
    sequences it drafted at once: 1 at batch 1, up to 16 at batch 16, the count in brackets where fewer) and
    the chain's per-position acceptance, from ``eval_suite=full`` results."""
    lines = ["", "Batch-16 speedup (online planner, over plain decoding at batch 16), drafting cost per step and the "
             "chain's per-position acceptance P(≥ k drafts accepted) at batch 16, per prompt set:", "",
             "| recipe | set | speedup b16 | draft ms/step b1 | draft ms/step b16 (sequences drafted) | chain acceptance k=1, 2, ... |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in full:
        for p in sets:
            m = r["full"].get(p, {})
            if not m:
                continue
            cell = []
            for b in (1, 16):  # the most sequences the planner drafted at once (it drafts only those that pay)
                ms = {int(n): v for n, v in ((m.get(f"eval/planner_b{b}") or {}).get("draft_ms") or {}).items()}
                n = max(ms, default=None)
                cell.append("n/a" if n is None else f"{ms[n]:.1f}" + ("" if n == b else f" ({n} seq)"))
            acc = ", ".join(f"{a:.2f}" for a in position_acceptance(m.get("eval/accept_hist_chain") or {}))
            sp = m.get("eval/speedup_b16")
            lines.append(f"| {r['recipe']} | {p} | {'n/a' if sp is None else f'{sp:.2f}x'} | {cell[0]} | {cell[1]} | {acc} |")
    return lines


def plot_curves(curves: dict[str, list], dest: Path) -> Path:
    """Held-out τ_sim (y) against training minutes (x), one line per row; written next to ``dest``'s page as
    ``<dest name>_tau_sim.png`` (returned). ``curves``: row name -> [(step, minutes, τ_sim), ...]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot([t[1] for t in curve], [t[2] for t in curve], marker=".", label=name)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("held-out τ_sim")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = dest.with_name(dest.name + "_tau_sim.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def cmd_report(out_root: Path, dest: Path, recipes: list[str]) -> None:
    from scripts.common import machine

    rows = [summarize(out_root, r) for r in recipes if (run_dir(out_root, r) / "final_metrics.json").is_file()]
    data = {
        "date": time.strftime("%Y-%m-%d"),
        "common_overrides": COMMON,
        "machine": {**machine(), "cpu_count": os.cpu_count()},  # drafttrain.host.describe + the load average
        "runs": rows,
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.with_suffix(".json").write_text(json.dumps(data, indent=1))

    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    def eq(x):
        return "yes" if x is True else ("**NO**" if x is False else "n/a")

    in_run = any(r["mt_bench"]["tau"] is not None or r["gsm8k"] for r in rows)  # the equal-steps runs' evaluations
    lines = [
        "| recipe | drafts / step | trainable params | steps (epochs) | train min | train tokens/s | step (s) | peak RSS (MiB) | held-out τ_sim |"
        + (" MT-bench τ (= greedy) | GSM8K τ (= greedy) |" if in_run else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if in_run else ""),
    ]
    for r in rows:
        d = r["drafter"]
        depth = drafts_per_step(r["recipe"], d)
        passes = f"{depth} ({depth} passes)" if "draft_depth" in d else f"{depth} (1 pass)"
        epochs = f" ({r['epochs']:.1f})" if r.get("epochs") is not None else ""
        lines.append(
            f"| {r['recipe']} | {passes} | {r['trainable_params'] / 1e6:.2f}M | {r['steps']}{epochs} | "
            f"{r['train_seconds'] / 60:.1f} | {r['train_seq_tokens_per_s']:.0f} | "
            f"{r['step_seconds']:.2f} | {f(r['peak_memory_mb'], '{:.0f}')} | {f(r['heldout_tau_sim'])} |"
            + (f" {f(r['mt_bench']['tau'])} ({eq(r['mt_bench']['greedy_equal'])}) | "
               f"{f(r['gsm8k'].get('tau'))} ({eq(r['gsm8k'].get('greedy_equal'))}) |" if in_run else "")
        )
    shas = {r["recipe"]: r.get("train_data_sha") for r in rows}
    if rows and None not in shas.values():
        same = len(set(shas.values())) == 1
        lines += ["", f"Training sequences (`train_data_sha`, input ids + loss masks in order): "
                  + (f"the same in every run ({next(iter(shas.values()))})." if same
                     else "**differ**: " + ", ".join(f"{k} {v}" for k, v in shas.items()))]  # fmt: skip
    curves = {r["recipe"]: r["heldout_curve"] for r in rows if len(r.get("heldout_curve") or []) > 2}
    if curves:
        budget = max(r["train_seconds"] for r in rows) / 60
        marks = [budget * x for x in (0.125, 0.25, 0.5, 0.75, 1.0)]

        def at(curve, m):  # the last evaluation at or before m minutes
            before = [t for t in curve if t[1] <= m + 1e-6]
            return f"{before[-1][2]:.3f} ({before[-1][0]})" if before else ""

        lines += ["", "Held-out τ_sim by training time (the last evaluation at or before; its step in brackets; minutes "
                  "≈ step x the run's mean step time):", "",
                  "| recipe | " + " | ".join(f"{m:.0f} min" for m in marks) + " | best |", "|---|" + "---|" * (len(marks) + 1)]
        for name, curve in curves.items():
            best = max(curve, key=lambda t: t[2])
            lines.append(f"| {name} | " + " | ".join(at(curve, m) for m in marks) + f" | {best[2]:.3f} ({best[0]}) |")
        if len(curves) > 1:
            png = plot_curves(curves, dest)
            lines += ["", f"![held-out τ_sim by training minute]({png.name})"]
        common = sorted(set.intersection(*({t[0] for t in c} for c in curves.values())))  # steps every run evaluated
        if len(curves) > 1 and common:
            picks = sorted({common[0], *[x for x in (200, 500, 1000) if x in common], common[-1]})
            by_step = {n: {t[0]: t for t in c} for n, c in curves.items()}
            lines += ["", "The same curves at equal steps (8 sequences each; ≈ minutes in brackets):", "",
                      "| recipe | " + " | ".join(f"step {x}" for x in picks) + " |", "|---|" + "---|" * len(picks)]
            for name in curves:
                lines.append(f"| {name} | " + " | ".join(f"{by_step[name][x][2]:.3f} ({by_step[name][x][1]:.1f})" for x in picks) + " |")
    full = [r for r in rows if r.get("full")]
    if full:
        sets = list(FULL_PROMPTS)
        lines += ["", "Speculative decoding with the saved drafters (`eval_suite=full`): τ with the recipe's draft tree "
                  "(≤ 8 nodes) and the chain at batch 16, batch-1 speedup (online planner) over plain decoding in the "
                  "same engine; every output compared token for token with plain greedy:", "",
                  "| recipe | " + " | ".join(f"{p} τ tree | {p} τ chain | {p} speedup b1 (τ b1)" for p in sets)
                  + " | all = greedy |", "|---|" + "---|---|---|" * len(sets) + "---|"]  # fmt: skip
        for r in full:
            cells, equal = [], True
            for p in sets:
                m = r["full"].get(p, {})
                equal = equal and m.get("eval/greedy_equal") is True
                cells.append(f"{f(m.get('eval/tau'))} | {f(m.get('eval/tau_chain'))} | "
                             f"{f(m.get('eval/speedup_b1'), '{:.2f}x')} ({f(m.get('eval/tau_b1'))})")  # fmt: skip
            lines.append(f"| {r['recipe']} | " + " | ".join(cells) + f" | {eq(equal)} |")
        lines += decoding_table(full, sets)
    costs = [r for r in rows if r.get("label_seconds_per_step") is not None]
    if costs:
        lines += ["", "Step cost of on-policy training: seconds per optimizer step in all, of which the target's "
                  "labelling pass (one forward over the labelled rows + their groups' drafts); "
                  "`policy_label_agree`: of the on-policy labels whose context drafts all equal the offline labels, "
                  "the share equal to the offline label (last logged window):", "",
                  "| row | step (s) | labelling (s/step) | policy_label_agree |", "|---|---|---|---|"]  # fmt: skip
        for r in costs:
            lines.append(f"| {r['recipe']} | {r['step_seconds']:.2f} | {r['label_seconds_per_step']:.2f} | "
                         f"{f(r['policy_label_agree'])} |")
    ks = range(max([5] + [drafts_per_step(r["recipe"], r["drafter"]) for r in rows]))
    acc = ["", "Held-out per-position accuracy acc_k (cond_acc_k):", "",
           "| recipe | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]  # fmt: skip
    for r in rows:
        cells = [f"{r['heldout_acc'][f'acc_{k}']:.3f} ({r['heldout_cond_acc'].get(f'cond_acc_{k}', 0):.3f})"
                 if f"acc_{k}" in r["heldout_acc"] else "" for k in ks]  # fmt: skip
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
    recipe: str | None = None  # train / eval: one of RECIPES, or RECIPE@VARIANT (VARIANTS: a training objective)
    out_root: str = "outputs/bench_recipes"  # one training run folder per recipe
    dest: str = "docs/benchmarks/recipes"
    gsm8k_prompts: int = GSM8K_PROMPTS
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every training run
    budget_minutes: float | None = None  # train: equal training time instead of 180 steps (budget_overrides)
    eval_suite: str = "chain"  # eval: chain (GSM8K, batch-1 chain) | full (MT-bench + GSM8K: tree, chain, batch-1)
    eval_prompts: int = 16  # eval_suite=full: prompts per set
    eval_max_new_tokens: int = 128  # eval_suite=full
    latency_prompts: int = 4  # eval_suite=full: prompts decoded one at a time for the batch-1 speedup
    recipes: list[str] = field(default_factory=lambda: list(RECIPES[:4]))  # report: the rows, in this order


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import ConfigError, parse_cli

    args = parse_cli(BenchRecipesConfig, argv)
    if args.phase not in ("train", "eval", "report"):
        raise ConfigError(f"phase must be train, eval or report, got {args.phase!r}")
    for name in ([args.recipe] if args.phase in ("train", "eval") else []) + list(args.recipes):
        if name is None:
            raise ConfigError(f"phase={args.phase} needs recipe= one of {RECIPES} (or RECIPE@VARIANT, {sorted(VARIANTS)})")
        try:
            split_row(name)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if args.eval_suite not in ("chain", "full"):
        raise ConfigError(f"eval_suite must be chain or full, got {args.eval_suite!r}")
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise ConfigError(f"budget_minutes must be > 0, got {args.budget_minutes}")
    out_root, dest = Path(args.out_root).resolve(), Path(args.dest)
    if args.phase == "train":
        cmd_train(args.recipe, out_root, args.overrides, args.budget_minutes)
    elif args.eval_suite == "full":
        cmd_eval_full(args.recipe, out_root, args.eval_prompts, args.eval_max_new_tokens, args.latency_prompts)
    elif args.phase == "eval":
        cmd_eval(args.recipe, out_root, "gsm8k", args.gsm8k_prompts)
    else:
        cmd_report(out_root, dest, args.recipes)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
