"""The MCSD early-stop decision model on the real target; writes docs/benchmarks/decision_model.{json,md}.

    python -m scripts.bench_decision checkpoint=outputs/mainjob3

1. **Labels from verifier runs**: MCSD (W_t = 1, the trained ParallelSpec drafter) decodes MT-bench and
   GSM8K prompts that the evaluation below does not use (``prompt_offset``), logging every reached
   level's features and whether the target accepted it (``mcsd.decisions_out``).
2. **Training**: ``python -m scripts.train_decision_model`` on those rows (run in-process here, same code).
3. **Use**: MCSD without the model and with it at every threshold of ``betas`` (early stop at beta)
   on the evaluation prompts, batch 1 and 8, same run, same plain baseline: τ, mean tree size,
   tokens/s, speedup.

The labels are kept in ``work_dir`` (``labels.done``): running the command again retrains and
re-evaluates on them without decoding the label prompts again.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

from scripts.common import kept_analysis, machine_line, reproduce, run_eval


@dataclass
class BenchDecisionConfig:
    """Schema of ``python -m scripts.bench_decision`` (key=value overrides, validated before any work)."""

    checkpoint: str = MISSING  # training run folder of the drafter MCSD grows its trees with (required)
    label_prompts: int = 32  # prompts per set decoded for labels
    label_offset: int = 16  # first label prompt (evaluation uses 0..num_prompts-1)
    num_prompts: int = 8
    max_new_tokens: int = 96
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    beta: float = 0.4  # threshold of the training summary
    betas: list[float] = field(default_factory=lambda: [0.4, 0.2, 0.1])  # evaluated side by side (one run each)
    threads: int = 2
    overrides: list[str] = field(default_factory=list)  # extra harness overrides
    out: str = "docs/benchmarks/decision_model"
    work_dir: str = "outputs/bench_decision"


def main(argv: list[str] | None = None) -> None:
    import logging

    from drafttrain.cliconfig import parse_cli

    args = parse_cli(BenchDecisionConfig, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from drafttrain.cliconfig import parse_cli as parse
    from drafttrain.config import DecisionModelConfig
    from scripts.train_decision_model import run

    work = Path(args.work_dir)
    log_path = work / "decisions.jsonl"
    labelled = work / "labels.done"  # labels are reused when the command is run again
    if not labelled.exists():
        log_path.unlink(missing_ok=True)
    base = [f"checkpoint={args.checkpoint}", "modes=[unpadded]", "methods=[mcsd]", "mcsd.target_roots=[1]",
            f"max_new_tokens={args.max_new_tokens}", f"num_threads={args.threads}", "progress=false", "plots=false",
            *args.overrides]  # fmt: skip
    sets = ["mt_bench", "gsm8k"]
    for name in sets if not labelled.exists() else []:
        run_eval(base + [f"prompts={name}", f"prompt_offset={args.label_offset}", f"num_prompts={args.label_prompts}",
                         "batch_sizes=[8]", f"mcsd.decisions_out={log_path}", "warmup=false",
                         f"output_dir={work}/labels_{name}"])  # fmt: skip
    labelled.write_text("ok")
    train_cmd = [f"data=[{log_path}]", f"beta={args.beta}", f"output_dir={work}/dm", "logging.wandb=false", "progress=false"]
    trained = run(parse(DecisionModelConfig, train_cmd))
    evals = {name: run_eval(base + [f"prompts={name}", f"num_prompts={args.num_prompts}",
                                    f"batch_sizes=[{','.join(map(str, args.batch_sizes))}]",
                                    f"mcsd.decision_model={work}/dm/decision_model", f"mcsd.betas=[{','.join(map(str, args.betas))}]",
                                    f"output_dir={work}/eval_{name}"])
             for name in sets}  # fmt: skip
    command = reproduce("bench_decision", argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "training": trained, **evals}, indent=1))
    t = trained
    body = [
        "# MCSD early-stop decision model (MCSD-improved §3.3)",
        "",
        f"Reproduce (JSON: `{out.with_suffix('.json').name}`):",
        "",
        f"```bash\n{command}\n```",
        "",
        f"Host: {machine_line(next(iter(evals.values())).get('host'))}. "
        f"Drafter `{args.checkpoint}`; MCSD W_t = 1, levels {evals['mt_bench']['command_config']['mcsd']['ks']}; "
        f"labels from {args.label_prompts} MT-bench + {args.label_prompts} GSM8K prompts starting at index "
        f"{args.label_offset} (batch 8, {args.max_new_tokens} new tokens), evaluation on prompts 0..{args.num_prompts - 1} "
        f"at beta in {args.betas} (`mcsd_w1_dm_b<beta>`). "
        "Training command (what this script runs in-process):",
        "",
        f"```bash\npython -m scripts.train_decision_model {shlex.join(train_cmd)}\n```",
        "",
        kept_analysis(out.with_suffix(".md")),
        "",
        "## Training",
        "",
        "| rows (kept / read) | held-out rows | held-out accept rate | held-out accuracy | majority-class accuracy | "
        f"cut at beta = {args.beta}: share of reached levels | of which rejected anyway | accepted levels lost |",
        "|---|---|---|---|---|---|---|---|",
        f"| {t['kept']} / {t['read']} | {t['heldout_rows']} | {t['heldout_accept_rate']:.3f} | "
        f"{t['decision/heldout_accuracy']:.3f} | {t['heldout_majority_accuracy']:.3f} | {t['heldout_cut_fraction']:.3f} | "
        f"{t['heldout_cut_precision']:.3f} | {t['heldout_accepted_lost_fraction']:.3f} |",
        "",
    ]  # fmt: skip
    for name, res in evals.items():
        body += [f"## {name}: MCSD with and without early stop", "",
                 "| batch | method | τ | mean tree nodes | tok/s | speedup over plain | equal to plain greedy |",
                 "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in res["runs"]:
            body.append(f"| {r['batch_size']} | {r['method']} | {r['tau']:.3f} | {r['mean_tree_nodes']:.1f} | "
                        f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r.get('greedy_equal', '-')} |")  # fmt: skip
        body.append("")
    out.with_suffix(".md").write_text("\n".join(body))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
