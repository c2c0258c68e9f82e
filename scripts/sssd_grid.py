"""Grid search of SSSD's fusion weights by simulated acceptance (SSSD §3.1.3), without the target.

    python -m scripts.build_datastore                       # once: datastore + <output>/heldout.jsonl
    python -m scripts.sssd_grid                             # -> docs/benchmarks/sssd_grid.{json,md}
    python -m scripts.sssd_grid num_sequences=10 'grid.input_scale=[0.5,1.0]' output=outputs/sssd_grid

"Good weights can be identified through a simple grid search. This process requires minimal device
usage to initially generate ground truth data with the LLM. The data is then used to simulate the LLM
inference process and find good parameters." Here the ground truth is the data's own continuations: for
every held-out row the context is everything before its first answer and the continuation is that answer;
:func:`drafttrain.verify.methods.sssd.simulate_greedy` drafts from the growing context (input trie + datastore),
accepts the longest tree path equal to the continuation, appends it plus one "bonus" token, and so on.
On self-distilled rows (the target's own greedy answers) this is exactly the τ of greedy SSSD decoding
with that target; on ShareGPT rows it measures how well SSSD predicts ShareGPT's answers.

The best weights are then simulated at every size in ``budgets``, giving the τ(n) table the
speculation-length planner (:func:`drafttrain.verify.methods.sssd.plan_speculation_length`) needs.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from drafttrain.verify.methods.sssd import SSSDConfig
from scripts.common import load_sequences, reproduce

log = logging.getLogger("drafttrain.sssd_grid")


@dataclass
class GridSpace:
    """Values tried for each weight (the product of all lists is searched)."""

    input_scale: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    input_depth_damp: list[float] = field(default_factory=lambda: [0.7, 1.0])
    input_match_damp: list[float] = field(default_factory=lambda: [0.7, 1.0])
    datastore_scale: list[float] = field(default_factory=lambda: [1.0])
    datastore_depth_damp: list[float] = field(default_factory=lambda: [0.7, 1.0])
    datastore_match_damp: list[float] = field(default_factory=lambda: [0.7, 1.0])
    combine: list[str] = field(default_factory=lambda: ["max"])


@dataclass
class SSSDGridConfig:
    """Schema of ``conf/sssd_grid.yaml``."""

    datastore: str = "data/datastore/sharegpt"  # folder from scripts.build_datastore
    heldout: str | None = None  # rows (jsonl with input_ids + loss_mask); null = <datastore>/heldout.jsonl
    num_sequences: int = 40  # held-out rows simulated
    max_continuation: int = 128  # answer tokens simulated per row
    batch_size: int = 32  # sequences drafted in lock-step (vectorised datastore search)
    budgets: list[int] = field(default_factory=lambda: [0, 2, 4, 8, 16, 32, 64])  # tau(n) of the best weights
    sssd: SSSDConfig = field(default_factory=SSSDConfig)  # everything the grid does not vary
    grid: GridSpace = field(default_factory=GridSpace)
    output: str = "docs/benchmarks/sssd_grid"  # writes <output>.json and <output>.md
    command: str | None = None  # recorded in the report; null = the command line that ran it


def grid_points(space: GridSpace) -> list[dict]:
    names = list(asdict(space))
    return [dict(zip(names, values)) for values in itertools.product(*(getattr(space, n) for n in names))]


def run(cfg) -> dict:
    """Run the grid; write ``<output>.json`` and ``<output>.md``; return the report dict.

    Raises:
        drafttrain.config.ConfigError: bad config; FileNotFoundError: missing datastore / held-out rows.
    """
    from drafttrain.cliconfig import validate_into
    from drafttrain.config import ConfigError
    from drafttrain.verify.methods.sssd_datastore import Datastore
    from drafttrain.verify.methods.sssd import SSSDDrafter, simulate_greedy

    c = validate_into(SSSDGridConfig, cfg)
    try:
        c.sssd.validate()
        for point in grid_points(c.grid):
            SSSDConfig(**{**asdict(c.sssd), **point}).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ds = Datastore.load(c.datastore)
    heldout = c.heldout or str(Path(c.datastore) / "heldout.jsonl")
    seqs = load_sequences(heldout, c.num_sequences, c.max_continuation)
    if not seqs:
        raise ConfigError(f"no held-out sequences in {heldout}")
    t0 = time.perf_counter()
    results = []
    for point in grid_points(c.grid):
        drafter = SSSDDrafter(SSSDConfig(**{**asdict(c.sssd), **point}), ds)
        t = time.perf_counter()
        sim = simulate_greedy(drafter, seqs, batch_size=c.batch_size)
        results.append({**point, "tau": sim.tau, "steps": sim.steps, "mean_tree_size": sim.mean_tree_size,
                        "seconds": round(time.perf_counter() - t, 2)})
        log.info("%s -> tau %.4f", point, sim.tau)
    best = max(results, key=lambda r: r["tau"])
    best_point = {k: best[k] for k in asdict(c.grid)}
    tau_by_size = {}
    for n in c.budgets:
        drafter = SSSDDrafter(SSSDConfig(**{**asdict(c.sssd), **best_point, "node_budget": n}), ds)
        tau_by_size[n] = simulate_greedy(drafter, seqs, batch_size=c.batch_size).tau
    report = {
        "command": c.command or "python -m scripts.sssd_grid",
        "datastore": c.datastore,
        "datastore_tokens": len(ds),
        "heldout": heldout,
        "sequences": len(seqs),
        "continuation_tokens": sum(len(x) for _, x in seqs),
        "base_config": asdict(c.sssd),
        "results": sorted(results, key=lambda r: -r["tau"]),
        "best": best_point,
        "best_tau": best["tau"],
        "tau_by_size": tau_by_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_report(report, Path(c.output))
    return report


def write_report(report: dict, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    keys = list(report["best"])
    lines = [
        "# SSSD fusion weights: grid search by simulated acceptance",
        "",
        f"Reproduce: `{report['command']}`",
        "",
        f"Datastore `{report['datastore']}` ({report['datastore_tokens']:,} tokens); {report['sequences']} held-out "
        f"sequences from `{report['heldout']}`, {report['continuation_tokens']:,} continuation tokens simulated "
        f"(greedy, the data's own continuation as the target's choice). Node budget "
        f"{report['base_config']['node_budget']}, max depth {report['base_config']['max_depth']}, "
        f"P = {report['base_config']['max_prefix_len']}. Wall time {report['seconds']} s.",
        "",
        f"τ_sim ranges from {min(r['tau'] for r in report['results']):.3f} to {report['best_tau']:.3f} over the "
        f"{len(report['results'])} points (the 15 best are listed).",
        "",
        "| " + " | ".join(keys) + " | τ_sim | mean nodes |",
        "|" + "---|" * (len(keys) + 2),
    ]
    for r in report["results"][:15]:
        lines.append("| " + " | ".join(str(r[k]) for k in keys) + f" | {r['tau']:.3f} | {r['mean_tree_size']:.1f} |")
    lines += ["", "τ_sim by tree size n (best weights), the planner's acceptance model:", "",
              "| n | " + " | ".join(str(n) for n in report["tau_by_size"]) + " |",
              "|---|" + "---|" * len(report["tau_by_size"]),
              "| τ_sim | " + " | ".join(f"{t:.3f}" for t in report["tau_by_size"].values()) + " |", ""]
    output.with_suffix(".md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    c = parse_cli(SSSDGridConfig, argv, config_name="sssd_grid")
    if c.command is None:
        c.command = reproduce("sssd_grid", argv)
    report = run(c)
    print(json.dumps({"best": report["best"], "best_tau": report["best_tau"], "tau_by_size": report["tau_by_size"]}, indent=1))


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
