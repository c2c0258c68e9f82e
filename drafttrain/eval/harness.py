"""The evaluation harness: what a trained drafter is worth, measured with the bundled batched verifier.

For every batch size it decodes the same prompts with plain decoding (the baseline, through the same
engine) and with speculative decoding in each engine mode (unpadded = EMS-SD, padded = vanilla), in
one process, one after the other, and records τ, tokens/s, speedup, padding, the accepted-length
histogram and per-depth acceptance. Under greedy decoding every speculative output is compared
token for token with the plain output of the same batch size (``greedy_equal``).

The decoding methods compared (``methods=[...]``) come from the registry in
:mod:`drafttrain.verify.methods`: the harness knows no method by name.

Entry point: ``python -m scripts.evaluate`` (conf/evaluate.yaml); library entry: :func:`evaluate`.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

from drafttrain.compose import Run, build_run, drafter_dir, inference_drafter
from drafttrain.config import ConfigError, EvalConfig
from drafttrain.host import describe
from drafttrain.validation import eval_schema, validate_eval

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def check_checkpoint(c: EvalConfig) -> Path | None:
    """Find the drafter folder and check the checkpoint was trained for the configured target (no model loads).

    The run folder's ``target.json`` (written by training) identifies the target by its content
    (:func:`drafttrain.fingerprint.target_fingerprint`: config + weights hash); a run without it (older
    runs, hand-made folders) is checked by ``target.name`` in its ``config.json``.

    Raises:
        FileNotFoundError: no drafter in ``c.checkpoint``.
        ConfigError: the checkpoint was trained for another target (the message names both).
    """
    if c.checkpoint is None:
        return None
    ckpt = Path(c.checkpoint).expanduser()
    ddir = drafter_dir(ckpt)
    for tpath in (ddir.parent / "target.json", ckpt / "target.json", ddir.parent.parent.parent / "target.json"):
        if tpath.is_file():  # written by training: the target's content fingerprint (config + weights)
            from drafttrain.fingerprint import target_fingerprint

            trained = json.loads(tpath.read_text())
            now = target_fingerprint(c.target)
            if trained.get("fingerprint") != now:
                raise ConfigError(
                    f"{c.checkpoint} was trained for target '{trained.get('name')}' (fingerprint {trained.get('fingerprint')}), "
                    f"but this evaluation's target '{c.target.name}' is another model (fingerprint {now}): pass the "
                    f"target it was trained for (target=... / target.path=...)"
                )
            return ddir
    for cfg_path in (ddir.parent / "config.json", ckpt / "config.json"):
        if cfg_path.is_file():
            trained = json.loads(cfg_path.read_text()).get("target", {})
            if trained.get("name") not in (None, c.target.name):
                raise ConfigError(
                    f"{c.checkpoint} was trained for target '{trained.get('name')}', not '{c.target.name}': "
                    f"pass target={trained.get('name')} (or the matching target.path)"
                )
            break
    return ddir


def prompt_rows(c: EvalConfig) -> list[dict]:
    """The evaluation's prompt rows (``c.prompts``, offset, stride, limit), read before any model loads.

    Raises:
        ConfigError: an unknown set, a missing, empty or malformed prompts file (one line naming the cause and
            the file's line), or no prompt left at ``prompt_offset``.
    """
    from drafttrain.cliconfig import ConfigError
    from drafttrain.data.sources import load_eval_prompts

    try:
        rows = load_eval_prompts(c.prompts, limit=c.num_prompts, offset=c.prompt_offset, stride=c.prompt_stride)
    except ValueError as err:
        raise ConfigError(f"prompts={c.prompts}: {err}") from None
    if not rows:
        raise ConfigError(f"prompts={c.prompts}: no prompts at prompt_offset={c.prompt_offset}")
    return rows


def load_prompts(c: EvalConfig, tokenizer, rows: list[dict] | None = None) -> tuple[list[str], list[list[int]]]:
    """Prompt ids (chat template applied) and their token ids (``rows``: :func:`prompt_rows`, read when None)."""
    from drafttrain.data.template import prompt_ids

    rows = prompt_rows(c) if rows is None else rows
    return [r["id"] for r in rows], [prompt_ids(tokenizer, r["messages"]) for r in rows]


def load_drafter(c: EvalConfig, ddir: Path | None, target):
    """The checkpoint's drafter in eval mode, or (no checkpoint, ``untrained_drafter``) a fresh
    ParallelSpec drafter with its class defaults, seeded by ``c.seed`` (:func:`inference_drafter`)."""
    return inference_drafter(target, ddir, untrained_config={}, seed=c.seed)


def diagnose_mismatch(target, prompt: list[int], spec: list[int], plain: list[int]) -> dict[str, Any]:
    """Where a speculative output first leaves the plain one, and the target's top-2 logit gap there.

    A gap of ~1e-5 means a near-tie that float reassociation (different batch shapes, kernels) can flip;
    a large gap means a real bug.
    """
    i = next((k for k, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    logits = target.forward(torch.tensor([prompt + plain[:i]], device=target.device)).logits[0, -1]
    top = torch.topk(logits, 2).values
    return {"position": i, "top2_gap": float(top[0] - top[1])}


def run_git_sha() -> str | None:
    """The code's git commit (``DRAFTTRAIN_GIT_SHA`` wins: runs from an exported copy of the repository)."""
    import os

    from drafttrain.fingerprint import git_sha

    return os.environ.get("DRAFTTRAIN_GIT_SHA") or git_sha()


def evaluate(cfg) -> dict[str, Any]:
    """Run the evaluation described by ``cfg`` (a composed ``conf/evaluate.yaml``, a dict, or a
    validated :class:`~drafttrain.config.EvalConfig`) and write ``results.json``, ``report.md`` and
    ``plots/`` to ``output_dir``.

    Every selected decoding method is a :class:`~drafttrain.verify.methods.registry.Method` of the
    registry: its factory turns the loaded target (and drafter) into variants, each run per batch size
    and engine mode after the plain baseline of that batch size. A run's ``lossless`` flag is its
    proposer's ``lossless`` attribute (default True); under greedy decoding every run is compared token
    for token with the plain output, and a lossless run that differs is diagnosed and logged as an error.
    Output perplexity under the target is added to every run when ``perplexity`` is true, or (null)
    when some run was lossy.

    Returns:
        The results dict (as written to ``results.json``).

    Raises:
        ConfigError: bad config or a checkpoint trained for another target (before the target loads).
        FileNotFoundError: no drafter in the checkpoint folder, or a file a method needs (its preflight).
    """
    c = cfg if isinstance(cfg, eval_schema()) else validate_eval(cfg)
    ddir = check_checkpoint(c)
    from drafttrain.data.template import end_of_turn_ids
    from drafttrain.eval.report import write_report
    from drafttrain.sampling import SamplingParams
    from drafttrain.eval.driver import PLAIN, EvalPlan, run_plan
    from drafttrain.verify.methods import METHODS, MethodContext
    from drafttrain.verify.methods.mtad import output_perplexity

    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    out_dir = Path(c.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = c.method_names()
    specs = [METHODS[m] for m in methods]
    for spec in specs:  # before the target loads: a missing file fails fast
        if spec.preflight is not None:
            spec.preflight(c)
    rows = prompt_rows(c)  # a missing, empty or malformed prompts file too
    target = build_run(c).target
    from drafttrain.preflight import check_target

    with torch.random.fork_rng(devices=[]):  # before any work: structure, forward, the engine (one line if it fails)
        check_target(target, engine=True)
    if target.recurrent and any(v is not None for v in (c.tree.widths, c.tree.budget, c.tree.choices)):
        from drafttrain.target import families
        from drafttrain.target.families import UnsupportedTarget

        raise UnsupportedTarget(f"{families.recurrent_layers_text(target)}: the engine verifies draft chains on this "
                                "target (a recurrent state follows one sequence), and tree.widths / tree.budget / "
                                "tree.choices ask for a tree: set them to null")  # fmt: skip
    drafter = load_drafter(c, ddir, target) if any(s.needs_drafter for s in specs) else None
    ids, prompts = load_prompts(c, target.tokenizer, rows)
    stops = c.stop_token_ids if c.stop_token_ids is not None else sorted(end_of_turn_ids(target.tokenizer))
    sampling = SamplingParams(c.temperature, c.top_p, c.top_k)
    log.info("evaluating %d prompts of %s, batch sizes %s, modes %s, methods %s", len(prompts), c.prompts,
             c.batch_sizes, c.modes, methods)  # fmt: skip

    ctx = MethodContext(config=c, target=target, drafter=drafter, prompts=prompts)
    variants = [v for spec in specs for v in spec.build(ctx)]  # every speculative run of a batch size
    plan = EvalPlan(prompts, variants, batch_sizes=tuple(c.batch_sizes), max_new_tokens=c.max_new_tokens,
                    modes=tuple(c.modes), plain_mode=c.plain_mode, unit="run", plain_at=0, stop_token_ids=stops,
                    sampling=sampling, seed=c.seed, pack_inputs=c.pack_inputs, compile_target=c.compile_target,
                    warm_up="runs" if c.warmup else "none", progress=c.progress)  # fmt: skip
    t_all = time.perf_counter()
    records = run_plan(Run(target, drafter), plan)
    runs: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    run_outputs: list[list[list[int]]] = []  # per run (in `runs` order): its outputs, for perplexity
    plain_of: dict[int, list[list[int]]] = {}
    compile_seconds = 0.0
    for rec in records:
        bs, toks = rec["batch_size"], rec.pop("tokens")
        compile_seconds = max(compile_seconds, rec.pop("compile_seconds"))
        del rec["sequence_tau"], rec["prompts"]  # results.json: per-run figures (every run decodes every prompt)
        if rec["method"] == PLAIN:
            plain_of[bs] = toks
            outputs[f"plain/b{bs}"] = toks
        else:
            outputs[f"{rec['method']}/{rec['mode']}/b{bs}"] = toks
        if "mismatches" in rec:
            bad = rec["mismatches"]
            rec["mismatches"] = [ids[i] for i in bad]
            if rec["lossless"] and rec["method"] != PLAIN:
                rec["mismatch_diagnosis"] = {ids[i]: diagnose_mismatch(target, prompts[i], toks[i], plain_of[bs][i])
                                             for i in bad}  # fmt: skip
                if bad:
                    log.error("b=%d %s %s: speculative output differs from plain greedy on prompts %s: %s", bs,
                              rec["method"], rec["mode"], rec["mismatches"], rec["mismatch_diagnosis"])  # fmt: skip
        runs.append(rec)
        run_outputs.append(toks)
        if rec["method"] != PLAIN:
            log.info("b=%d %s %s: tau %.3f, %.1f tok/s, speedup %.2f, padding ratio %.3f%s", bs, rec["method"],
                     rec["mode"], rec["tau"], rec["tokens_per_s"], rec["speedup"], rec["padding_ratio"],
                     "" if rec["lossless"] else " (lossy)")  # fmt: skip
    total_seconds = time.perf_counter() - t_all
    lossy = list(dict.fromkeys(r["method"] for r in runs if not r["lossless"]))
    if c.perplexity if c.perplexity is not None else bool(lossy):  # untimed, after every run
        for rec, toks in zip(runs, run_outputs):
            rec["perplexity"] = output_perplexity(target, prompts, toks)
    results = {
        "command_config": to_dict_eval(c),
        "git_sha": run_git_sha(),
        "machine": {
            "device": str(target.device), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "processor": platform.processor() or platform.machine(),
        },  # fmt: skip
        "host": describe(),  # CPU model, ISA, native bf16, cores, OS, GPU (drafttrain.host)
        "drafter": {"proposer": methods[0] if len(methods) == 1 else "+".join(methods), "methods": methods,
                    "checkpoint": str(ddir) if ddir else None,
                    "untrained": ddir is None and drafter is not None,
                    "name": drafter.name if drafter is not None else None,
                    "draft_depth": drafter.draft_depth if drafter is not None else None,
                    "num_mask_tokens": drafter.config.get("num_mask_tokens") if drafter is not None else None,
                    "drafting": drafter.spec.drafting if drafter is not None else None,
                    "feature_layers": list(drafter.feature_layers) if drafter is not None else None,
                    **ctx.drafter_info},  # fmt: skip
        "lossy_methods": lossy,
        **ctx.results,
        "prompts": {"set": c.prompts, "ids": ids, "num": len(ids), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts)},
        "greedy": sampling.greedy,
        "greedy_equal": all(r.get("greedy_equal", True) for r in runs if r["lossless"]) if sampling.greedy else None,
        "runs": runs,
        "total_seconds": total_seconds,
        "compile_seconds": compile_seconds,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    with (out_dir / "outputs.jsonl").open("w") as f:
        for key, toks in outputs.items():
            for pid, t in zip(ids, toks):
                f.write(json.dumps({"run": key, "id": pid, "tokens": t}) + "\n")
    write_report(results, out_dir, plots=c.plots)
    return results


def to_dict_eval(c: EvalConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(c), resolve=True)


__all__ = ["evaluate", "check_checkpoint", "load_prompts", "load_drafter", "run_git_sha"]
