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
from dataclasses import dataclass
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
    ``num_speculative_tokens``: the default chain length in the speculators config; null = the drafter's depth
    (DFlash: B - 1, the only count its export takes).
    """

    checkpoint: str | None = None
    format: str | None = None
    output_dir: str | None = None  # null = outputs/export/<run name>-<format>
    target_path: str | None = None
    verifier: str | None = None
    num_speculative_tokens: int | None = None
    overwrite: bool = False


def run(c) -> Path:
    """Export per ``c`` (an :class:`ExportConfig`); returns the folder written.

    Raises:
        ConfigError: no checkpoint; a random tiny target with no ``target_path``; an existing output folder.
        ExportError: the recipe has no such format, or the format cannot hold the drafter exactly.
    """
    from drafttrain.config import ConfigError, TargetConfig
    from drafttrain.drafters import Drafter
    from drafttrain.drafters.base import DRAFTER_CONFIG
    from drafttrain.export import export_drafter, resolve_format
    from drafttrain.export.common import drafter_dir, run_config, write_json
    from drafttrain.target import load_target, resolve_target_dir

    if not c.checkpoint:
        raise ConfigError("checkpoint is required (checkpoint=outputs/<run> or a drafter folder)")
    try:
        ddir = drafter_dir(c.checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"checkpoint={c.checkpoint}: {err}") from None
    recipe = json.loads((ddir / DRAFTER_CONFIG).read_text())["name"]
    fmt = resolve_format(recipe, c.format)  # before any model loads
    run_cfg = run_config(ddir)
    tcfg = TargetConfig(**(run_cfg or {}).get("target", {}))
    if c.target_path:
        tcfg.path, tcfg.random_init = c.target_path, False
    elif tcfg.random_init:
        raise ConfigError(f"{c.checkpoint} was trained on a random tiny target that exists on no disk: save that "
                          "target (save_pretrained) and pass target_path=DIR")  # fmt: skip
    out = Path(c.output_dir or f"outputs/export/{Path(c.checkpoint).resolve().name}-{fmt}")
    if out.exists() and any(out.iterdir()) and not c.overwrite:
        raise ConfigError(f"output_dir {out} is not empty (overwrite=true replaces its files)")
    target_dir = resolve_target_dir(tcfg)
    target = load_target(tcfg)
    drafter = Drafter.from_pretrained(ddir, target).eval()
    verifier = c.verifier or str(Path(target_dir).resolve())
    n_spec = int(c.num_speculative_tokens or drafter.draft_depth)
    _, engine_cfg = export_drafter(drafter, fmt, out, verifier=verifier, num_speculative_tokens=n_spec,
                                   target_config=target.config)  # fmt: skip
    info = {"format": fmt, "recipe": recipe, "checkpoint": str(Path(c.checkpoint).resolve()),
            "target_path": str(Path(target_dir).resolve()), "verifier": verifier,
            "num_speculative_tokens": n_spec, "commands": serve_commands(fmt, out, verifier, n_spec, engine_cfg)}  # fmt: skip
    write_json(out / "export_info.json", info)
    log.info("wrote %s (%s, from %s)", out, fmt, ddir)
    return out


def serve_commands(fmt: str, out: Path, verifier: str, n_spec: int, engine_cfg: dict) -> list[str]:
    """The commands that serve the exported folder (also printed and written to export_info.json)."""
    method = {"speculators": "eagle3", "vllm_medusa": "medusa", "vllm_eagle": "eagle", "dflash": "dflash"}.get(fmt)
    if fmt == "sglang":
        return [f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {n_spec} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {n_spec + 1}"]  # fmt: skip
    spec = {"model": str(out), "method": method, "num_speculative_tokens": n_spec}
    if engine_cfg.get("speculators_model_type") == "peagle" or engine_cfg.get("parallel_drafting"):
        spec["parallel_drafting"] = True
    cmds = [f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'"]
    if fmt in ("speculators", "dflash"):
        cmds.insert(0, f"vllm serve {out}")
    return cmds


def main(argv: list[str] | None = None) -> None:
    from drafttrain.cliconfig import parse_cli

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = run(parse_cli(ExportConfig, argv))
    info = json.loads((out / "export_info.json").read_text())
    print(f"[drafttrain] exported {info['recipe']} -> {out} ({info['format']}); serve it with:", flush=True)
    for cmd in info["commands"]:
        print("  " + cmd, flush=True)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)  # ExportError is a ConfigError: one line, exit status 2
