"""Benchmark the batched verifier on the real target; writes docs/benchmarks/verifier.{json,md}.

    python -m scripts.bench_verifier checkpoint=outputs/baseline num_prompts=8 max_new_tokens=64 'batch_sizes=[1,4,8]'

Runs :func:`drafttrain.eval.harness.evaluate` (plain decoding + speculative decoding in every engine mode,
same prompts, same process) on each of ``prompt_sets`` at each batch size (and on GSM8K at batch 1 with
``gsm8k=true``), then writes the JSON of all and a markdown page with the command, the machine and the
tables. A hand-written section between ``<!-- analysis -->`` and ``<!-- /analysis -->`` in an existing
page is kept. ``replay=P``: the replay proposer instead of a drafter, each draft right with probability P.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from drafttrain.eval.report import markdown
from scripts.common import reproduce, run_eval, write_report


@dataclass
class BenchVerifierConfig:
    """Schema of ``python -m scripts.bench_verifier`` (key=value overrides, validated before any work)."""

    checkpoint: str | None = None  # training run folder; null = an untrained drafter (timing only)
    replay: float | None = None  # instead of a drafter: the replay proposer, each draft right with this probability
    num_prompts: int = 8
    max_new_tokens: int = 64
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8])
    modes: list[str] = field(default_factory=lambda: ["unpadded", "unpadded_kv", "padded"])
    threads: int = 2
    prompt_sets: list[str] = field(default_factory=lambda: ["mt_bench"])  # mt_bench, gsm8k (or a .jsonl path)
    gsm8k: bool = False  # also GSM8K at batch 1
    target: str = "smollm2"
    overrides: list[str] = field(default_factory=list)  # extra harness overrides, e.g. ["tree.widths=[2,1,1,1,1]","tree.budget=6"]
    out: str = "docs/benchmarks/verifier"
    work_dir: str = "outputs/bench_verifier"


def main(argv: list[str] | None = None) -> None:
    import logging

    from drafttrain.cliconfig import parse_cli

    a = parse_cli(BenchVerifierConfig, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    def run(prompts: str, batch_sizes: list[int]) -> dict:
        overrides = [
            f"target={a.target}", f"prompts={prompts}", f"num_prompts={a.num_prompts}",
            f"max_new_tokens={a.max_new_tokens}", f"batch_sizes=[{','.join(map(str, batch_sizes))}]",
            f"modes=[{','.join(a.modes)}]", f"num_threads={a.threads}", f"output_dir={a.work_dir}/{prompts}",
            "progress=false", *a.overrides,
        ]  # fmt: skip
        if a.replay is not None:
            overrides += ["proposer=replay", f"replay_accept_prob={a.replay}"]
        else:
            overrides += [f"checkpoint={a.checkpoint}"] if a.checkpoint else ["untrained_drafter=true"]
        return run_eval(overrides)

    results = {name: run(name, a.batch_sizes) for name in a.prompt_sets}
    if a.gsm8k and "gsm8k" not in results:
        results["gsm8k"] = run("gsm8k", [1])
    command = reproduce("bench_verifier", argv)

    def page(analysis: str) -> str:
        body = [f"# Batched verifier benchmark\n\nReproduce (JSON: `{Path(a.out).name}.json`):\n\n```bash\n{command}\n```\n",
                analysis, ""]  # fmt: skip
        for res in results.values():
            body.append(markdown(res).replace("\n## ", "\n### ").replace("# Verifier evaluation:", "##", 1))
        return "\n".join(body)

    write_report(a.out, {"command": command, **results}, page)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
