"""Chaos run: the main job's pipeline on the tiny target, SIGKILLed at random points and relaunched with the
same command until it finishes, compared with the same pipeline run once without interruption.

    python -m scripts.chaos                                            # seed 0, 5 kills, into outputs/chaos
    python -m scripts.chaos seed=7 kills=3 out=outputs/chaos_seed7     # replay a draw: the same seed, the same kill points
    python -m scripts.chaos fresh_kernels=true out=outputs/chaos_kernels  # the CPU kernels build in each run: kills inside the build

The pipeline (one shell command, relaunched as it is): ``accelerate launch train.py +recipe=parallelspec
target=tiny resume=true ...`` (self-distillation into sharded data, the feature columns the drafter reads,
training steps with checkpoints, the held-out and speculative evaluation, ``drafter/``), then
``python -m scripts.export`` against the tiny target saved to disk (``train.py`` does not export a random
target that exists on no disk; ``gpu_cost_ratio`` is stated so K does not depend on this host's timing).
``out/uninterrupted`` and ``out/killed`` each hold their own ``run/``, ``data/`` (the self-distillation
cache) and ``target/``: nothing is shared.

Kill points: ``kills`` draws of (phase, fraction) from ``random.Random(seed)``: a phase of the uninterrupted
run (startup, kernel, generation, training, evaluation, export: the spans between the log lines in
:data:`PHASE_MARKERS`), and a fraction of its measured duration. Attempt ``i`` is SIGKILLed (its whole
process group) that long after its output reaches the drawn phase (or a later one: a resumed attempt skips
work already done). Each kill prints one line: number, drawn point, the phase the process was in
(:func:`observed_phase`: its last log line and the files present) and the seconds since the attempt started.

The comparison (:func:`compare_runs`) is exact except for :data:`EXCLUDED`, each entry with its reason.
Prints ``identical to the uninterrupted run`` (exit 0) or every difference (exit 1).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXPORT_MARK = "[chaos] export stage"

#: (phase, regex of the output line that starts it), in the pipeline's order. "startup" starts at launch.
PHASE_MARKERS: tuple[tuple[str, str | None], ...] = (
    ("startup", None),  # interpreter, imports, config, the target
    ("kernel", r"building drafttrain's \S+ kernel"),  # drafttrain's CPU kernels built (fresh_kernels) or loaded
    ("generation", r"\]\[drafttrain\.data\.pipeline\]"),  # conversations read, self-distillation shards written
    ("training", r"train sequences \d+"),  # steps, metrics rows, checkpoints every save_every
    ("evaluation", r"Saving current state to \S*step_{last}"),  # last checkpoints, held-out + speculative eval
    ("export", re.escape(EXPORT_MARK)),  # scripts.export: the engine folder and export_info.json
)

#: What may differ between the two runs, by file (glob, relative to the run's root) -> key globs (JSON keys,
#: nested keys dotted) or ``"*"`` (the whole file is not compared). Everything else must be equal, floats
#: bit for bit. Every entry is a measurement of time or of the process, or a record of one launch:
EXCLUDED: dict[str, tuple[str, ...]] = {
    # log lines: timestamps, and by design "resumed from ...", "removed an incomplete checkpoint folder"
    "run/train.log": ("*",),
    "launches.log": ("*",),  # this script's record of every launch's output
    # per-row timings and the process's peak memory (a resumed process did not generate the data)
    "run/metrics.jsonl": ("train/tokens_per_s", "train/seq_tokens_per_s", "train/seconds_per_step",
                          "train/peak_mem_mb", "eval/speedup*", "eval/*tokens_per_s*", "eval/compile_seconds*",
                          # the planner decides per step from the forward times it measures: its counters,
                          # its tau and the tree it verified follow this host's load
                          "eval/planner_b*", "eval/tau_planned", "eval/tau_b1", "eval/tree_nodes_per_step"),
    "run/final_metrics.json": ("train_seconds", "wall_seconds", "peak_memory_mb", "peak_mem_mb_per_rank",
                               "eval/speedup*", "eval/*tokens_per_s*", "eval/compile_seconds*", "eval/planner_b*",
                               "eval/tau_planned", "eval/tau_b1", "eval/tree_nodes_per_step",
                               "data_cut_by_time_budget.generated_tokens_per_s"),
    # the training seconds of the loop counters (TrainState): the clock, kept for optim.decay_over=minutes
    "run/checkpoints/*/meta.json": ("train_seconds",),
    "run/checkpoints/*/custom_checkpoint_0.pkl": ("*",),  # TrainState pickled: its train_seconds (meta.json has the rest)
    # self-distillation: generation seconds and speed (the time budget's probe), and what THIS launch did
    "data/selfdistill/*/manifest.json": ("shards.*.seconds", "budget.tokens_per_s", "budget.estimated_seconds"),
    "data/selfdistill/*/report.json": ("this_run", "this_run.*", "budget.tokens_per_s", "budget.estimated_seconds"),
    "data/selfdistill/*/*.lock": ("*",),  # the job lock: pid, host and start time of the launch holding it
    # the shards' arrow data is compared row by row (data/selfdistill/*/shard_*): datasets' cache bookkeeping
    "data/selfdistill/*/shard_*/state.json": ("_fingerprint",),
    # the final evaluation's SSSD datastore: how long building it took (its tokens and suffix array are compared)
    "run/eval_datastore/datastore.json": ("build_seconds",),
}


def excluded_keys(rel: str) -> tuple[str, ...]:
    """The key globs :data:`EXCLUDED` lists for the file ``rel`` (a path relative to the run's root)."""
    out: tuple[str, ...] = ()
    for pattern, keys in EXCLUDED.items():
        if fnmatch.fnmatch(rel, pattern):
            out += keys
    return out


# ==================================================================================================
# The comparison
# ==================================================================================================


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _json_diff(a: Any, b: Any, skip: tuple[str, ...], where: str) -> list[str]:
    """Differences between two JSON values, keys flattened with dots, ``skip`` globs left out."""
    fa, fb = _flat(a), _flat(b)
    out = []
    for k in sorted(set(fa) | set(fb)):
        if any(fnmatch.fnmatchcase(k, s) for s in skip):
            continue
        if k not in fa or k not in fb:
            out.append(f"{where}: {k} only in {'the uninterrupted run' if k in fa else 'the killed run'}")
        elif fa[k] != fb[k] or type(fa[k]) is not type(fb[k]):
            out.append(f"{where}: {k}: {fa[k]!r} (uninterrupted) vs {fb[k]!r} (killed)")
    return out


def _read_text(path: Path, root: Path) -> str:
    """The file's text with the run's root folder written ``<ROOT>`` (the two runs live in two folders)."""
    return path.read_text().replace(str(root.resolve()), "<ROOT>").replace(str(root), "<ROOT>")


def _safetensors_diff(fa: Path, fb: Path, rel: str) -> list[str]:
    from safetensors.torch import load_file

    try:
        ta, tb = load_file(str(fa)), load_file(str(fb))
    except Exception as err:  # a truncated file: the digest line says enough
        return [f"{rel}: bytes differ and a file cannot be read ({type(err).__name__}: {err})"]
    out = [f"{rel}: tensor {k} only in {'the uninterrupted run' if k in ta else 'the killed run'}"
           for k in sorted(set(ta) ^ set(tb))]  # fmt: skip
    for k in sorted(set(ta) & set(tb)):
        if ta[k].shape != tb[k].shape or ta[k].dtype != tb[k].dtype:
            out.append(f"{rel}: tensor {k}: {tuple(ta[k].shape)} {ta[k].dtype} vs {tuple(tb[k].shape)} {tb[k].dtype}")
        elif not ta[k].equal(tb[k]):
            d = (ta[k].double() - tb[k].double()).abs().max().item()
            out.append(f"{rel}: tensor {k} differs (max |diff| {d:.3g})")
    return out or [f"{rel}: bytes differ (tensors equal: header or layout)"]


def _shard_diff(da: Path, db: Path, rel: str) -> list[str]:
    import datasets

    a, b = datasets.load_from_disk(str(da)), datasets.load_from_disk(str(db))
    if a.column_names != b.column_names or len(a) != len(b):
        return [f"{rel}: {len(a)} rows {a.column_names} vs {len(b)} rows {b.column_names}"]
    out = []
    for i, (ra, rb) in enumerate(zip(a, b)):
        bad = [k for k in a.column_names if ra[k] != rb[k]]
        if bad:
            out.append(f"{rel}: row {i} differs in {bad}")
    return out


def _jsonl_diff(fa: Path, fb: Path, root_a: Path, root_b: Path, rel: str, skip: tuple[str, ...]) -> list[str]:
    ra = [json.loads(x) for x in _read_text(fa, root_a).splitlines() if x.strip()]
    rb = [json.loads(x) for x in _read_text(fb, root_b).splitlines() if x.strip()]
    out = []
    if len(ra) != len(rb):
        steps = lambda rows: [r.get("step") for r in rows if isinstance(r, dict)]  # noqa: E731
        out.append(f"{rel}: {len(ra)} rows (uninterrupted) vs {len(rb)} rows (killed); steps {steps(ra)} vs {steps(rb)}")
    for i, (x, y) in enumerate(zip(ra, rb)):
        tag = f"{rel} row {i + 1}" + (f" (step {x['step']})" if isinstance(x, dict) and "step" in x else "")
        out += _json_diff(x, y, skip, tag)
    return out


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or (p.is_dir() and not any(p.iterdir()))}


def compare_runs(a: str | Path, b: str | Path) -> list[str]:
    """Every difference between two pipeline roots (``run/``, ``data/``, ``target/`` under each), as lines.

    Compared: the same set of files (no stray temporary folder, no missing output); JSON and JSON-lines files
    key by key, floats exactly (``metrics.jsonl``: the same rows in the same order, each step once); every
    self-distillation shard row by row (``input_ids``, ``loss_mask``, ``features``); safetensors, optimizer and
    every other file bit for bit (sha256; a weights file that differs names its tensors). The run's root folder
    is written ``<ROOT>`` in text files first. Left out: :data:`EXCLUDED` only.

    Args:
        a: the uninterrupted run's root; b: the killed run's root (folders; missing files are differences).

    Returns:
        the differences (empty: identical), each naming the file, the row or key, and both values.
    """
    a, b = Path(a), Path(b)
    fa, fb = _files(a), _files(b)
    out = [f"{rel}: only in the uninterrupted run" for rel in sorted(fa - fb) if excluded_keys(rel) != ("*",)]
    out += [f"{rel}: only in the killed run" for rel in sorted(fb - fa) if excluded_keys(rel) != ("*",)]
    shard_files = re.compile(r"^(data/selfdistill/[^/]+/shard_\d+)/(data-\d+-of-\d+\.arrow|dataset_info\.json)$")
    shards_done: set[str] = set()
    for rel in sorted(fa & fb):
        pa, pb = a / rel, b / rel
        skip = excluded_keys(rel)
        if "*" in skip or pa.is_dir():
            continue
        if m := shard_files.match(rel):  # rows, not arrow bytes
            if m.group(1) not in shards_done:
                shards_done.add(m.group(1))
                out += _shard_diff(a / m.group(1), b / m.group(1), m.group(1))
            continue
        if rel.endswith(".jsonl"):
            out += _jsonl_diff(pa, pb, a, b, rel, skip)
        elif rel.endswith(".json"):
            try:
                ja, jb = json.loads(_read_text(pa, a)), json.loads(_read_text(pb, b))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                out.append(f"{rel}: not JSON in one run ({err})")
                continue
            out += _json_diff(ja, jb, skip, rel)
        elif _digest(pa) != _digest(pb):
            if rel.endswith(".safetensors"):
                out += [f"{rel}: sha256 differs"] + _safetensors_diff(pa, pb, rel)
            elif rel.endswith((".txt", ".yaml", ".sh")) and _read_text(pa, a) == _read_text(pb, b):
                continue  # equal once the root folder is written <ROOT>
            else:
                out.append(f"{rel}: sha256 differs ({_digest(pa)[:12]} vs {_digest(pb)[:12]})")
    return out


# ==================================================================================================
# The pipeline, its launches and the kills
# ==================================================================================================


@dataclass
class ChaosConfig:
    """A chaos run (see the module docstring)."""

    out: str = "outputs/chaos"  # holds uninterrupted/ and killed/ (each: run/, data/, target/)
    seed: int = 0  # draws the kill points: the same seed, the same points
    kills: int = 5  # SIGKILLs of the killed run (one per launch; then a last launch finishes it)
    max_steps: int = 12  # training steps of the tiny run
    save_every: int = 3  # a checkpoint every this many steps
    # decoder layers of the tiny target (conf/target/tiny.yaml has 2): the export of the main job's EAGLE-3
    # drafter reads 3 distinct target layers, so a 2-layer target trains but cannot be exported
    target_layers: int = 3
    generation_batch: int = 4  # conversations per self-distillation shard (several shards, so kills land between them)
    launch_timeout_s: int = 900  # one launch longer than this is killed and the chaos run fails
    overwrite: bool = False  # remove an existing out/ first
    # a fresh torch extensions folder per run (out/kernels_<run>, not compared): the kernels build in the first
    # launch, so a kill can land inside the build (torch's lock file left behind must not block the next launch)
    fresh_kernels: bool = False


def pipeline_command(root: Path, c: ChaosConfig) -> str:
    """The pipeline's shell command for the run rooted at ``root`` (the same for every launch)."""
    train = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/cpu.yaml", "train.py",
             "+recipe=parallelspec", "target=tiny", f"target.num_hidden_layers={c.target_layers}", f"output_dir={root / 'run'}", f"data.cache_dir={root / 'data'}",
             "resume=true", f"trainer.max_steps={c.max_steps}", f"trainer.save_every={c.save_every}",
             "trainer.log_every=1", "trainer.num_threads=1", "trainer.progress=false", "logging.wandb=false",
             f"data.generation.batch_size={c.generation_batch}"]  # fmt: skip
    export = [sys.executable, "-m", "scripts.export", f"checkpoint={root / 'run'}", f"target_path={root / 'target'}",
              f"output_dir={root / 'run' / 'export'}", "overwrite=true", "gpu_cost_ratio=0.1"]  # fmt: skip
    line = f"{shlex.join(train)} && echo {shlex.quote(EXPORT_MARK)} && {shlex.join(export)}"
    if c.fresh_kernels:  # beside the run's root, so compare_runs never sees it
        line = f"export TORCH_EXTENSIONS_DIR={shlex.quote(str(root.parent / ('kernels_' + root.name)))}; {line}"
    return line


def save_tiny_target(folder: Path, layers: int) -> None:
    """``target=tiny`` (conf/target/tiny.yaml, seeded: the same weights every time) with ``layers`` decoder
    layers, saved as an HF folder."""
    from omegaconf import OmegaConf

    from drafttrain.compose import build_run
    from drafttrain.config import TargetConfig

    cfg = TargetConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "target" / "tiny.yaml")))
    cfg.num_hidden_layers = layers
    target = build_run(cfg).target
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)


@dataclass
class Launch:
    """One launch of the pipeline: exit status, whether we killed it, seconds, its output lines with times."""

    rc: int
    killed: bool
    seconds: float
    lines: list[tuple[float, str]]
    phase: str | None = None  # observed when killed


def _markers(c: ChaosConfig) -> list[tuple[str, re.Pattern | None]]:
    last = f"{c.max_steps:07d}"
    return [(name, re.compile(rx.replace("{last}", last)) if rx else None) for name, rx in PHASE_MARKERS]


def phase_times(lines: list[tuple[float, str]], c: ChaosConfig) -> dict[str, tuple[float, float]]:
    """(start, end) seconds after launch of every phase of an uninterrupted launch's output."""
    starts: dict[str, float] = {}
    for name, rx in _markers(c):
        if rx is None:
            starts[name] = 0.0
            continue
        t = next((t for t, line in lines if rx.search(line)), None)
        if t is None:
            raise RuntimeError(f"the uninterrupted run's output has no line marking its {name} phase ({rx.pattern})")
        starts[name] = t
    names = list(starts)
    end = lines[-1][0] if lines else 0.0
    return {n: (starts[n], starts[names[i + 1]] if i + 1 < len(names) else end) for i, n in enumerate(names)}


def observed_phase(root: Path, lines: list[str], c: ChaosConfig) -> str:
    """The phase a launch was in, from its output so far (``lines``) and the files under ``root``."""
    text = "\n".join(lines)
    last = next((x for x in reversed(lines) if x.strip()), "")
    run, ck = root / "run", root / "run" / "checkpoints"
    if EXPORT_MARK in text:
        files = sorted(p.name for p in (run / "export").glob("*")) if (run / "export").is_dir() else []
        return f"export (export/ holds {files or 'nothing yet'})"
    tmp = sorted(p.name for p in ck.glob(".tmp_step_*")) + sorted(p.name for p in ck.glob(".old_step_*"))
    if tmp or re.search(r"Saving current state|Model weights saved|Optimizer state saved|Scheduler state saved|"
                        r"Random states saved|Saving the state of", last):  # fmt: skip
        return f"checkpoint write ({', '.join(tmp) or last.split(' to ')[-1].strip()})"
    if not re.search(r"train sequences \d+", text):
        if not re.search(r"\]\[drafttrain\.data\.pipeline\]", text):
            if re.search(r"building drafttrain's \S+ kernel", last):
                return f"kernel build ({last.split(' kernel ')[-1].split(' ')[0]})"
            return "startup (interpreter, imports, config, target)"
        jobs = list((root / "data" / "selfdistill").glob("*/manifest.json"))
        done = len(json.loads(jobs[0].read_text()).get("shards", {})) if jobs else 0
        partial = list((root / "data" / "selfdistill").glob("*/.tmp_shard_*"))
        return f"generation ({done} shards recorded{', one being written' if partial else ''})"
    if not re.search(r"resumed from|starting fresh", text):
        return "training (building the drafter, loading the checkpoint)"
    metrics = run / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    steps = sum(1 for r in rows if "train/loss" in r)
    if steps < c.max_steps:
        return f"training step {steps + 1}"
    return "evaluation (held-out metrics, final checkpoint, drafter/, speculative evaluation)"


def launch(cmd: str, root: Path, log_path: Path, c: ChaosConfig, kill_at: tuple[str, float] | None = None) -> Launch:
    """Run ``cmd`` (its own process group) until it exits, or SIGKILL the group ``kill_at[1]`` seconds after its
    output reaches phase ``kill_at[0]`` or a later one. Output goes to ``log_path`` and into ``Launch.lines``."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read():
        with log_path.open("a") as f:
            for line in proc.stdout:
                lines.append((time.monotonic() - t0, line.rstrip("\n")))
                f.write(line)
                f.flush()  # readable while the launch runs

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    names = [n for n, _ in PHASE_MARKERS]
    markers = _markers(c)
    fired_at, killed, phase = None, False, None
    while proc.poll() is None:
        now = time.monotonic() - t0
        if now > c.launch_timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"a launch ran past launch_timeout_s={c.launch_timeout_s}; its output: {log_path}")
        if kill_at is not None and fired_at is None:
            i = names.index(kill_at[0])
            seen = [t for t, line in list(lines) for _, rx in markers[i:] if rx is not None and rx.search(line)]
            if i == 0 or seen:
                fired_at = 0.0 if i == 0 else min(seen)
        if fired_at is not None and now >= fired_at + kill_at[1]:
            phase = observed_phase(root, [x for _, x in list(lines)], c)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = True
            break
        time.sleep(0.01)
    reader.join(timeout=30)
    if killed:  # the whole group is gone before the next launch starts
        for _ in range(500):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
    return Launch(proc.returncode, killed, time.monotonic() - t0, lines, phase)


def draw_kills(seed: int, kills: int, phases: dict[str, tuple[float, float]]) -> list[tuple[str, float]]:
    """``kills`` (phase, seconds into that phase) points: a phase uniformly, then a time uniformly over its
    span in the uninterrupted run (``phases``: :func:`phase_times`). Pure function of ``seed``'s draws."""
    rng = random.Random(seed)
    names = list(phases)
    out = []
    for _ in range(kills):
        name = rng.choice(names)
        start, end = phases[name]
        out.append((name, rng.random() * max(end - start, 0.0)))
    return out


def run(c: ChaosConfig) -> int:
    """The chaos run; returns the exit code (0: identical to the uninterrupted run, 1: a difference or a launch
    that failed without being killed).

    Raises:
        ConfigError: ``out`` is not empty and ``overwrite`` is false; ``kills`` < 0.
    """
    from drafttrain.config import ConfigError

    out = Path(c.out).expanduser().resolve()
    if c.kills < 0 or c.max_steps < 1 or c.save_every < 1:
        raise ConfigError(f"kills must be >= 0 and max_steps, save_every >= 1 (got {c.kills}, {c.max_steps}, {c.save_every})")
    if out.exists() and any(out.iterdir()):
        if not c.overwrite:
            raise ConfigError(f"out={out} is not empty: choose another folder or add overwrite=true (removes it)")
        shutil.rmtree(out)
    roots = {"uninterrupted": out / "uninterrupted", "killed": out / "killed"}
    for root in roots.values():
        root.mkdir(parents=True)
        save_tiny_target(root / "target", c.target_layers)
    print(f"[chaos] seed={c.seed} kills={c.kills} out={out}", flush=True)

    a = roots["uninterrupted"]
    first = launch(pipeline_command(a, c), a, a / "launches.log", c)
    if first.rc != 0:
        print(f"[chaos] the uninterrupted run failed (exit {first.rc}); its output: {a / 'launches.log'}", flush=True)
        return 1
    phases = phase_times(first.lines, c)
    print(f"[chaos] uninterrupted: {first.seconds:.1f} s; phases (s after launch): "
          + ", ".join(f"{n} {s:.1f}-{e:.1f}" for n, (s, e) in phases.items()), flush=True)  # fmt: skip
    points = draw_kills(c.seed, c.kills, phases)
    print("[chaos] kill points (phase + seconds into it): " + ", ".join(f"{n}+{t:.2f}" for n, t in points), flush=True)

    b = roots["killed"]
    cmd = pipeline_command(b, c)
    done, kills = False, 0
    for i, point in enumerate(points, 1):
        res = launch(cmd, b, b / "launches.log", c, kill_at=point)
        if res.killed:
            kills += 1
            print(f"[chaos] kill {i}: drawn {point[0]}+{point[1]:.2f} s; killed in {res.phase} at {res.seconds:.2f} s "
                  f"after launch {i}", flush=True)  # fmt: skip
        elif res.rc == 0:
            print(f"[chaos] kill {i}: drawn {point[0]}+{point[1]:.2f} s; launch {i} finished first "
                  f"({res.seconds:.1f} s): no kill", flush=True)  # fmt: skip
            done = True
            break
        else:
            tail = "\n".join(x for _, x in res.lines[-15:])
            print(f"[chaos] launch {i} failed on its own (exit {res.rc}), not killed: a resume bug?\n{tail}", flush=True)
            return 1
    if not done:
        res = launch(cmd, b, b / "launches.log", c)
        if res.rc != 0:
            tail = "\n".join(x for _, x in res.lines[-15:])
            print(f"[chaos] the last launch failed (exit {res.rc}): a resume bug?\n{tail}", flush=True)
            return 1
        print(f"[chaos] launch {len(points) + 1} finished ({res.seconds:.1f} s) after {kills} kills", flush=True)

    diffs = compare_runs(a, b)
    if diffs:
        print(f"[chaos] {len(diffs)} differences from the uninterrupted run (seed={c.seed}):", flush=True)
        for d in diffs:
            print(f"  {d}", flush=True)
        return 1
    print(f"[chaos] {kills} kills, seed={c.seed}: identical to the uninterrupted run", flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    code = run(parse_cli(ChaosConfig, argv))
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
