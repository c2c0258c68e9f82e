"""Helpers shared by the benchmark scripts (the only module under ``scripts/`` that others import).

- :func:`run_eval`: one harness run (``conf/evaluate.yaml`` + overrides), in-process.
- :func:`cached` / :func:`recipe_runs`: resume after an interruption; one training run folder per recipe.
- :func:`median_ms`: warm-up + median wall time of a callable.
- :func:`machine` / :func:`machine_line`: what the numbers were measured on.
- :func:`reproduce` / :func:`kept_analysis` / :func:`write_report`: the page under ``docs/benchmarks/``:
  its JSON, its markdown with the command that reproduces it (from the repository root, no absolute
  paths) and the hand-written section between ``<!-- analysis -->`` markers kept across re-runs.
- :func:`run_bench`: the whole ``main()`` of a benchmark script built from those pieces.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ANALYSIS = re.compile(r"<!-- analysis -->.*?<!-- /analysis -->", re.S)
REPO = Path(__file__).resolve().parents[1]


# ==================================================================================================
# Running the harness, resuming
# ==================================================================================================


def run_eval(overrides: list[str]) -> dict:
    """Compose ``conf/evaluate.yaml`` with Hydra ``overrides`` and run the harness (returns results.json's dict).

    Raises:
        ConfigError: an unknown key or a bad value (before any model loads).
    """
    from drafttrain.cliconfig import parse_cli
    from drafttrain.validation import eval_schema, validate_eval
    from drafttrain.eval.harness import evaluate

    return evaluate(validate_eval(parse_cli(eval_schema(), overrides, config_name="evaluate")))


def cached(path: Path, compute: Callable[[], Any]) -> Any:
    """``compute()``'s result, kept as JSON at ``path``: computed once, read back on every later call
    (how the benchmark scripts resume after an interruption)."""
    if not path.exists():
        res = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res))
    return json.loads(path.read_text())


def recipe_runs(runs: str | Path, recipes: list[str]) -> Iterator[tuple[str, Path]]:
    """(recipe, training run folder) for every recipe with a saved drafter under ``runs`` (others are skipped, said on stderr)."""
    for recipe in recipes:
        ckpt = Path(runs) / recipe
        if (ckpt / "drafter").is_dir():
            yield recipe, ckpt
        else:
            print(f"skipping {recipe}: no training run at {ckpt}", file=sys.stderr)


def load_sequences(
    path: str | Path, num: int | None, max_continuation: int, offset: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs from a jsonl of rows with ``input_ids`` and ``loss_mask``
    (:func:`drafttrain.verify.methods.sssd_datastore.first_answer_split`), continuation cut to ``max_continuation``;
    the first ``offset`` usable rows are skipped, then at most ``num`` are returned.

    Raises:
        FileNotFoundError: no such file.
    """
    from drafttrain.verify.methods.sssd_datastore import first_answer_split

    out = []
    with open(Path(path).expanduser()) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            split = first_answer_split(row["input_ids"], row["loss_mask"])
            if split is None:
                continue
            if offset > 0:
                offset -= 1
                continue
            out.append((split[0], split[1][:max_continuation]))
            if num is not None and len(out) >= num:
                break
    return out


def load_run_config(run: str | Path) -> dict:
    """A training run's saved ``config.json`` as a dict, upgraded to the current keys (runs made before
    generation backends existed are marked ``hf``, the one backend they had); validate it after editing."""
    from drafttrain.config import upgrade_saved

    saved = upgrade_saved(json.loads((Path(run) / "config.json").read_text()))
    saved.setdefault("data", {}).setdefault("generation", {}).setdefault("backend", "hf")
    return saved


def run_train_data(c, target):
    """The training sequences of run config ``c`` with the features its drafter reads (the run's
    self-distillation cache: the same ``DRAFTTRAIN_CACHE``), e.g. for SSSD's datastore."""
    from accelerate import Accelerator

    from drafttrain.config import to_dict
    from drafttrain.data.pipeline import prepare_data
    from drafttrain.drafters import drafter_class, drafter_config

    layers = drafter_class(c.drafter.name).layers_for(drafter_config(c.drafter.name, to_dict(c)["drafter"]),
                                                       target.num_hidden_layers)  # fmt: skip
    return prepare_data(c, target, Accelerator(cpu=True), layers)[0]


def load_drafter(target, checkpoint: str | None, seed: int = 0, pack: bool = True):
    """The drafter to benchmark: ``Drafter.from_pretrained`` of ``checkpoint`` (a training run folder with
    ``drafter/``, or the drafter folder itself), or, when None, a fresh ParallelSpec drafter with the
    shipped drafter config (``conf/drafter/parallelspec.yaml``: its cost is a trained one's, its
    acceptance is not). ``pack``: on prepacked weights when the target is
    (:meth:`~drafttrain.drafters.base.Drafter.pack_for_inference`).

    Raises:
        FileNotFoundError: no drafter in ``checkpoint``.
    """
    from omegaconf import OmegaConf

    from drafttrain.compose import build_run

    if checkpoint:
        return build_run(None, target=target, drafter=checkpoint, pack=pack).drafter
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "drafter" / "parallelspec.yaml"), resolve=True)
    cfg.pop("name", None)
    return build_run(None, target=target, untrained_drafter=cfg, seed=seed, pack=pack).drafter


# ==================================================================================================
# Timing and the machine
# ==================================================================================================


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls, after one untimed warm-up call
    (page cache of memory maps, allocator, first-call overheads)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def machine() -> dict:
    """The machine a benchmark ran on: :func:`drafttrain.host.describe` (CPU model, ISA, native bf16, CPUs,
    cores, torch threads, OS, versions, GPU), the platform's processor name and the 1-minute load average."""
    from drafttrain.host import describe

    return {**describe(), "processor": platform.processor() or platform.machine(),
            "loadavg_1min": round(os.getloadavg()[0], 2)}  # fmt: skip


def machine_line(m: dict | None) -> str:
    """One line for a page from :func:`machine`'s dict, a harness run's ``host`` or one carrying it
    (:func:`drafttrain.host.summary`); a record made before that (no CPU model) says ``host not recorded``
    and the torch threads and version it has."""
    from drafttrain.host import summary

    m = (m or {}).get("host") or m or {}
    if m.get("cpu_model"):
        return summary(m)
    return f"host not recorded, {m.get('torch_threads', '?')} torch threads, torch {m.get('torch', '?')}"


# ==================================================================================================
# The page under docs/benchmarks/
# ==================================================================================================


def reproduce(script: str, argv: list[str] | None) -> str:
    """The command that reproduces a run of ``scripts.<script>`` (run from the repository root):
    ``python -m scripts.<script>`` and the overrides it was given (``sys.argv[1:]`` when ``argv`` is None)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"python -m scripts.{script}", *map(shlex.quote, args)])


def kept_analysis(md: Path) -> str:
    """The hand-written analysis section of an existing page (or an empty one)."""
    m = ANALYSIS.search(md.read_text()) if md.exists() else None
    return m.group(0) if m else "<!-- analysis -->\n<!-- /analysis -->"


def write_report(out: str | Path, data: dict, markdown: Callable[[str], str] | str) -> None:
    """Write ``<out>.json`` (``data``) and ``<out>.md``.

    Args:
        markdown: the page, or a function of the kept analysis section (:func:`kept_analysis` of the
            existing page) that returns the page.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    md = out.with_suffix(".md")
    text = markdown(kept_analysis(md)) if callable(markdown) else markdown
    md.write_text(text)
    print(f"wrote {md} and {out.with_suffix('.json')}")


def run_bench(schema: type, bench: Callable[[Any], dict], markdown: Callable[[dict, str, str], str], script: str,
              argv: list[str] | None) -> dict:  # fmt: skip
    """A benchmark script's ``main()``: parse ``argv`` (key=value) into ``schema``, run ``bench(cfg)``, stamp
    the result with :func:`machine` (torch threads = the config's ``threads`` where it has one), the date,
    the config (its ``target`` left out) and the command that reproduces it, and write ``<cfg.out>.json``
    and ``.md`` (``markdown(result, command, kept analysis)``; :func:`write_report`).

    Returns:
        the result dict as written to the JSON.
    """
    import dataclasses
    import datetime

    from drafttrain.cliconfig import parse_cli

    cfg = parse_cli(schema, argv)
    mach = machine()
    if getattr(cfg, "threads", None):
        mach["torch_threads"] = cfg.threads
    res = bench(cfg)
    res.update(machine=mach, date=datetime.date.today().isoformat(),
               config={k: v for k, v in dataclasses.asdict(cfg).items() if k != "target"})  # fmt: skip
    command = reproduce(script, argv)
    res["command"] = command
    write_report(cfg.out, res, lambda analysis: markdown(res, command, analysis))
    return res
