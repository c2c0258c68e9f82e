"""The sweep over every decoder-only text causal LM transformers exports (:mod:`drafttrain.sweep`): one tiny
random target per class, each either trained (the main job's drafter and EAGLE-3, a few steps) and decoded through
the engine greedy-equal to its own forward, refused in one line, or not buildable from its tiny config.

    python -m scripts.sweep_targets                       # every class: docs/benchmarks/families.{json,md} + README's table
    python -m scripts.sweep_targets 'only=[Qwen3_5ForCausalLM,MambaForCausalLM]' readme=false   # a few classes

Writes ``docs/benchmarks/families.json`` / ``.md`` (one row per class) and, with ``readme=true`` (default, the whole
sweep only), the family table of README.md between its ``<!-- sweep table -->`` markers (:func:`readme_table`). One
thread, a few seconds per class (about 4 minutes for the whole sweep on a 2-core host).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import REPO, machine, machine_line, reproduce, write_report

MARK = re.compile(r"<!-- sweep table -->.*?<!-- /sweep table -->", re.S)


@dataclass
class SweepConfig:
    only: list[str] = field(default_factory=list)  # class names (empty: every class)
    out: str = "docs/benchmarks/families"
    readme: bool = True  # rewrite README.md's table (whole sweep only)
    threads: int = 1


def _kinds(row: dict) -> str:
    kinds = row.get("layer_kinds") or []
    order = [k for k in ("attention", "recurrent", "hybrid", "none") if k in kinds]
    return " + ".join(order)


def _reason(row: dict) -> str:
    """A refusal's cause: the part that failed, without the class name and the advice on what still works."""
    text = row["reason"]
    text = text.split(": ", 1)[1] if text.startswith(row["name"] + ":") else text
    text = text.split("; HF generation")[0].split("; drafttrain drives")[0].split("; the target itself")[0]
    return text.replace("|", "\\|")  # inside a markdown table cell


def _group(row: dict) -> str:
    """The README's row of a class that does not train: what refused it, in a few words (families.md has the line)."""
    if row["status"] == "crash":
        return "crash"
    if row["status"] == "cannot build":
        return "cannot build: its tiny config (sweep limit)"
    text = row["reason"]
    if "DynamicCache" in text or "writes nothing" in text:
        return "refused: keeps a cache of its own"
    if "drafttrain's forward" in text:
        return "refused: its logits are not the LM head of its last hidden state"
    if "the engine (" in text:
        return "refused: its forward over a cache differs from its full forward, or fails, in the engine"
    if "drafter" in text:
        return "refused: the drafter cannot start from it"
    return "refused: its structure cannot be read (layers, hidden states, final norm)"


def readme_table(rows: list[dict], transformers_version: str) -> str:
    """README's family table (between the markers): the counts, the classes that train by layer kinds, and every
    refusal and unbuildable class with its cause. Deterministic for one transformers version."""
    from drafttrain.sweep import summary, SweepRow

    counts = summary([SweepRow(**r) for r in rows])
    swept = len(rows) - counts.get("excluded", 0)
    lines = ["<!-- sweep table -->",
             f"Every causal LM class transformers {transformers_version} exports ({len(rows)}; `python -m "
             f"scripts.sweep_targets`, [families.md](docs/benchmarks/families.md)): {counts.get('excluded', 0)} are not "
             f"decoder-only text models (excluded with their reason); of the other {swept}, **{counts.get('trains', 0)} "
             f"train** (the main job's drafter and EAGLE-3, a few steps on a tiny random target, decoded through the "
             f"engine greedy-equal to the model's own forward), **{counts.get('refused', 0)} are refused** in one line "
             f"before any work (the pre-flight check), {counts.get('cannot build', 0)} do not build from the sweep's "
             f"tiny config, {counts.get('crash', 0)} crash.",
             "The reason of each refusal, one line per class: [families.md](docs/benchmarks/families.md).",
             "", "| outcome | layer kinds | classes |", "|---|---|---|"]  # fmt: skip
    by_kind: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "trains":
            by_kind.setdefault(_kinds(r), []).append(r["name"])
    for kinds, names in sorted(by_kind.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"| trains ({len(names)}) | {kinds} | {', '.join(n.removesuffix('ForCausalLM') for n in names)} |")
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] in ("refused", "cannot build", "crash"):
            groups.setdefault(_group(r), []).append(r["name"].removesuffix("ForCausalLM"))
    for label, names in groups.items():
        lines.append(f"| {label} ({len(names)}) | | {', '.join(names)} |")
    lines.append("<!-- /sweep table -->")
    return "\n".join(lines)


def _markdown(result: dict, cmd: str, analysis: str) -> str:
    rows = result["rows"]
    out = ["# Every causal LM class transformers ships, on drafttrain", "",
           f"`{cmd}` (transformers {result['transformers']}, {machine_line(result['machine'])}, "
           f"{result['seconds']:.0f} s). One tiny random target per class ({'; '.join(result['sizes'])}), weights "
           "redrawn N(0, 0.3) so continuations vary. **trains**: the pre-flight check passes, the main job's drafter "
           "(`parallelspec_eagle3`) and `eagle3` each train 2 steps on the target's own features and decode through "
           "the engine at batch 2 (a tree of widths [2, 1]; a chain on a target with recurrent layers) token for "
           "token the model's own greedy tokens. **refused**: the pre-flight check's one line. **cannot build**: the "
           "class's tiny config does not build (a limit of the sweep's shrinking rules). **excluded**: not a "
           "decoder-only text model.", "", analysis, "",
           "| class | outcome | layer kinds | seconds | reason |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        reason = r["reason"][:300].replace("|", "\\|")
        out.append(f"| {r['name']} | {r['status']} | {_kinds(r)} | {r['seconds']:.1f} | {reason} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    import datetime
    import warnings

    import torch
    import transformers

    from drafttrain.cliconfig import parse_cli
    from drafttrain import sweep
    from drafttrain.target import tiny
    from transformers import AutoTokenizer

    from drafttrain.assets import converted_target_dir

    c = parse_cli(SweepConfig, argv)
    torch.set_num_threads(c.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("drafttrain").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(converted_target_dir(None))  # the SmolLM2 tokenizer (packaged)
    names = c.only or sweep.causal_lm_classes()
    t0 = time.perf_counter()
    rows = []
    for name in names:
        row = sweep.sweep_one(name, tok)
        rows.append(row.to_dict())
        print(f"{name:45s} {row.status:13s} {row.reason[:160]}", flush=True)
    result = {"rows": rows, "summary": sweep.summary([sweep.SweepRow(**r) for r in rows]),
              "transformers": transformers.__version__, "machine": machine(), "seconds": time.perf_counter() - t0,
              "date": datetime.date.today().isoformat(),
              "sizes": [f"{tiny.NUM_LAYERS} layers", f"d = {tiny.D}", "the SmolLM2 tokenizer"]}  # fmt: skip
    cmd = reproduce("sweep_targets", argv)
    if not c.only:
        write_report(REPO / c.out, result, lambda analysis: _markdown(result, cmd, analysis))
        if c.readme:
            readme = REPO / "README.md"
            text = readme.read_text()
            if not MARK.search(text):
                raise SystemExit("README.md has no <!-- sweep table --> ... <!-- /sweep table --> markers")
            readme.write_text(MARK.sub(lambda _: readme_table(rows, transformers.__version__), text))
    print(result["summary"])
    return result


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
