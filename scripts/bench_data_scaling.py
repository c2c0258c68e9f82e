"""The data-scaling curve: the main job's recipe on more and more unique training rows, everything else fixed.

    for row in raw690 raw2700 raw4500; do   # raw6500: ~5.8k rows, every sample of the 800 steps unique
        python -m scripts.bench_data_scaling phase=train row=$row
        python -m scripts.bench_data_scaling phase=eval row=$row
    done
    python -m scripts.bench_data_scaling phase=lengths row=every     # τ by prompt length, the largest row
    python -m scripts.bench_data_scaling phase=report

Every row trains ``+recipe=parallelspec`` (the main job's drafter, draft vocabulary and optimizer) for the main
job's 800 steps of 8 sequences, seed 0, on ShareGPT conversations **as they are** (every assistant turn of a
conversation's first 512 tokens, ``data.first_turn_only=false``), labelled once by the frozen target
(``data.features=cache data.feature_cache=auto``: its teacher-forced hidden states of the drafter's layers; the
drafter's labels are the target's argmax through its LM head, whatever the text), the target in bf16 where the
host computes bf16 natively (``target.dtype=auto``). Only ``data.max_conversations`` changes between the ``raw*``
rows. The held-out rows are the same 16 in every row (``data.heldout_split=head``: the first 16 conversations,
never trained on), evaluated every 100 steps (τ_sim, acc_k); ``sd*`` rows are self-distilled first turns (the
main job's data) under the same settings, for raw versus self-distilled at equal rows.

``eval`` decodes 16 MT-bench questions (ids 81, 86, ..., 156: the main job's) and 16 GSM8K questions with the saved
drafter through the batched verifier, 16 sequences at a time, 128 new tokens: the drafter alone as a chain
(K + 1 = 5 depths) and as the main job's draft tree (widths [4, 2, 1, 1, 1], at most 8 nodes), no SSSD
candidates, every output checked token for token against plain greedy decoding (τ only: no planned run, no
timing claims; the host is busy with nothing else but the numbers are acceptance lengths). ``report`` writes
``docs/benchmarks/data_scaling.{json,md}`` and ``data_scaling.png``. Each phase is one command; a killed
``train`` resumes with ``overrides=[resume=true]`` (a checkpoint every 200 steps).
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
COMMON = [
    "seed=0",
    "target.dtype=auto",
    "data.heldout=16",
    "data.heldout_split=head",
    "data.max_length=512",
    "trainer.max_steps=800",
    "trainer.max_minutes=120",  # a safety cap only: every row is meant to finish its 800 steps
    "trainer.save_every=200",
    "trainer.eval_every=100",
    "trainer.spec_eval.num_prompts=0",  # decoding: the eval phase, the same for every row
    "trainer.progress=false",
    "trainer.export=false",  # no serving folder per row (the export's cost measurements are minutes on 2 cores)
    "logging.wandb=false",
]
RAW = ["data=sharegpt", "data.first_turn_only=false", "data.self_distill=false", "data.features=cache",
       "data.feature_cache=auto"]  # fmt: skip
#: every ShareGPT conversation the package holds but those whose first turn is a ``phase=lengths`` prompt (written by
#: :func:`every_conversation` under out_root before the row trains: the τ-by-length prompts are never trained on)
EVERY = [*RAW, "data.source={out_root}/sharegpt_every.jsonl", "data.max_conversations=100000"]
#: part (b): the same row trained for 2400 steps, about two training hours on a 2-core host (2.9 s a step on the
#: every-conversation row; the held-out curve read every 100 steps says whether it still rises); a fixed step count
#: keeps the LR schedule the same on every host, and the time cap sits far above it (a safety cap, not the schedule)
LONG = ["trainer.max_steps=2400", "trainer.max_minutes=240"]
#: row name -> (recipe, its overrides after COMMON; a later key=value replaces COMMON's). raw: ShareGPT conversations
#: as they are; sd: self-distilled first turns; ``-long``: part (b); ``e3-``: the eagle3 recipe on the same rows.
ROWS: dict[str, tuple[str, list[str]]] = {
    "raw690": ("parallelspec", [*RAW, "data.max_conversations=690"]),
    "raw2700": ("parallelspec", [*RAW, "data.max_conversations=2700"]),
    "raw4500": ("parallelspec", [*RAW, "data.max_conversations=4500"]),
    "raw6500": ("parallelspec", [*RAW, "data.max_conversations=6500"]),
    "raw10k": ("parallelspec", [*RAW, "data.max_conversations=10000"]),
    "every": ("parallelspec", EVERY),
    "every-long": ("parallelspec", [*EVERY, *LONG]),
    "raw4500-long": ("parallelspec", [*RAW, "data.max_conversations=4500", *LONG]),
    # part (b) at the size one session could label: the ~2.7k row at 1.5x the main job's steps (rows seen ~4 times);
    # measured 3.5-4.6 s a step in fp32 on an AVX-512 host without bf16 (data_scaling.md), so ~80 minutes there
    "raw2700-1200": ("parallelspec", [*RAW, "data.max_conversations=2700", "trainer.max_steps=1200",
                                      "trainer.max_minutes=180"]),
    "sd840": ("parallelspec", ["data=selfdistill", "data.max_conversations=840", "data.self_distill_minutes=null"]),
    "sd2700": ("parallelspec", ["data=selfdistill", "data.max_conversations=2700", "data.self_distill_minutes=null"]),
    "e3-raw690": ("eagle3", [*RAW, "data.max_conversations=690"]),
    "e3-raw4500": ("eagle3", [*RAW, "data.max_conversations=4500"]),
    "e3-every": ("eagle3", EVERY),
}
PROMPTS = {"mt_bench": dict(prompt_stride=5), "gsm8k": dict(prompt_stride=1)}
START, END = "<!-- data_scaling table: start -->", "<!-- data_scaling table: end -->"


def run_dir(out_root: Path, row: str) -> Path:
    return out_root / row


def merge_overrides(*groups: list[str]) -> list[str]:
    """``key=value`` overrides in order, a later value of a key replacing an earlier one in place (Hydra refuses
    the same key twice; it applies config-group picks such as ``data=sharegpt`` before values wherever they stand)."""
    out: dict[str, str] = {}
    for group in groups:
        for o in group:
            k, _, v = o.partition("=")
            out[k] = v
    return [f"{k}={v}" for k, v in out.items()]


def train_command(row: str, out_root: Path, extra: list[str]) -> list[str]:
    """The ``accelerate launch train.py`` argv of one row: its recipe, COMMON, the row's overrides, ``extra``."""
    if row not in ROWS:
        raise SystemExit(f"unknown row {row!r}; choose from {sorted(ROWS)}")
    recipe, overrides = ROWS[row]
    overrides = [o.replace("{out_root}", str(out_root)) for o in overrides]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml", "train.py",
            f"+recipe={recipe}", *merge_overrides(COMMON, overrides, [f"output_dir={run_dir(out_root, row)}",
                                                                      f"run_name=scaling-{row}"], extra)]  # fmt: skip


def every_conversation(out_root: Path, per_bucket: int = 8) -> Path:
    """``out_root/sharegpt_every.jsonl``: every ShareGPT conversation the package holds, in its order, but those whose
    first user turn is one of ``phase=lengths``' prompts (:func:`length_prompts`), so the largest row never trains on
    the prompts it is measured on. Written once (atomically); the same file on every call."""
    from transformers import AutoTokenizer

    from drafttrain.atomic import atomic_write_text
    from drafttrain.config import TargetConfig
    from drafttrain.data.sources import load_conversations
    from drafttrain.target import resolve_target_dir

    path = out_root / "sharegpt_every.jsonl"
    if path.is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target_dir(TargetConfig())))
    held = {json.loads(line)["messages"][-1]["content"] for p in length_prompts(tokenizer, out_root, per_bucket).values()
            for line in p.read_text().splitlines()}  # fmt: skip
    kept = []
    for conv in load_conversations("sharegpt", max_conversations=100_000):
        first = next((m["content"] for m in conv["messages"] if m["role"] == "user"), None)
        if first not in held:
            kept.append(json.dumps({"id": conv["id"], "messages": conv["messages"]}))
    out_root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(kept) + "\n")
    print(f"{path}: {len(kept)} conversations (those of the {len(held)} prompt-length prompts left out)")
    return path


def cmd_train(row: str, out_root: Path, extra: list[str]) -> None:
    if ROWS.get(row, ("", []))[1][:len(EVERY)] == EVERY:
        every_conversation(out_root)
    cmd = train_command(row, out_root, extra)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode != 0:
        raise SystemExit(f"training {row} failed ({proc.returncode})")
    out = run_dir(out_root, row)
    launch = out / "bench_command.json"  # every launch of the row (a resumed one has several)
    prev = json.loads(launch.read_text()) if launch.is_file() else {"launches": []}
    prev["launches"].append({"argv": [str(a).replace(f"{REPO}/", "") for a in cmd[2:]], "wall_seconds": round(time.time() - t0, 1)})
    launch.write_text(json.dumps(prev, indent=1))


def load_for_eval(out: Path, dtype: str):
    """(config, target, drafter) of a finished row with the target loaded in ``dtype`` (``float32``: the dtype whose
    engine output equals plain greedy decoding token for token; a bf16 target's batched verification rounds
    differently from its plain steps: docs/benchmarks/data_scaling.md)."""
    import dataclasses

    import torch

    from drafttrain.compose import build_run
    from drafttrain.config import upgrade_saved
    from drafttrain.validation import validate

    c = validate(upgrade_saved(json.loads((out / "config.json").read_text())))
    c = dataclasses.replace(c, target=dataclasses.replace(c.target, dtype=dtype))
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    built = build_run(c, drafter=out / "drafter", pack=False)
    return c, built.target, built.drafter


def cmd_eval(row: str, out_root: Path, num_prompts: int, max_new_tokens: int, dtype: str = "float32") -> dict:
    """The saved drafter on MT-bench and GSM8K (chain and tree, no SSSD, batch 16), the target in ``dtype``:
    ``<row>/eval_scaling.json`` (``eval_scaling_<dtype>.json`` for another dtype than float32)."""
    import dataclasses

    from drafttrain.eval import in_training

    out = run_dir(out_root, row)
    c, target, drafter = load_for_eval(out, dtype)
    path = out / ("eval_scaling.json" if dtype == "float32" else f"eval_scaling_{dtype}.json")
    result = json.loads(path.read_text()) if path.is_file() else {}  # resumes per prompt set
    for prompts, extra in PROMPTS.items():
        if prompts in result:
            continue
        se = dataclasses.replace(c.trainer.spec_eval, prompts=prompts, num_prompts=num_prompts, prompt_offset=0,
                                 max_new_tokens=max_new_tokens, batch_size=16, chain=True, latency_prompts=0, **extra,
                                 drafter_alone=False,  # sssd none: the chain run is the drafter alone
                                 tree=dataclasses.replace(c.trainer.spec_eval.tree, widths=[4, 2, 1, 1, 1], budget=8,
                                                          plan=False),  # τ only: no planned (timed) run
                                 sssd=dataclasses.replace(c.trainer.spec_eval.sssd, source="none"))  # fmt: skip
        c2 = dataclasses.replace(c, output_dir=str(out / f"eval_scaling_{dtype}_{prompts}"),
                                 trainer=dataclasses.replace(c.trainer, spec_eval=se, progress=False))  # fmt: skip
        Path(c2.output_dir).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        r = in_training.spec_eval(c2, target, drafter)
        result[prompts] = {**r, "seconds": round(time.time() - t0, 1)}
        path.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({prompts: {k: r.get(k) for k in ("eval/tau", "eval/tau_chain", "eval/greedy_equal")}}, default=str))
    return result


#: Prompt-length buckets of ``phase=lengths`` (prompt tokens, the chat template included), ShareGPT first turns
#: from conversation LENGTH_POOL_START on (never in any row: the largest reads the first 6500).
LENGTH_BUCKETS = {"le512": (1, 512), "512-2k": (513, 2048), "2k-4k": (2049, 4096)}
LENGTH_POOL_START = 8000


def length_prompts(tokenizer, out_root: Path, per_bucket: int) -> dict[str, Path]:
    """``per_bucket`` ShareGPT first-turn prompts per :data:`LENGTH_BUCKETS` bucket, written as jsonl files
    (``messages``) under ``out_root/prompts``; the same files on every call (the first that fit, in file order)."""
    from drafttrain.data.sources import load_conversations
    from drafttrain.data.template import prompt_ids

    folder = out_root / "prompts"
    paths = {b: folder / f"{b}.jsonl" for b in LENGTH_BUCKETS}
    if all(p.is_file() for p in paths.values()):
        return paths
    picked: dict[str, list[dict]] = {b: [] for b in LENGTH_BUCKETS}
    seen: set[str] = set()  # ShareGPT repeats some conversations: each prompt once
    for conv in load_conversations("sharegpt", max_conversations=30000)[LENGTH_POOL_START:]:
        msgs = conv["messages"]
        first = [m for m in msgs if m["role"] == "system"] + [next(m for m in msgs if m["role"] == "user")]
        if first[-1]["content"] in seen:
            continue
        seen.add(first[-1]["content"])
        n = len(prompt_ids(tokenizer, first))
        for b, (lo, hi) in LENGTH_BUCKETS.items():
            if lo <= n <= hi and len(picked[b]) < per_bucket:
                picked[b].append({"id": conv["id"], "messages": first, "prompt_tokens": n})
        if all(len(v) == per_bucket for v in picked.values()):
            break
    folder.mkdir(parents=True, exist_ok=True)
    for b, rows in picked.items():
        paths[b].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def cmd_lengths(row: str, out_root: Path, per_bucket: int, max_new_tokens: int) -> dict:
    """τ by prompt length: the saved drafter's chain (and tree) on :data:`LENGTH_BUCKETS` prompts, 8 at a time
    (``<row>/eval_lengths.json``, resumable per bucket)."""
    import dataclasses

    from drafttrain.eval import in_training

    out = run_dir(out_root, row)
    c, target, drafter = load_for_eval(out, "float32")
    paths = length_prompts(target.tokenizer, out_root, per_bucket)
    path = out / "eval_lengths.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    for bucket, prompts in paths.items():
        if bucket in result:
            continue
        se = dataclasses.replace(c.trainer.spec_eval, prompts=str(prompts), num_prompts=per_bucket, prompt_offset=0,
                                 prompt_stride=1, max_new_tokens=max_new_tokens, batch_size=8, chain=True,
                                 latency_prompts=0, drafter_alone=False,
                                 tree=dataclasses.replace(c.trainer.spec_eval.tree, widths=[4, 2, 1, 1, 1], budget=8, plan=False),
                                 sssd=dataclasses.replace(c.trainer.spec_eval.sssd, source="none"))  # fmt: skip
        c2 = dataclasses.replace(c, output_dir=str(out / f"eval_lengths_{bucket}"),
                                 trainer=dataclasses.replace(c.trainer, spec_eval=se, progress=False))  # fmt: skip
        Path(c2.output_dir).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        r = in_training.spec_eval(c2, target, drafter)
        lengths = [json.loads(line)["prompt_tokens"] for line in prompts.read_text().splitlines()]
        result[bucket] = {**r, "seconds": round(time.time() - t0, 1), "prompt_tokens": lengths}
        path.write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({bucket: {k: r.get(k) for k in ("eval/tau", "eval/tau_chain", "eval/greedy_equal")}}, default=str))
    return result


def summarize(out_root: Path, row: str) -> dict | None:
    out = run_dir(out_root, row)
    if not (out / "final_metrics.json").is_file():
        return None
    final = json.loads((out / "final_metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "train/loss" in r]
    ev = json.loads((out / "eval_scaling.json").read_text()) if (out / "eval_scaling.json").is_file() else {}
    launch = out / "bench_command.json"

    def dec(prompts: str) -> dict:
        r = ev.get(prompts, {})
        return {"chain_tau": r.get("eval/tau_chain"), "tree_tau": r.get("eval/tau"),
                "greedy_equal": r.get("eval/greedy_equal"), "chain_accept_hist": r.get("eval/accept_hist_chain"),
                "prompts": r.get("eval/prompts")}  # fmt: skip

    last = train_rows[-1] if train_rows else {}
    lens = json.loads((out / "eval_lengths.json").read_text()) if (out / "eval_lengths.json").is_file() else {}
    return {
        "by_prompt_length": {b: {"chain_tau": r.get("eval/tau_chain"), "tree_tau": r.get("eval/tau"),
                                 "greedy_equal": r.get("eval/greedy_equal"), "prompts": len(r.get("prompt_tokens", [])),
                                 "prompt_tokens_median": sorted(r["prompt_tokens"])[len(r["prompt_tokens"]) // 2]
                                 if r.get("prompt_tokens") else None} for b, r in lens.items()},  # fmt: skip
        "row": row,
        "recipe": ROWS[row][0],
        "overrides": ROWS[row][1],
        "launches": json.loads(launch.read_text())["launches"] if launch.is_file() else None,
        "train_rows": final.get("train_rows"),
        "samples": final.get("samples"),
        "epochs": final["samples"] / final["train_rows"] if final.get("train_rows") else None,
        "steps": final.get("step"),
        "train_seconds": final.get("train_seconds"),
        "train_tau_sim_last": last.get("train/tau_sim"),
        "train_acc_0_last": last.get("train/acc_0"),
        "heldout_tau_sim": final.get("eval/tau_sim"),
        "heldout_acc": {k.split("/")[1]: v for k, v in final.items() if k.startswith("eval/acc_")},
        "gap_tau_sim": (last.get("train/tau_sim") - final["eval/tau_sim"]) if last.get("train/tau_sim") and final.get("eval/tau_sim") else None,
        "heldout_curve": [(r["step"], r["eval/tau_sim"], r.get("eval/acc_0")) for r in rows if "eval/tau_sim" in r],
        "mt_bench": dec("mt_bench"),
        "gsm8k": dec("gsm8k"),
        "host": final.get("launch", {}).get("host"),
    }


def plot(rows: list[dict], dest: Path) -> Path | None:
    """Left: decoded τ against unique training rows, one line per recipe at the main job's 800 steps, the longer
    runs (part (b)) as stars at their rows; right: each row's held-out τ_sim against the training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = [r for r in rows if r["row"] != "sd840" and not r["row"].startswith("sd") and r["mt_bench"]["chain_tau"] is not None]
    if not raw:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for recipe in sorted({r.get("recipe", "parallelspec") for r in raw}):
        short = sorted((r for r in raw if r.get("recipe", "parallelspec") == recipe and r["steps"] == 800),
                       key=lambda r: r["train_rows"])  # fmt: skip
        if short:
            xs = [r["train_rows"] for r in short]
            a.plot(xs, [r["mt_bench"]["chain_tau"] for r in short], "o-", label=f"{recipe}: MT-bench chain")
            a.plot(xs, [r["gsm8k"]["chain_tau"] for r in short], "s:", label=f"{recipe}: GSM8K chain")
            a.plot(xs, [r["mt_bench"]["tree_tau"] for r in short], "^--", label=f"{recipe}: MT-bench tree")
        for r in (r for r in raw if r.get("recipe", "parallelspec") == recipe and r["steps"] != 800):
            a.plot([r["train_rows"]], [r["mt_bench"]["chain_tau"]], "*", ms=12, label=f"{recipe}: MT-bench chain, {r['steps']} steps")
            a.plot([r["train_rows"]], [r["mt_bench"]["tree_tau"]], "P", ms=9, label=f"{recipe}: MT-bench tree, {r['steps']} steps")
    a.set_xscale("log")
    a.set_xlabel("unique training rows (800 steps x 8 unless marked)")
    a.set_ylabel("acceptance length τ (drafter alone, no SSSD)")
    a.set_title("τ against unique rows (ShareGPT, target-labelled)", fontsize=10)
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    for r in raw[:8]:
        c = r["heldout_curve"]
        b.plot([s for s, _, _ in c], [t for _, t, _ in c], "-", marker="o", ms=2, label=f"{r['row']} ({r['train_rows']} rows)")
    b.set_xlabel("step")
    b.set_ylabel("held-out τ_sim (the same 16 rows)")
    b.set_title("held-out τ_sim during training", fontsize=10)
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


def collect(out_root: Path, dest: Path) -> list[dict]:
    """Every row of :data:`ROWS` in order: its summary from its run folder where it is on this machine, else the
    row as ``dest``'s JSON last recorded it (a page keeps the rows measured in earlier sessions)."""
    previous = {}
    if dest.with_suffix(".json").is_file():
        previous = {r["row"]: r for r in json.loads(dest.with_suffix(".json").read_text()).get("rows", [])}
    rows = []
    for name in ROWS:
        r = summarize(out_root, name) or previous.get(name)
        if r is not None:
            r.setdefault("recipe", ROWS[name][0])
            rows.append(r)
    return rows


def cmd_report(out_root: Path, dest: Path) -> None:
    rows = collect(out_root, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    host = next((r["host"] for r in rows if r.get("host")), None)
    (dest.with_suffix(".json")).write_text(json.dumps({"common_overrides": COMMON, "rows": rows, "host": host}, indent=1))
    png = plot(rows, dest.with_suffix(".png"))

    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    lines = [START, "",
             "| row | unique train rows | epochs | held-out τ_sim | held-out acc_0 | train τ_sim (last window) | gap | "
             "MT-bench chain τ | GSM8K chain τ | MT-bench tree τ | GSM8K tree τ | = greedy | recipe | steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        eq = all(r[p]["greedy_equal"] for p in ("mt_bench", "gsm8k") if r[p]["greedy_equal"] is not None)
        lines.append(f"| {r['row']} | {r['train_rows']} | {f(r['epochs'], '{:.2f}')} | {f(r['heldout_tau_sim'])} | "
                     f"{f(r['heldout_acc'].get('acc_0'))} | {f(r['train_tau_sim_last'])} | {f(r['gap_tau_sim'])} | "
                     f"{f(r['mt_bench']['chain_tau'])} | {f(r['gsm8k']['chain_tau'])} | {f(r['mt_bench']['tree_tau'])} | "
                     f"{f(r['gsm8k']['tree_tau'])} | {eq} | {r['recipe']} | {r['steps']} |")  # fmt: skip
    for r in rows:
        if r["by_prompt_length"]:
            lines += ["", f"τ by prompt length, row {r['row']} (8 ShareGPT first turns per bucket from conversation "
                      f"{LENGTH_POOL_START} on, 8 at a time, 64 new tokens, the drafter alone and the tree, no SSSD):", "",
                      "| prompt tokens | prompts (median tokens) | chain τ | tree τ | = greedy |", "|---|---|---|---|---|"]  # fmt: skip
            for b, x in r["by_prompt_length"].items():
                lines.append(f"| {b} | {x['prompts']} ({x['prompt_tokens_median']}) | {f(x['chain_tau'])} | "
                             f"{f(x['tree_tau'])} | {x['greedy_equal']} |")  # fmt: skip
    lines += ["", END]
    md = dest.with_suffix(".md")
    text = md.read_text() if md.is_file() else f"# Data scaling\n\n{START}\n{END}\n"
    a, b = text.index(START), text.index(END) + len(END)
    md.write_text(text[:a] + "\n".join(lines) + text[b:])
    print("\n".join(lines))
    if png:
        print(f"plot: {png}")


@dataclass
class BenchDataScalingConfig:
    """Schema of ``python -m scripts.bench_data_scaling`` (key=value overrides, validated before any work)."""

    phase: str = "report"  # train | eval | lengths | report
    row: str = "raw690"
    out_root: str = "outputs/data_scaling"
    dest: str = "docs/benchmarks/data_scaling"
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides of the training run
    num_prompts: int = 16
    max_new_tokens: int = 128
    eval_dtype: str = "float32"  # phase=eval: the target's dtype while decoding (float32: greedy-equal; bfloat16 is not)
    per_bucket: int = 8  # phase=lengths: prompts per prompt-length bucket
    length_new_tokens: int = 64  # phase=lengths: new tokens per prompt


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    args = parse_cli(BenchDataScalingConfig, argv)
    out_root = Path(args.out_root)
    if args.phase == "train":
        cmd_train(args.row, out_root, args.overrides)
    elif args.phase == "eval":
        cmd_eval(args.row, out_root, args.num_prompts, args.max_new_tokens, args.eval_dtype)
    elif args.phase == "lengths":
        cmd_lengths(args.row, out_root, args.per_bucket, args.length_new_tokens)
    elif args.phase == "report":
        cmd_report(out_root, Path(args.dest))
    else:
        raise SystemExit(f"phase must be train|eval|lengths|report, got {args.phase!r}")


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
