"""Load a training run's logs and evaluation reports, and plot acceptance (the notebook's helpers).

``notebooks/acceptance_length.ipynb`` only calls these functions, so the notebook holds no logic and
the tests cover what it draws. Sources:

- a run folder written by :mod:`drafttrain.train`: ``metrics.jsonl`` (every logged metric by step),
  ``final_metrics.json``, ``config.json``; when ``metrics.jsonl`` is missing (e.g. a copied W&B run),
  the offline W&B run under ``wandb/`` is read instead (:mod:`drafttrain.eval.wandb_offline`);
- evaluation reports (JSON) from the harness (``python -m scripts.evaluate``), read leniently: any
  JSON object that carries a batch size and a τ counts as one result row, whatever the nesting, with
  the recipe / prompt set taken from the object or the objects around it. Missing reports are fine:
  the batch-size plot then shows the training run's own batch-1 evaluation alone, or says that there
  is nothing to show.

Plot functions return a matplotlib ``Figure`` (nothing is shown or saved implicitly).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BATCH_KEYS = ("batch_size", "batch", "bs")
_TAU_KEYS = ("tau", "τ", "acceptance_length", "mean_accepted_length")
_SPEEDUP_KEYS = ("speedup", "wall_speedup")
_RECIPE_KEYS = ("recipe", "drafter", "method", "proposer")
_PROMPT_KEYS = ("prompts", "prompt_set", "dataset")
_TPS_KEYS = ("tokens_per_s", "spec_tokens_per_s", "throughput")


@dataclass
class RunLog:
    """A training run's logs.

    Attributes:
        path: the run folder. source: ``"metrics.jsonl"`` or ``"wandb"``.
        history: one dict per step with every metric logged at that step (``step`` key included).
        final: ``final_metrics.json`` (empty if the run has not finished). config: the resolved config.
    """

    path: Path
    source: str
    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def recipe(self) -> str:
        return str(self.config.get("drafter", {}).get("name", self.path.name))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a scalar metric over the run."""
        pts = [(r["step"], r[key]) for r in self.history if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    def last(self, prefix: str) -> dict[str, Any]:
        """The last history row holding ``{prefix}/acc_0`` (e.g. ``train`` or ``eval``), or {}."""
        rows = [r for r in self.history if f"{prefix}/acc_0" in r]
        return rows[-1] if rows else {}


def accept_hist_items(hist: dict | list | None) -> list[tuple[int, int]]:
    """(accepted drafts, verification steps) pairs sorted by count, from the dict that
    :func:`drafttrain.eval.in_training.summarize` returns (int keys) or its JSON form (str keys)."""
    if not hist:
        return []
    if isinstance(hist, list):
        return [(a, int(n)) for a, n in enumerate(hist)]
    return sorted((int(a), int(n)) for a, n in hist.items())


def load_run(run_dir: str | Path, source: str = "auto") -> RunLog:
    """Read a run folder.

    Args:
        run_dir: the run's ``output_dir``.
        source: ``"metrics.jsonl"``, ``"wandb"`` (the offline W&B run), or ``"auto"`` (the first if present).

    Raises:
        FileNotFoundError: neither source exists in ``run_dir``.
    """
    run_dir = Path(run_dir)
    jsonl = run_dir / "metrics.jsonl"
    if source == "auto":
        source = "metrics.jsonl" if jsonl.is_file() else "wandb"
    by_step: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    if source == "metrics.jsonl":
        for line in jsonl.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_step.setdefault(int(row["step"]), {}).update(row)
    elif source == "wandb":
        from drafttrain.eval.wandb_offline import read_run

        wb = read_run(run_dir)
        for row in wb.history:
            step = int(row["_step"])
            by_step.setdefault(step, {"step": step}).update({k: v for k, v in row.items() if not k.startswith("_")})
        config = wb.config
    else:
        raise ValueError(f"source must be auto|metrics.jsonl|wandb, got {source!r}")
    if (run_dir / "config.json").is_file():
        config = json.loads((run_dir / "config.json").read_text())
    final = json.loads((run_dir / "final_metrics.json").read_text()) if (run_dir / "final_metrics.json").is_file() else {}
    return RunLog(path=run_dir, source=source, history=[by_step[s] for s in sorted(by_step)], final=final, config=config)


def run_summary(run: RunLog) -> dict[str, Any]:
    """A few headline numbers of a run (for display)."""
    keys = ("step", "train_seconds", "eval/tau", "eval/tau_sim", "eval/speedup", "eval/greedy_equal", "eval/prompts")
    out = {"run": str(run.path), "recipe": run.recipe, "source": run.source, "logged_steps": len(run.history)}
    out.update({k: run.final[k] for k in keys if k in run.final})
    return out


# ---------------------------------------------------------------- evaluation reports


def _first(d: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _rows_from_json(obj: Any, context: dict[str, Any], out: list[dict[str, Any]]) -> None:
    if isinstance(obj, list):
        for x in obj:
            _rows_from_json(x, context, out)
        return
    if not isinstance(obj, dict):
        return
    ctx = dict(context)
    recipe, prompts = _first(obj, _RECIPE_KEYS), _first(obj, _PROMPT_KEYS)
    if isinstance(recipe, dict):
        recipe = recipe.get("name")
    if isinstance(recipe, str):
        ctx["recipe"] = recipe
    if isinstance(prompts, str):
        ctx["prompt_set"] = prompts
    bs, tau = _first(obj, _BATCH_KEYS), _first(obj, _TAU_KEYS)
    if isinstance(bs, (int, float)) and isinstance(tau, (int, float)):
        speedup, tps = _first(obj, _SPEEDUP_KEYS), _first(obj, _TPS_KEYS)
        out.append({
            "recipe": ctx.get("recipe", "?"), "prompt_set": ctx.get("prompt_set", "?"), "batch_size": int(bs),
            "tau": float(tau), "speedup": float(speedup) if isinstance(speedup, (int, float)) else math.nan,
            "tokens_per_s": float(tps) if isinstance(tps, (int, float)) else math.nan,
            "mode": str(obj.get("mode", ctx.get("mode", ""))), "source": ctx.get("source", ""),
        })  # fmt: skip
        return
    if isinstance(obj.get("mode"), str):
        ctx["mode"] = obj["mode"]
    for k, v in obj.items():
        if isinstance(k, str) and k.isdigit() and isinstance(v, dict):  # {"1": {...}, "4": {...}} keyed by batch size
            v = {"batch_size": int(k), **v}
        _rows_from_json(v, ctx, out)


def load_eval_reports(*paths: str | Path) -> list[dict[str, Any]]:
    """Result rows (recipe, prompt_set, batch_size, tau, speedup, tokens_per_s, mode, source) from the
    JSON reports at ``paths`` (files, or folders searched recursively for ``*.json``). Paths that do
    not exist and files that are not JSON are skipped: the harness may not have run yet."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        p = Path(p)
        files = sorted(p.rglob("*.json")) if p.is_dir() else [p] if p.is_file() else []
        for f in files:
            try:
                obj = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError, OSError):
                continue
            _rows_from_json(obj, {"source": str(f)}, rows)
    return rows


def run_eval_rows(run: RunLog) -> list[dict[str, Any]]:
    """The training run's own final speculative evaluation as one row at its batch size (``eval/batch_size``,
    1 for runs that predate it; empty if it has none)."""
    if "eval/tau" not in run.final:
        return []
    return [{"recipe": run.recipe, "prompt_set": str(run.final.get("eval/prompts", "?")),
             "batch_size": int(run.final.get("eval/batch_size", 1)),
             "tau": float(run.final["eval/tau"]), "speedup": float(run.final.get("eval/speedup", math.nan)),
             "tokens_per_s": float(run.final.get("eval/spec_tokens_per_s", math.nan)),
             "mode": f"{eval_tau_label(run.final)} (training eval)",
             "source": str(run.path / "final_metrics.json")}]  # fmt: skip


# ---------------------------------------------------------------- plots


def _figure(ncols: int = 1, width: float = 6.0, height: float = 3.6):
    import matplotlib.pyplot as plt  # headless: Agg; in a notebook: the inline backend

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def plot_tau(run: RunLog):
    """τ_sim on training batches, τ_sim on held-out sequences and speculative eval τ over training steps."""
    fig, (ax,) = _figure()
    for key, label, style in (("train/tau_sim", "τ_sim (training batches)", "-"),
                              ("eval/tau_sim", "τ_sim (held-out)", "o--"),
                              ("eval/tau", f"eval τ ({eval_tau_label(run.final)})", "s-"),
                              ("eval/tau_alone", "eval τ (the drafter alone: its chain, no SSSD)", "^-")):  # fmt: skip
        steps, values = run.series(key)
        if steps:
            ax.plot(steps, values, style, label=label, markersize=4)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens per target forward")
    ax.set_title(f"acceptance length over training: {run.recipe}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def eval_tau_label(final: dict[str, Any]) -> str:
    """What a run's ``eval/tau`` measured, from its own keys: the draft tree or chain it verified (``eval/tree``)
    and the SSSD candidates merged into it (``eval/sssd``), e.g. ``"tree widths [4, 2, 1, 1, 1] budget 8 + SSSD"``;
    ``"chain"`` when the run recorded neither."""
    what = str(final.get("eval/tree", "chain"))
    what = what if what.startswith(("chain", "tree")) else f"tree {what}"
    return what + (" + SSSD" if final.get("eval/sssd") else "")


def plot_position_acceptance(run: RunLog):
    """acc_k and cond_acc_k by group position k at the last logged step (training and held-out)."""
    fig, (ax,) = _figure()
    width, drawn = 0.2, 0
    for i, (prefix, metric) in enumerate([("train", "acc"), ("train", "cond_acc"), ("eval", "acc"), ("eval", "cond_acc")]):
        row = run.last(prefix)
        ks = sorted(int(k.rsplit("_", 1)[1]) for k in row if k.startswith(f"{prefix}/{metric}_"))
        if not ks:
            continue
        ax.bar([k + (i - 1.5) * width for k in ks], [row[f"{prefix}/{metric}_{k}"] for k in ks], width,
               label=f"{prefix}/{metric}_k (step {row['step']})")  # fmt: skip
        drawn += 1
    ax.set_xlabel("group position k (0 = anchor item, 1..K = mask slots)")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("per-position acceptance (cond_acc_k: given positions < k correct)", fontsize=10)
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_accept_hist(run: RunLog):
    """Histogram of accepted drafts per verification step in the run's last speculative evaluation."""

    fig, (ax,) = _figure()
    rows = [r for r in run.history if r.get("eval/accept_hist")]
    if rows:
        items = accept_hist_items(rows[-1]["eval/accept_hist"])
        total = sum(n for _, n in items) or 1
        ax.bar([a for a, _ in items], [n / total for _, n in items])
        prompts = str(rows[-1].get("eval/prompts", "")).split(" ")[0]  # the prompt set, not every id
        ax.set_title(f"accepted drafts per step: {prompts}, step {rows[-1]['step']}\n"
                     f"({eval_tau_label(run.final)})", fontsize=9)  # fmt: skip
    else:
        ax.text(0.5, 0.5, "no speculative evaluation logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("drafts accepted in a verification step (tokens emitted = this + 1)")
    ax.set_ylabel("fraction of steps")
    fig.tight_layout()
    return fig


#: At most this many series in the batch-size figure (and its legend): the first ones in the order rows are given.
MAX_SERIES = 8


def series_label(r: dict[str, Any]) -> str:
    """A row's series name: recipe / prompt set / mode, the report file's name standing in for an unknown recipe."""
    recipe = r.get("recipe") or "?"
    if recipe == "?":
        recipe = Path(str(r.get("source", "?"))).stem
    prompt_set = str(r.get("prompt_set", "")).split(" ")[0]  # "mt_bench ids 81,86,..." -> "mt_bench"
    return " / ".join(x for x in (recipe, prompt_set, r.get("mode", "")) if x and x != "?")


def plot_batch_sizes(rows: list[dict[str, Any]], max_series: int = MAX_SERIES):
    """τ and speedup over plain decoding by batch size, one line per (recipe, prompt set, mode): the first
    ``max_series`` series in the order of ``rows`` (the rest are counted in the title), the legend below the axes."""
    fig, (ax_tau, ax_speed) = _figure(ncols=2, width=5.0, height=4.2)
    if not rows:
        for ax in (ax_tau, ax_speed):
            ax.text(0.5, 0.5, "no evaluation report found\n(python -m scripts.evaluate writes one)",
                    ha="center", va="center", transform=ax.transAxes)  # fmt: skip
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}  # one series per (label, report file): never joined
    for r in rows:
        by_key.setdefault((series_label(r), str(r.get("source", ""))), []).append(r)
    counts: dict[str, int] = {}
    for label, _ in by_key:
        counts[label] = counts.get(label, 0) + 1
    series = {(label if counts[label] == 1 else f"{label} ({Path(src).parent.name}/{Path(src).stem})"): rs
              for (label, src), rs in by_key.items()}  # fmt: skip
    left_out = max(len(series) - max_series, 0)
    series = dict(list(series.items())[:max_series])
    rows = [r for rs in series.values() for r in rs]
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["batch_size"])
        bs = [r["batch_size"] for r in rs]
        ax_tau.plot(bs, [r["tau"] for r in rs], "o-", label=label)
        ax_speed.plot(bs, [r["speedup"] for r in rs], "o-", label=label)
    sizes = sorted({r["batch_size"] for r in rows})
    for ax, name in ((ax_tau, "τ (tokens per target forward)"), (ax_speed, "speedup over plain decoding")):
        ax.set_xlabel("batch size")
        ax.set_ylabel(name)
        if rows:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.minorticks_off()
    ax_speed.axhline(1.0, color="grey", lw=0.8, ls=":")
    more = f" ({left_out} more series not drawn)" if left_out else ""
    ax_tau.set_title("acceptance length by batch size" + more, fontsize=10)
    ax_speed.set_title("wall-clock speedup by batch size", fontsize=10)
    if rows:
        handles, labels = ax_tau.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.045 * ((len(labels) + 1) // 2) + 0.03, 1, 1))
    else:
        fig.tight_layout()
    return fig


def save_figures(figures: dict[str, Any], out_dir: str | Path, dpi: int = 110) -> list[Path]:
    """Save ``{name: Figure}`` as ``out_dir/name.png``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
