"""Benchmark the batched verifier on the real target; writes docs/benchmarks/verifier.{json,md}.

    flock /tmp/drafttrain-heavy.lock nice -n 10 python -m scripts.bench_verifier \
        --checkpoint /work/main/outputs/baseline --num-prompts 8 --max-new-tokens 64 --batch-sizes 1 4 8

Runs :func:`drafttrain.eval.harness.evaluate` (plain decoding + speculative decoding in every engine mode,
same prompts, same process) on MT-bench at each batch size, and on GSM8K at batch 1, then writes the
JSON of both and a markdown page with the command, the machine and the tables. A hand-written section
between ``<!-- analysis -->`` and ``<!-- /analysis -->`` in an existing page is kept.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from drafttrain.eval.harness import evaluate
from drafttrain.eval.report import markdown

ANALYSIS = re.compile(r"<!-- analysis -->.*?<!-- /analysis -->", re.S)
CONF = Path(__file__).resolve().parents[1] / "conf"


def run_eval(overrides: list[str]) -> dict:
    """Compose ``conf/evaluate.yaml`` with Hydra overrides and run the harness (returns results.json's dict)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("evaluate", overrides=overrides), resolve=True)
    cfg.pop("hydra", None)
    return evaluate(cfg)


def kept_analysis(md: Path) -> str:
    """The hand-written analysis section of an existing page (or an empty one)."""
    m = ANALYSIS.search(md.read_text()) if md.exists() else None
    return m.group(0) if m else "<!-- analysis -->\n<!-- /analysis -->"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="training run folder; default: an untrained drafter")
    ap.add_argument("--replay", type=float, default=None, metavar="P",
                    help="instead of a drafter: the replay proposer, each draft right with probability P")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["unpadded", "unpadded_kv", "padded"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-sets", nargs="+", default=["mt_bench"], help="mt_bench, gsm8k (or a .jsonl path)")
    ap.add_argument("--gsm8k", action=argparse.BooleanOptionalAction, default=False, help="also GSM8K at batch 1")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--tree", nargs="*", default=[], help="extra overrides, e.g. tree.widths=[2,1,1,1,1] tree.budget=6")
    ap.add_argument("--out", default="docs/benchmarks/verifier")
    ap.add_argument("--work-dir", default="outputs/bench_verifier")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    def run(prompts: str, batch_sizes: list[int]) -> dict:
        overrides = [
            f"target={args.target}", f"prompts={prompts}", f"num_prompts={args.num_prompts}",
            f"max_new_tokens={args.max_new_tokens}", f"batch_sizes=[{','.join(map(str, batch_sizes))}]",
            f"modes=[{','.join(args.modes)}]", f"num_threads={args.threads}", f"output_dir={args.work_dir}/{prompts}",
            "progress=false", *args.tree,
        ]  # fmt: skip
        if args.replay is not None:
            overrides += ["proposer=replay", f"replay_accept_prob={args.replay}"]
        else:
            overrides += [f"checkpoint={args.checkpoint}"] if args.checkpoint else ["untrained_drafter=true"]
        return run_eval(overrides)

    results = {name: run(name, args.batch_sizes) for name in args.prompt_sets}
    if args.gsm8k and "gsm8k" not in results:
        results["gsm8k"] = run("gsm8k", [1])
    command = "flock /tmp/drafttrain-heavy.lock nice -n 10 python -m scripts.bench_verifier " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, **results}, indent=1))
    md = out.with_suffix(".md")
    keep = kept_analysis(md)
    body = [f"# Batched verifier benchmark\n\nReproduce (JSON: `{out.with_suffix('.json').name}`):\n\n```bash\n{command}\n```\n",
            keep, ""]  # fmt: skip
    for name, res in results.items():
        body.append(markdown(res).replace("\n## ", "\n### ").replace("# Verifier evaluation:", "##", 1))
    md.write_text("\n".join(body))
    print(f"wrote {md} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
