"""Benchmark self-distillation generation on the real target; writes docs/benchmarks/generate_data.{json,md}.

Run each phase on its own (each takes < 10 minutes on a 2-core CPU):

    python -m scripts.bench_generate phase=sweep
    python -m scripts.bench_generate phase=full batch_size=32
    python -m scripts.bench_generate phase=backends   # the main job's self-distillation: hf vs engine backend
    python -m scripts.bench_generate phase=backends backends=[engine,vllm] backends_subset=32 backends_repeats=1  # vLLM beside ours
    python -m scripts.bench_generate phase=backends backends=[hf:plain,engine]  # a backend on other linear layers
    python -m scripts.bench_generate phase=backends backends=[engine:sdpa,engine]  # decode attention: sdpa vs drafttrain's kernel
    python -m scripts.bench_generate phase=report     # rewrite the page from the JSON

``sweep``: first turns of the first ``subset`` ShareGPT conversations at each of ``batch_sizes``, plus
batch size 1 on the first ``bs1_subset`` conversations (a short measurement: batch 1 is slow).
``full``: the first 200 ShareGPT conversations (first turn, max_new_tokens=256) to completion at one
batch size, with the code path of ``python -m scripts.generate_data generation.max_turns=1 ...``
(the same command; resumable, so it may be split over several invocations: the numbers add up).
Both record generated tokens/s, the time in prefill vs decode forwards (to size what packing the
prefill could save: its padding share of the prefill time), the padding ratio of the prefill batches
(padded slots / real prompt tokens), peak RSS and the machine's load average.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafttrain.target import fastattention


@dataclass
class BenchGenerateConfig:
    """Schema of ``python -m scripts.bench_generate`` (key=value overrides, validated before any work)."""

    phase: str = "sweep"  # sweep | full | backends | report
    # backends: engine | hf | vllm (vllm: bash scripts/install_vllm.sh); engine or hf may take a suffix :plain |
    # :onednn | :kernel, the target's linear layers for that backend's runs (default: as loaded, target.fast_linear=auto),
    # or :sdpa, decode attention on torch's sdpa instead of drafttrain's kernel (drafttrain.target.fastattention)
    backends: list[str] = field(default_factory=lambda: ["hf", "engine"])
    backends_subset: int = 128  # backends: first N ShareGPT conversations (the main job keeps ~82% of them)
    backends_repeats: int = 2  # backends: each backend this many times, alternating (A B, B A, ...)
    vllm_threads: str | None = None  # backends with vllm: VLLM_CPU_OMP_THREADS_BIND (null: every core)
    vllm_eager: bool = False  # backends with vllm: no torch.compile (shorter start-up, slower decoding)
    subset: int = 32  # sweep: first N conversations
    bs1_subset: int = 6  # sweep: first N conversations at batch size 1 (0 = none)
    batch_sizes: list[int] = field(default_factory=lambda: [8, 16, 32])  # sweep
    batch_size: int = 32  # full: the batch size (0: the sweep's best)
    conversations: int = 200  # full
    max_new_tokens: int = 256
    work: str = "data/bench_generate"
    threads: int | None = None  # torch intra-op threads (null: torch's default)
    max_minutes: float | None = None  # full: stop between shards after this long
    out: str = "docs/benchmarks/generate_data"  # <out>.json accumulates the phases' rows; <out>.md is the page


def _load(n: int):
    from drafttrain.data.sources import LoadStats, load_conversations

    stats = LoadStats(name="sharegpt")
    convs = load_conversations("sharegpt", max_conversations=n, stats=stats)
    return convs, stats


class ForwardTimer:
    """Wraps ``target.forward`` to add up seconds and slots of prefill (s > 1) and decode (s == 1) calls."""

    def __init__(self, target):
        self.target, self.inner = target, target.forward
        self.prefill_s = self.decode_s = 0.0
        self.prefill_slots = self.prefill_real = self.decode_rows = 0
        target.forward = self

    def __call__(self, input_ids, attention_mask=None, **kw):
        t0 = time.perf_counter()
        out = self.inner(input_ids, attention_mask=attention_mask, **kw)
        dt = time.perf_counter() - t0
        if input_ids.shape[1] > 1:
            self.prefill_s += dt
            self.prefill_slots += input_ids.numel()
            self.prefill_real += int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
        else:
            self.decode_s += dt
            self.decode_rows += input_ids.shape[0]
        return out

    def summary(self) -> dict:
        pad = (self.prefill_slots - self.prefill_real) / max(self.prefill_real, 1)
        return {
            "prefill_seconds": round(self.prefill_s, 1),
            "decode_seconds": round(self.decode_s, 1),
            "prefill_padding_ratio": round(pad, 4),
            "prefill_real_tokens": self.prefill_real,
            # packing the prefill removes at most its padded slots' share of prefill time (of the backbone's time here;
            # _run divides by the whole generation time instead)
            "packing_max_saving_seconds": round(self.prefill_s * pad / (1 + pad), 1),
        }


def _run(target, convs, batch_size: int, out_dir: Path, max_new_tokens: int, fresh: bool,
         max_minutes: float | None = None) -> dict:
    from drafttrain.config import GenerationConfig
    from drafttrain.data.selfdistill import generate_dataset

    if fresh:
        shutil.rmtree(out_dir, ignore_errors=True)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, max_turns=1, batch_size=batch_size)
    timer = ForwardTimer(target)
    load0 = os.getloadavg()[0]
    _, report = generate_dataset(target, convs, out_dir, gen, target_name="smollm2-135m-instruct", progress=True,
                                 desc=f"bs={batch_size}", max_seconds=60 * max_minutes if max_minutes else None)
    target.forward = timer.inner
    r = report["this_run"]
    summary = timer.summary()
    return {
        "batch_size": batch_size,
        "conversations": len(convs),
        "generated": report.get("generated", report.get("conversations_done")),
        "skipped": report.get("skipped"),
        "skip_reasons": report.get("skip_reasons"),
        "generated_tokens": r["generated_tokens"],
        "seconds": r["seconds"],
        "tokens_per_s": r["tokens_per_s"],
        "finish_reasons": report.get("finish_reasons"),
        "complete": report["complete"],
        "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
        **summary,
        "packing_max_saving_fraction": round(summary["packing_max_saving_seconds"] / max(r["seconds"], 1e-9), 4),
    }


def _answers(ds) -> dict[str, tuple[list[int], int]]:
    rows = ds.with_format(None).select_columns(["id", "input_ids", "num_prompt"])
    return {r["id"]: (list(r["input_ids"]), int(r["num_prompt"])) for r in rows}


def agreement(ref: dict, other: dict) -> dict:
    """How far ``other``'s rows agree with ``ref``'s (id -> (input_ids, num_prompt)), over the ids both have:
    rows identical token for token, and answer tokens agreeing before the first difference / ``ref``'s answer
    tokens (a greedy answer that differs once goes on differently: the prefix is what agrees)."""
    common = sorted(set(ref) & set(other))
    equal = sum(ref[i][0] == other[i][0] for i in common)
    agree = total = 0
    for i in common:
        (a, pa), (b, pb) = ref[i], other[i]
        if a[:pa] != b[:pb]:
            total += len(a) - pa
            continue
        n = 0
        for x, y in zip(a[pa:], b[pb:]):
            if x != y:
                break
            n += 1
        agree += n
        total += len(a) - pa
    return {"rows": len(common), "rows_equal": equal, "rows_equal_rate": round(equal / max(len(common), 1), 4),
            "answer_tokens": total, "answer_tokens_agreeing": agree, "token_agreement": round(agree / max(total, 1), 4),
            "rows_only_in_one": len(set(ref) ^ set(other))}  # fmt: skip


def _backends(target, args, work: Path) -> dict:
    """The main job's self-distillation (``data=selfdistill``: first turns, prompts <= 256 tokens, 128 new
    tokens, batch 64, one batch per shard, features kept) of the same conversations with each of
    ``args.backends``, alternating (A B C, C B A, ...); tokens/s = generated tokens / the job's seconds (for
    vllm these include the engine's start-up and the teacher-forced feature pass; its generation-only rate is
    kept beside). Rows are compared with our generator's greedy answers (``engine``; else the first backend)."""
    from drafttrain.config import VllmConfig
    from drafttrain.data.selfdistill import self_distill

    convs, _ = _load(args.backends_subset)
    names = list(args.backends)
    switch = None
    if any(n.partition(":")[2] not in ("", "sdpa") for n in names):  # per-run linear layers, same parameters (scripts.bench_forward_cost)
        from scripts.bench_forward_cost import LinearSwitch

        switch = LinearSwitch(target.model)
    order = [b for i in range(args.backends_repeats) for b in (names if i % 2 == 0 else names[::-1])]
    vcfg = VllmConfig(threads=args.vllm_threads, eager=args.vllm_eager)
    runs, outputs = [], {}
    for i, name in enumerate(order):
        backend, _, suffix = name.partition(":")
        linear = "" if suffix == "sdpa" else suffix
        if switch is not None:
            switch.use(linear or True)  # no suffix: the default backend, as build_run's target (fast_linear=auto) packs it
        out_dir = work / f"backends-{name.replace(':', '-')}-{i}"
        shutil.rmtree(out_dir, ignore_errors=True)
        load0 = os.getloadavg()[0]
        with fastattention.use("sdpa" if suffix == "sdpa" else "auto"):
            ds, report = self_distill(target, convs, out_dir, max_new_tokens=128, max_length=512, batch_size=64,
                                      max_prompt_length=256, backend=backend, progress=True, vllm=vcfg)  # fmt: skip
        r = report["this_run"]
        run = {"backend": name, "generated_tokens": r["generated_tokens"], "seconds": r["seconds"],
               "tokens_per_s": r["tokens_per_s"], "rows": len(ds),
               "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip
        if "vllm" in r:  # start-up, time inside vLLM's requests (generation only), version
            run["vllm"] = r["vllm"]
        runs.append(run)
        outputs.setdefault(name, _answers(ds))
        print(f"{name}: {r['tokens_per_s']} tokens/s ({r['generated_tokens']} tokens, {r['seconds']} s)", flush=True)
    if switch is not None:
        switch.use(True)
    tps = {b: sum(x["generated_tokens"] for x in runs if x["backend"] == b)
              / sum(x["seconds"] for x in runs if x["backend"] == b) for b in names}  # fmt: skip
    ref = "engine" if "engine" in names else names[0]
    out = {"backends": names, "runs": runs, "tokens_per_s": tps, "reference": ref,
           "agreement": {b: agreement(outputs[ref], outputs[b]) for b in names if b != ref},
           "conversations": len(convs), "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": f"python -m scripts.bench_generate phase=backends backends=[{','.join(names)}] "
                      f"backends_subset={args.backends_subset} backends_repeats={args.backends_repeats}"
                      + (" vllm_eager=true" if args.vllm_eager else "")}  # fmt: skip
    vl = [x["vllm"] for x in runs if "vllm" in x]
    if vl:
        gen_tokens = sum(x["generated_tokens"] for x in runs if "vllm" in x)
        out["vllm"] = {"version": vl[0].get("vllm_version"), "eager": args.vllm_eager,
                       "startup_seconds": [v.get("startup_seconds") for v in vl],
                       "generation_tokens_per_s": gen_tokens / max(sum(v.get("request_seconds", 0) for v in vl), 1e-9)}
    if "hf" in names and "engine" in names:  # the keys of the first measurement (hf vs engine)
        out["engine_vs_hf"] = tps["engine"] / tps["hf"]
        out["rows_equal"] = out["agreement"]["hf"]["rows_equal"]
        out["rows"] = out["agreement"]["hf"]["rows"]
    return out


def results_key(backends) -> str:
    """Where a backends comparison is kept in the JSON: ``backends`` for hf vs engine (the first measurement,
    kept as it was), ``backends_<a>_<b>...`` for any other set (a vLLM run never overwrites it)."""
    return "backends" if sorted(backends) == ["engine", "hf"] else "backends_" + "_".join(b.replace(":", "-") for b in backends)


def _machine() -> dict:
    """scripts.common.machine (drafttrain.host.describe + the load average) and this process's peak RSS."""
    from scripts.common import machine

    return {**machine(), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import ConfigError, parse_cli

    args = parse_cli(BenchGenerateConfig, argv)
    if args.phase not in ("sweep", "full", "backends", "report"):
        raise ConfigError(f"phase must be sweep, full, backends or report, got {args.phase!r}")
    if args.phase == "backends":
        from drafttrain.config import BACKENDS
        from drafttrain.generation.vllm_client import vllm_python

        bases = [b.partition(":")[0] for b in args.backends]
        linears = {b.partition(":")[2] for b in args.backends} - {""}
        if not args.backends or len(set(args.backends)) != len(args.backends) or set(bases) - set(BACKENDS):
            raise ConfigError(f"backends must be distinct names of {'|'.join(BACKENDS)}, got {args.backends}")
        if linears - {"plain", "onednn", "kernel", "sdpa"} or any(b.startswith("vllm:") for b in args.backends):
            raise ConfigError(f"a backend's suffix must be :plain, :onednn, :kernel or :sdpa (engine and hf only), got {args.backends}")
        if any(b.startswith("hf:sdpa") for b in args.backends):  # Target.generate never runs the engine's attention
            raise ConfigError(f"the :sdpa suffix is for the engine backend only (hf always runs sdpa), got {args.backends}")
        if "vllm" in args.backends and vllm_python() is None:
            raise ConfigError("backends=[...vllm] needs vLLM's venv: run `bash scripts/install_vllm.sh` (creates .venv-vllm)")
    path = Path(args.out).with_suffix(".json")
    results = json.loads(path.read_text()) if path.is_file() else {}
    if args.phase != "report":
        from drafttrain.config import TargetConfig
        from drafttrain.compose import build_run

        if args.threads:
            torch.set_num_threads(args.threads)
        target = build_run(TargetConfig(), dtype="float32").target  # fp32: this CPU has no fast bf16
        # warm-up (untimed): the first forward pages the weights in and builds the kernels
        target.generate([list(range(1, 65))] * 2, 4, return_features=False)
        work = Path(args.work)
        if args.phase == "backends":
            results[results_key(args.backends)] = _backends(target, args, work)
        elif args.phase == "sweep":
            convs, _ = _load(args.subset)
            rows = []
            if args.bs1_subset:
                rows.append(_run(target, convs[: args.bs1_subset], 1, work / "sweep-bs1", args.max_new_tokens, True))
            for bs in args.batch_sizes:
                rows.append(_run(target, convs, bs, work / f"sweep-bs{bs}", args.max_new_tokens, True))
            command = (f"python -m scripts.bench_generate phase=sweep subset={args.subset} bs1_subset={args.bs1_subset} "
                       f"batch_sizes=[{','.join(map(str, args.batch_sizes))}]" + (f" threads={args.threads}" if args.threads else ""))
            sweep = results.setdefault("sweep", {"rows": [], "commands": []})
            for r in rows:
                r["subset"] = args.bs1_subset if r["batch_size"] == 1 else args.subset
            keep = {(r["subset"], r["batch_size"]) for r in rows}  # measured again: replaces the old row
            sweep["rows"] = sorted([r for r in sweep["rows"] if (r.get("subset", args.subset), r["batch_size"]) not in keep] + [
                {**r, "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "command": command} for r in rows],
                key=lambda r: (r["batch_size"] > 1, r.get("subset", 0), r["batch_size"]))
            sweep["commands"] = list(dict.fromkeys(r["command"] for r in sweep["rows"]))  # those behind the rows kept
        else:
            if args.batch_size == 0:  # the best batch size of the sweep
                rows = [r for r in results.get("sweep", {}).get("rows", []) if r["batch_size"] > 1]
                widest = max((r.get("subset", 0) for r in rows), default=0)  # the subset that can fill the largest batches
                rows = [r for r in rows if r.get("subset", 0) == widest]
                args.batch_size = max(rows, key=lambda r: r["tokens_per_s"] or 0)["batch_size"] if rows else 32
                print(f"best batch size of the sweep: {args.batch_size}", flush=True)
            convs, stats = _load(args.conversations)
            row = _run(target, convs, args.batch_size, work / f"full-bs{args.batch_size}", args.max_new_tokens, False,
                       args.max_minutes)
            row["input_records"] = stats.read
            row["loader_skips"] = dict(stats.skipped)
            runs = results.setdefault("full", {}).setdefault(str(args.batch_size), {"invocations": []})
            runs["invocations"].append({**row, "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M")})
            report_path = work / f"full-bs{args.batch_size}" / "report.json"
            if row["complete"]:
                runs["report"] = json.loads(report_path.read_text())
            runs["command"] = (f"python -m scripts.bench_generate phase=full batch_size={args.batch_size}"
                               + (f" threads={args.threads}" if args.threads else "")
                               + (f" max_minutes={args.max_minutes}" if args.max_minutes else "")
                               + "   # repeated until complete (resumable)")
            runs["equivalent_cli"] = (f"python -m scripts.generate_data max_conversations={args.conversations} "
                                      f"generation.max_turns=1 generation.max_new_tokens={args.max_new_tokens} "
                                      f"generation.batch_size={args.batch_size} output_dir={work}/full-bs{args.batch_size}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
    from scripts.common import kept_analysis

    md = path.with_suffix(".md")
    analysis = kept_analysis(md)  # the hand-written section between <!-- analysis --> markers survives
    md.write_text(markdown(results).rstrip("\n") + "\n\n" + analysis + "\n")
    print(md.read_text())


def markdown(results: dict) -> str:
    from scripts.common import machine_line

    lines = ["# Self-distillation generation throughput (real target, CPU)", "",
             "SmolLM2-135M-Instruct, fp32 (this CPU has no fast bf16), ShareGPT first turns, greedy, "
             "`max_new_tokens=256`, `max_length=2048`, left-padded batches of prompts sorted by length, "
             "finished rows dropped from the batch and the KV cache, `max_batch_tokens=16384`, `max_padding=0.5`. "
             "tokens/s = generated tokens / wall seconds of generation (prefill included). "
             "Prefill / decode seconds time the backbone forwards only (`Target.forward` without the LM head); "
             "the rest is the LM head over 49,152 tokens, next-token selection, KV-cache compaction and writing shards. "
             "The machine is a shared 2-core VM: other jobs' load is recorded with each row.", ""]
    sweep = results.get("sweep")
    if sweep:
        lines += ["## Batch-size sweep", "", "```bash", *sweep["commands"], "```", "",
                  "| batch size | subset (first N conversations) | generated | generated tokens | seconds | **tokens/s** | prefill s | decode s | prefill padding | packing could save | torch threads | load avg (start, end) | date |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sweep["rows"]:
            lines.append(f"| {r['batch_size']} | {r.get('subset', '')} | {r['generated']} | {r['generated_tokens']} | {r['seconds']} | "
                         f"**{r['tokens_per_s']}** | {r['prefill_seconds']} | {r['decode_seconds']} | "
                         f"{100 * r['prefill_padding_ratio']:.1f}% | <= {100 * r['packing_max_saving_fraction']:.1f}% | "
                         f"{r['machine']['torch_threads']} | "
                         f"{r['loadavg_1min_start_end']} | {r['date']} |")
        lines += ["", "Batch size 1 runs on the first conversations of the subset only (a short measurement).", ""]
    for bs, runs in sorted(results.get("full", {}).items()):
        inv = runs["invocations"]
        if "report" not in runs:  # not finished yet
            lines += [f"## 200 ShareGPT conversations, batch size {bs}: in progress ({len(inv)} invocation(s))", ""]
            continue
        tokens = sum(r["generated_tokens"] for r in inv)
        seconds = sum(r["seconds"] for r in inv)
        rep = runs["report"]
        pre = sum(r["prefill_seconds"] for r in inv)
        dec = sum(r["decode_seconds"] for r in inv)
        lines += [f"## 200 ShareGPT conversations to completion, batch size {bs}", "", "```bash", runs["command"],
                  f"# same code path as: {runs['equivalent_cli']}", "```", "",
                  "| quantity | value |", "|---|---|",
                  f"| ShareGPT records read / skipped by the loader | {inv[0].get('input_records')} / "
                  f"{sum((inv[0].get('loader_skips') or {}).values())} {json.dumps(inv[0].get('loader_skips'))} |",
                  f"| conversations (input of generation) | {rep['input']} |",
                  f"| generated + skipped + failed | {rep['generated']} + {rep['skipped']} + {rep['failed']} |",
                  f"| skip reasons | {json.dumps(rep['skip_reasons'])} |",
                  f"| finish reasons | {json.dumps(rep['finish_reasons'])} |",
                  f"| generated tokens | {tokens} |",
                  f"| generation seconds (over {len(inv)} invocation(s)) | {seconds:.1f} |",
                  f"| **tokens/s** | **{tokens / max(seconds, 1e-9):.1f}** |",
                  f"| prefill / decode forward seconds | {pre:.1f} / {dec:.1f} |",
                  f"| prefill padding (padded slots / real prompt tokens) | {100 * inv[-1]['prefill_padding_ratio']:.1f}% (last invocation) |",
                  f"| most packing the prefill could save | {100 * max(r['packing_max_saving_fraction'] for r in inv):.1f}% of the time |",
                  f"| peak RSS | {max(r['machine']['peak_rss_mib'] for r in inv)} MiB |",
                  f"| load average (1 min) at start, end | {[r['loadavg_1min_start_end'] for r in inv]} |",
                  f"| date, machine | {inv[-1]['date']}, {machine_line(inv[-1]['machine'])}, {inv[-1]['machine']['cpus']} CPUs, "
                  f"{inv[-1]['machine']['torch_threads']} torch threads |",
                  ""]
    b = results.get("backends")
    if b:
        lines += ["## The main job's self-distillation: `Target.generate` (hf) vs the bundled engine", "",
                  "```bash", b["command"], "```", "",
                  f"First {b['conversations']} ShareGPT conversations with the main job's settings (first turns, prompts "
                  "<= 256 tokens, 128 new tokens, batch 64, one batch per shard, features kept): **hf** = "
                  "`Target.generate` (HF `DynamicCache`: every layer's keys/values concatenated each step, finished rows "
                  "compacted by copying), **engine** = `generation.backend=engine` (`drafttrain/generation/engine.py`: "
                  "the engine's preallocated ragged cache written in place, finished rows refilled). Runs alternate "
                  f"ABBA in one process; {b['date']}, {machine_line(b['machine'])}, {b['machine']['cpus']} CPUs.", "",
                  "| run | backend | generated tokens | seconds | tokens/s | load avg (start, end) |", "|---|---|---|---|---|---|"]
        for i, r in enumerate(b["runs"]):
            lines.append(f"| {i + 1} | {r['backend']} | {r['generated_tokens']} | {r['seconds']} | {r['tokens_per_s']} | "
                         f"{r['loadavg_1min_start_end']} |")  # fmt: skip
        lines += ["", f"**engine / hf: {b['engine_vs_hf']:.2f}x** ({b['tokens_per_s']['engine']:.1f} vs "
                      f"{b['tokens_per_s']['hf']:.1f} tokens/s); rows identical token for token: {b['rows_equal']} / {b['rows']}.", ""]
    for key in sorted(k for k in results if k.startswith("backends_")):
        lines += backends_markdown(results[key])
    return "\n".join(lines) + "\n"


def backends_markdown(b: dict) -> list[str]:
    from scripts.common import machine_line

    """The page's section of a backends comparison other than hf vs engine (e.g. ``backends=[engine,vllm]``)."""
    names, ref = b["backends"], b["reference"]
    load = [x for r in b["runs"] for x in r["loadavg_1min_start_end"]]
    idle = max(load, default=0) < 0.5 * max(b["machine"]["cpus"], 1)
    lines = [f"## The main job's self-distillation through {', '.join(names)}", "",
             "```bash", b["command"], "```", "",
             f"First {b['conversations']} ShareGPT conversations with the main job's settings (first turns, prompts "
             "<= 256 tokens, 128 new tokens, batch 64, one batch per shard, features kept). "
             + ("**vllm** = `generation.backend=vllm`: vLLM's CPU build in its own venv, one engine process for the job "
                "(its start-up is in the job's seconds), each shard's prompts in one request, greedy; features from a "
                "teacher-forced target forward over each finished row (also in the job's seconds). "
                if any(n.startswith("vllm") for n in names) else "")
             + f"Rows are compared with **{ref}** (our generator's greedy answers). "
             + ("A suffix names the target's linear layers for that backend's runs (**:plain** = `F.linear`, "
                "**:onednn** = oneDNN prepacked, **:kernel** = drafttrain's AVX2 kernel; none = the default, "
                "`target.fast_linear=auto`; **:sdpa** = the default linears, but one-query attention on torch's sdpa "
                "instead of drafttrain's decode-attention kernel, `drafttrain.target.fastattention`). " if any(":" in n for n in names) else "")
             + f"{b['date']}, {machine_line(b['machine'])}, {b['machine']['cpus']} CPUs; "
             + ("the machine was otherwise idle (1-min load average below half the cores)." if idle else
                f"1-min load averages {load}: a 2-thread job raises the load to ~2 itself, so this flags other jobs "
                "only when the first start value is high; runs alternate, compare within this table."), "",
             "| run | backend | generated tokens | job seconds | tokens/s (job) | vLLM start-up s | vLLM generation tok/s | load avg (start, end) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(b["runs"]):
        v = r.get("vllm") or {}
        gen_tps = f"{r['generated_tokens'] / v['request_seconds']:.1f}" if v.get("request_seconds") else "-"
        lines.append(f"| {i + 1} | {r['backend']} | {r['generated_tokens']} | {r['seconds']} | {r['tokens_per_s']} | "
                     f"{v.get('startup_seconds', '-')} | {gen_tps} | {r['loadavg_1min_start_end']} |")  # fmt: skip
    lines += ["", "| backend | tokens/s (job) | rows identical to " + ref + " | answer tokens agreeing (before the first difference) |",
              "|---|---|---|---|"]
    for n in names:
        a = b["agreement"].get(n)
        same = f"{a['rows_equal']} / {a['rows']} ({100 * a['rows_equal_rate']:.1f}%)" if a else "(reference)"
        tok = f"{a['answer_tokens_agreeing']} / {a['answer_tokens']} ({100 * a['token_agreement']:.1f}%)" if a else "-"
        lines.append(f"| {n} | {b['tokens_per_s'][n]:.1f} | {same} | {tok} |")
    if b.get("vllm"):
        v = b["vllm"]
        lines += ["", f"vLLM {v['version']} ({'eager' if v['eager'] else 'torch.compile'}): start-up "
                      f"{', '.join(f'{s:.0f}' for s in v['startup_seconds'] if s is not None)} s; inside its requests "
                      f"{v['generation_tokens_per_s']:.1f} generated tokens/s."]  # fmt: skip
    return lines + [""]


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
