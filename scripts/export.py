"""Export a trained drafter to a folder a serving engine loads (vLLM speculators / Medusa / EAGLE-1, SGLang).

    python -m scripts.export checkpoint=outputs/eagle3-smollm2-135m-instruct                    # speculators (vLLM)
    python -m scripts.export checkpoint=outputs/eagle3-smollm2-135m-instruct format=sglang
    python -m scripts.export checkpoint=outputs/medusa-smollm2-135m-instruct output_dir=exported/medusa

Keys: :class:`ExportConfig` below (``--help`` lists them); a typo'd key fails before any model
loads, and a recipe without an engine format fails with the formats that exist. Writes the engine's
``config.json`` + ``model.safetensors`` and ``export_info.json`` (format, target, the serve commands).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("drafttrain.export")


@dataclass
class ExportConfig:
    """Export a trained drafter to a folder a serving engine loads.

    ``checkpoint``: a training run folder (``drafter/`` + ``config.json``) or a drafter folder.
    ``format``: speculators | sglang | vllm_medusa | vllm_eagle | dflash; null = the recipe's default
    (eagle3 / parallelspec_eagle3 -> speculators, medusa -> vllm_medusa, eagle -> vllm_eagle, dflash -> dflash).
    ``target_path``: the target's HF folder; null = the run's own target (the converted SmolLM2 by default).
    A drafter trained on a random ``target=tiny`` needs the tiny target saved to disk and named here.
    ``verifier``: the target name written into the exported config (``vllm serve DIR`` serves it);
    null = the target's folder.
    ``num_speculative_tokens``: the chain length K served; null = chosen by the expected speedup from the
    run's held-out acceptance (``final_metrics.json``) and the target's cost, measured on this host or
    stated by ``gpu_cost_ratio`` (docs/serving.md, "How K is chosen"); the drafter's depth when the run has
    no held-out acceptance (DFlash: B - 1, the only count its export takes).
    """

    checkpoint: str | None = None
    format: str | None = None
    output_dir: str | None = None  # null = outputs/export/<run name>-<format>
    target_path: str | None = None
    verifier: str | None = None
    num_speculative_tokens: int | None = None  # null = chosen from the run's held-out acceptance and the cost
    gpu_cost_ratio: float | None = None  # cost of one more input / a one-input target forward on the serving GPU; null = measure this host
    draft_cost_ratio: float | None = None  # a drafter pass / a target forward; null = their parameter ratio
    overwrite: bool = False
    vllm_profile: bool = True  # K from vLLM's own measured speedups on this host when scripts.serve_check profile_k=... cached them
    serve_loads: list = field(default_factory=lambda: [1, 8])  # requests in flight the measured line must not lose at


def run(c) -> Path:
    """Export per ``c`` (an :class:`ExportConfig`); returns the folder written
    (:func:`drafttrain.export.export_run`).

    Raises:
        ConfigError: no checkpoint; a random tiny target with no ``target_path``; an existing output folder.
        ExportError: the recipe has no such format, or the format cannot hold the drafter exactly.
    """
    from drafttrain.config import ConfigError
    from drafttrain.export import export_run

    if not c.checkpoint:
        raise ConfigError("checkpoint is required (checkpoint=outputs/<run> or a drafter folder)")
    out = export_run(c.checkpoint, c.format, c.output_dir, target_path=c.target_path, verifier=c.verifier,
                     num_speculative_tokens=c.num_speculative_tokens, overwrite=c.overwrite,
                     gpu_cost_ratio=c.gpu_cost_ratio, draft_cost_ratio=c.draft_cost_ratio,
                     vllm_profile=c.vllm_profile, serve_loads=[int(n) for n in c.serve_loads])  # fmt: skip
    log.info("wrote %s (from %s)", out, c.checkpoint)
    return out


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli
    from drafttrain.export import alternative_label

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = run(parse_cli(ExportConfig, argv))
    info = json.loads((out / "export_info.json").read_text())
    sp = info.get("speculation") or {}
    if sp.get("vllm_profile"):
        ch = sp["vllm_profile"]["choice"]
        print(f"[drafttrain] K={ch['k'] or 'none (the target alone)'} ({sp['chosen_by']}): measured "
              + ", ".join(f"{x:.2f}x at {n} request(s) in flight" for n, x in ch["speedup"].items()), flush=True)  # fmt: skip
    elif sp.get("model"):  # the cost model's K held to every serve load: the target alone
        print(f"[drafttrain] K=none, the target alone ({sp['chosen_by']}); the model: K={sp['model']['num_speculative_tokens']} "
              f"expected {sp['model']['expected_speedup']:.2f}x at batch 1, schedule {sp['model']['schedule']}", flush=True)  # fmt: skip
    elif sp.get("expected_speedup") is not None:
        print(f"[drafttrain] K={sp['num_speculative_tokens']} ({sp['chosen_by']}): expected {sp['expected_speedup']:.2f}x "
              f"at batch 1, schedule {sp['schedule']}", flush=True)  # fmt: skip
    print(f"[drafttrain] exported {info['recipe']} -> {out} ({info['format']}); serve it with:", flush=True)
    for cmd in info["commands"]:
        print("  " + cmd, flush=True)
    for alt in info.get("alternatives") or []:  # a K for fewer requests at a time than the line serves
        print(f"[drafttrain] with {alternative_label(alt)} at a time only:\n  {alt['command']}", flush=True)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)  # ExportError is a ConfigError: one line, exit status 2
