"""Evaluate a drafter with the bundled batched verifier (plain vs speculative, per batch size and engine mode).

    python -m scripts.evaluate checkpoint=outputs/parallelspec-smollm2-135m-instruct prompts=mt_bench \
        batch_sizes=[1,4,8,16] temperature=0
    python -m scripts.evaluate preset=training checkpoint=outputs/parallelspec-smollm2-135m-instruct
        # the run's own evaluation again: the same eval/tau as its final_metrics.json (drafttrain/eval/preset.py)

Config: conf/evaluate.yaml (validated into drafttrain.config.eval_schema(), EvalConfig + the methods' sections: a typo'd key fails before any
model loads). Writes results.json, outputs.jsonl, report.md and plots/ to ``output_dir``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None):
    import logging

    from drafttrain.cliconfig import parse_cli
    from drafttrain.validation import eval_schema, validate_eval
    from drafttrain.eval.harness import evaluate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    c = validate_eval(parse_cli(eval_schema(), argv, config_name="evaluate"))
    if c.preset == "training":
        from drafttrain.eval.preset import training_eval

        # an output_dir other than the one the preset's keys compose to wins; otherwise the run folder's eval_preset/
        default = parse_cli(eval_schema(), ["preset=training", f"checkpoint={c.checkpoint}"], config_name="evaluate")
        given = c.output_dir != default.output_dir
        r = training_eval(c.checkpoint, output_dir=c.output_dir if given else None, num_threads=c.num_threads)
        keys = ("eval/tau", "eval/greedy_equal", "eval/speedup_b16", "eval/speedup_b1", "eval/speedup")
        print("[drafttrain] preset=training: " + ", ".join(f"{k} {r[k]}" for k in keys if k in r), flush=True)
        return r
    results = evaluate(c)
    print(f"[drafttrain] wrote {c.output_dir}/report.md (greedy_equal={results['greedy_equal']})", flush=True)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
