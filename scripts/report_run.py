"""Write a finished training run's numbers to docs/benchmarks/ (JSON + a markdown table).

    python -m scripts.report_run run_dir=outputs/parallelspec-smollm2-135m-instruct name=main_job \
        command="'bash scripts/bootstrap.sh && .venv/bin/accelerate launch ... +recipe=parallelspec'" wall_seconds=1650

It reads the run folder's ``final_metrics.json``, ``metrics.jsonl`` and ``config.json`` and the
self-distillation ``report.json`` of the data it trained on, so the table shows exactly what the run
measured (τ_sim on training batches and on held-out sequences, eval τ on MT-bench, greedy equality,
tokens/s, wall time) next to the command that reproduces it.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING


@dataclass
class ReportRunConfig:
    """Schema of ``python -m scripts.report_run`` (key=value overrides, validated before any work)."""

    run_dir: str = MISSING  # the training run folder (required)
    name: str = MISSING  # file stem under out/ (required)
    command: str | None = None  # the command that produced the run (quote it: command="'...'")
    wall_seconds: float | None = None  # measured wall time of the whole command
    out: str = "docs/benchmarks"


def portable_run_dir(run_dir: Path) -> str:
    """``run_dir`` as the report records it: as given when relative; when absolute, relative to the checkout
    that holds it (the nearest ancestor with a ``.git``: a clean clone measured elsewhere), else its last
    two parts. A report names no path of the machine it was measured on (tests/scripts/test_scripts_cli.py)."""
    run_dir = Path(run_dir)
    if not run_dir.is_absolute():
        return run_dir.as_posix()
    for parent in run_dir.parents:
        if (parent / ".git").exists():
            return run_dir.relative_to(parent).as_posix()
    return Path(*run_dir.parts[-2:]).as_posix()


def summarize(run_dir: Path) -> dict:
    final = json.loads((run_dir / "final_metrics.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "train/loss" in r]
    last = train_rows[-1] if train_rows else {}
    tok_s = [r["train/tokens_per_s"] for r in train_rows[1:]] or [last.get("train/tokens_per_s", 0.0)]
    curve = [
        {k: r[k] for k in ("step", "eval/tau_sim", "eval/acc_0", "eval/tau") if k in r}
        for r in rows
        if "eval/tau_sim" in r or "eval/tau" in r
    ]
    launch = run_dir / "launch.json"
    host = json.loads(launch.read_text()).get("host") if launch.is_file() else None
    return {
        "run_dir": portable_run_dir(run_dir),
        "host": host,  # the run's own: CPU capability, threads, how the target's linears ran (launch.json)
        "machine": {"cpu_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
        "config": {
            "target": config["target"]["name"],
            "data": {"source": config["data"]["source"], "max_conversations": config["data"]["max_conversations"],
                     "max_new_tokens": config["data"].get("generation", config["data"]).get("max_new_tokens"),
                     "self_distill": config["data"]["self_distill"]},  # before data.generation: the flat key
            "drafter": config["drafter"],
            "optim_lr": config["optim"]["lr"],
            "micro_batch_size": config["trainer"]["micro_batch_size"],
            "mixed_precision": config["trainer"]["mixed_precision"],
        },
        "steps": final["step"],
        "train_seconds": final["train_seconds"],
        "run_wall_seconds": final.get("wall_seconds"),
        "trainable_params": final["trainable_params"],
        "train_tau_sim_last": last.get("train/tau_sim"),
        "train_acc_last": {k: v for k, v in last.items() if k.startswith("train/acc_")},
        "train_drafter_slots_per_s_mean": sum(tok_s) / len(tok_s),
        "eval_tau_sim_heldout": final.get("eval/tau_sim"),
        "eval_acc_heldout": {k: v for k, v in final.items() if k.startswith("eval/acc_")},
        "eval_tau_mt_bench": final.get("eval/tau"),
        "eval_prompts": final.get("eval/prompts"),
        "eval_greedy_equal": final.get("eval/greedy_equal"),
        "eval_accept_hist": final.get("eval/accept_hist"),
        "eval_plain_tokens_per_s": final.get("eval/plain_tokens_per_s"),
        "eval_spec_tokens_per_s": final.get("eval/spec_tokens_per_s"),
        "eval_speedup": final.get("eval/speedup"),
        "eval_batch_size": final.get("eval/batch_size", 1),
        # the decoding steps alone (prompt forwards left out; None for runs made before the metric)
        "eval_speedup_decode": final.get(f"eval/speedup_decode_b{final.get('eval/batch_size', 1)}"),
        "eval_speedup_decode_b1": final.get("eval/speedup_decode_b1"),
        "eval_planner": {b: final[f"eval/planner_b{b}"] for b in sorted({final.get("eval/batch_size", 1), 1})
                         if isinstance(final.get(f"eval/planner_b{b}"), dict)},  # fmt: skip
        "eval_tree": final.get("eval/tree"),
        "eval_tau_chain": final.get("eval/tau_chain"),
        "eval_accept_hist_chain": final.get("eval/accept_hist_chain"),
        "eval_speedup_chain": final.get("eval/speedup_chain"),
        **{f"eval_{k}": final.get(f"eval/{k}") for k in ("speedup_b1", "speedup_full_tree", "tau_planned", "tau_b1",
                                                         "plain_tokens_per_s_b1", "spec_tokens_per_s_b1", "sssd",
                                                         "latency_prompts", "prompts_b1")},
        "curve": curve,
    }


def markdown(name: str, s: dict, command: str | None, wall: float | None) -> str:
    from drafttrain.host import summary

    lines = [f"# {name}", ""]
    if command:
        lines += ["Reproduce:", "", "```bash", command, "```", ""]
    lines += ["| quantity | value |", "|---|---|"]
    table = [
        ("target", s["config"]["target"]),
        *([("host (the run's own)", (f"{summary(s['host'])}; " if s["host"].get("cpu_model") else "")  # describe()'s line
                                     + f"CPU capability {s['host'].get('cpu_capability')}, {s['host'].get('cpu_threads')} "
                                     f"torch threads, target linears on {s['host'].get('target_linears')}"
                                     + (f", decode attention on {s['host']['decode_attention']}" if s["host"].get("decode_attention") else ""))]
          if s.get("host") else []),
        ("data", json.dumps(s["config"]["data"])),
        ("drafter", f"{s['config']['drafter']['name']}, K={s['config']['drafter']['num_mask_tokens']}, "
                    f"draft vocab {s['config']['drafter'].get('draft_vocab_size')}, {s['trainable_params']:,} trainable params"),
        ("optimizer steps (micro-batch)", f"{s['steps']} ({s['config']['micro_batch_size']}), {s['config']['mixed_precision']}"),
        ("training time", f"{s['train_seconds']:.0f} s"),
        ("whole run (target load, self-distillation, training, eval)", f"{s['run_wall_seconds']} s"),
        ("end-to-end wall time of the command", f"{wall:.0f} s" if wall else "n/a"),
        ("training throughput (drafter layout slots/s)", f"{s['train_drafter_slots_per_s_mean']:.0f}"),
        ("τ_sim, last training window", _f(s["train_tau_sim_last"])),
        ("τ_sim, held-out self-distilled sequences", _f(s["eval_tau_sim_heldout"])),
        ("held-out acc_k", ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in s["eval_acc_heldout"].items())),
        (f"**eval τ, {'draft tree ' + s['eval_tree'] if s.get('eval_tree') else 'greedy chain'}, {s['eval_prompts']}**",
         f"**{_f(s['eval_tau_mt_bench'])}**"),
        *([("**eval τ, greedy chain (depth K + 1), same prompts**", f"**{_f(s['eval_tau_chain'])}**")]
          if s.get("eval_tau_chain") is not None else []),
        ("speculative output == plain greedy (every prompt)", str(s["eval_greedy_equal"])),
        ("accepted drafts per step (histogram)", json.dumps(s["eval_accept_hist"])),
        *([("accepted drafts per step, chain", json.dumps(s["eval_accept_hist_chain"]))]
          if s.get("eval_accept_hist_chain") else []),
        (f"plain / speculative tokens/s ({s.get('eval_batch_size', 1)} sequences at a time, same run)",
         f"{_f(s['eval_plain_tokens_per_s'], 1)} / {_f(s['eval_spec_tokens_per_s'], 1)} (speedup {_f(s['eval_speedup'], 2)}"
         + (f"; chain {_f(s['eval_speedup_chain'], 2)})" if s.get("eval_speedup_chain") is not None else ")")),
        *([("speculative, full tree every step (no planner), same batch", f"speedup {_f(s['eval_speedup_full_tree'], 2)}"),
           ("τ of the planned run (only the nodes that pay are verified)", _f(s["eval_tau_planned"]))]
          if s.get("eval_speedup_full_tree") is not None else []),
        *([(f"**batch 1**: plain / speculative tokens/s, {s.get('eval_latency_prompts') or 'the first'} prompts one at a time"
            + (f" (ids {s['eval_prompts_b1']})" if s.get("eval_prompts_b1") else ""),
            f"{_f(s['eval_plain_tokens_per_s_b1'], 1)} / {_f(s['eval_spec_tokens_per_s_b1'], 1)} "
            f"(**speedup {_f(s['eval_speedup_b1'], 2)}**, τ {_f(s['eval_tau_b1'])})")]
          if s.get("eval_speedup_b1") is not None else []),
        *([("decoding steps alone (the prompt forwards, the same in both runs, left out): speedup at batch "
            f"{s.get('eval_batch_size', 1)} / batch 1",
            f"{_f(s['eval_speedup_decode'], 2)} / {_f(s.get('eval_speedup_decode_b1'), 2)}")]
          if s.get("eval_speedup_decode") is not None else []),
        *([("SSSD candidates in the trees (trainer.spec_eval.sssd)", s["eval_sssd"])] if s.get("eval_sssd") else []),
        *[(f"planner at batch {b}: drafted steps / steps, nodes verified / offered",
           f"{p['drafted_steps']} / {p['steps']}, {p['nodes_verified']} / {p['nodes_offered']}")
          for b, p in sorted((s.get("eval_planner") or {}).items(), key=lambda kv: int(kv[0]))],
    ]
    lines += [f"| {k} | {v} |" for k, v in table]
    if s["curve"]:
        lines += ["", "Held-out curve:", "", "| step | τ_sim held-out | acc_0 held-out | eval τ |", "|---|---|---|---|"]
        seen = set()
        for r in s["curve"]:
            if r["step"] in seen and "eval/tau" not in r:
                continue
            seen.add(r["step"])
            lines.append(f"| {r['step']} | {_f(r.get('eval/tau_sim'))} | {_f(r.get('eval/acc_0'))} | {_f(r.get('eval/tau'))} |")
    return "\n".join(lines) + "\n"


def _f(x, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli
    from scripts.common import write_report

    args = parse_cli(ReportRunConfig, argv)
    s = summarize(Path(args.run_dir))
    s["command"], s["command_wall_seconds"] = args.command, args.wall_seconds
    page = markdown(args.name, s, args.command, args.wall_seconds)
    # the hand-written section (the runs per host kind) survives a new run's page
    write_report(Path(args.out) / args.name, s, lambda kept: page.rstrip("\n") + "\n\n" + kept + "\n")


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
