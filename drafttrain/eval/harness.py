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

from drafttrain.compose import build_run, drafter_dir, inference_drafter
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


# ---------------------------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------------------------


def _run_record(run, method: str, mode: str, batch_size: int) -> dict[str, Any]:
    st = run.stats
    return {
        "method": method,
        "mode": mode,
        "batch_size": batch_size,
        "tokens_per_s": st.tokens_per_s,
        "decode_tokens_per_s": st.decode_tokens_per_s,  # the decoding steps alone (prompt forwards left out)
        "seconds": st.seconds,
        "prefill_seconds": st.prefill_seconds,
        "generated_tokens": st.generated,
        "tau": st.tau,
        "forwards": st.forwards,
        "sequence_steps": st.seq_steps,
        "mean_tree_nodes": st.tree_nodes / max(st.seq_steps, 1),
        "draft_seconds": st.draft_seconds,
        "verify_forward_seconds": st.forward_seconds,
        "padding_ratio": st.padding_ratio,
        "input_padding_ratio": st.input_padding_ratio,
        "kv_padding_ratio": st.kv_padding_ratio,
        "window_padding_ratio": st.window_padding_ratio,
        "input_padding": st.input_padding,
        "kv_padding": st.kv_padding,
        "input_tokens": st.input_tokens,
        "kv_tokens": st.kv_tokens,
        "prefill_padding": st.prefill_padding,
        "accept_hist": {int(k): v for k, v in sorted(st.accept_hist.items())},
        "depth_acceptance": st.depth_acceptance(),
    }


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
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.methods import METHODS, MethodContext
    from drafttrain.verify.methods.mtad import output_perplexity
    from drafttrain.verify.proposers import PlainProposer

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

    def engine(proposer, bs, mode, max_new_tokens=c.max_new_tokens):
        return SpecEngine(target, proposer, batch_size=bs, max_new_tokens=max_new_tokens, mode=mode,
                          sampling=sampling, stop_token_ids=stops, seed=c.seed, pack_inputs=c.pack_inputs,
                          compile_target=c.compile_target and bs == 1)  # fmt: skip

    compile_seconds = 0.0
    if c.compile_target and 1 in c.batch_sizes:  # compile before any timed run (one graph set per feature-layer set)
        warm = engine(PlainProposer(), 1, c.plain_mode)
        for layers in {None, tuple(getattr(drafter, "feature_layers", None) or ()) or None}:
            compile_seconds += warm.warm_up_compiled(feature_layers=layers)
        log.info("compiled the target forward for batch 1 in %.0f s", compile_seconds)

    ctx = MethodContext(config=c, target=target, drafter=drafter, prompts=prompts)
    variants = [v for spec in specs for v in spec.build(ctx)]  # every speculative run of a batch size

    if c.warmup:  # first calls allocate and initialise: keep them out of the timed runs
        few = prompts[:2] if len(prompts) > 1 else prompts * 2
        for mode in sorted(set(c.modes) | {c.plain_mode}):
            warm = engine(PlainProposer(), 2, mode, max_new_tokens=8).run(few)
            for v in variants:
                prop = v.warm() if v.warm is not None else v.make(2, [r.tokens for r in warm.results])
                engine(prop, 2, mode, max_new_tokens=8).run(few)

    runs: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    run_outputs: list[list[list[int]]] = []  # per run (in `runs` order): its outputs, for perplexity
    t_all = time.perf_counter()
    for bs in c.batch_sizes:
        plain = engine(PlainProposer(), bs, c.plain_mode).run(prompts, progress=c.progress and f"plain b={bs}")
        plain_rec = _run_record(plain, "plain", c.plain_mode, bs)
        plain_rec["speedup"] = plain_rec["speedup_decode"] = 1.0
        plain_rec["lossless"] = True
        plain_tokens = [r.tokens for r in plain.results]
        runs.append(plain_rec)
        run_outputs.append(plain_tokens)
        outputs[f"plain/b{bs}"] = plain_tokens
        for v in variants:
            for mode in c.modes:
                proposer = v.make(bs, plain_tokens)  # a fresh one per run (proposers keep per-sequence state)
                lossless = bool(getattr(proposer, "lossless", True))
                spec = engine(proposer, bs, mode).run(prompts, progress=c.progress and f"{v.label} {mode} b={bs}")
                rec = _run_record(spec, v.label, mode, bs)
                rec["lossless"] = lossless
                if v.finish is not None:
                    v.finish(proposer, rec, bs)
                rec["speedup"] = rec["tokens_per_s"] / max(plain_rec["tokens_per_s"], 1e-9)
                rec["speedup_decode"] = rec["decode_tokens_per_s"] / max(plain_rec["decode_tokens_per_s"], 1e-9)
                toks = [r.tokens for r in spec.results]
                outputs[f"{v.label}/{mode}/b{bs}"] = toks
                if sampling.greedy:
                    bad = [i for i, (a, b) in enumerate(zip(toks, plain_tokens)) if a != b]
                    rec["greedy_equal"] = not bad
                    rec["equal_fraction"] = 1 - len(bad) / len(toks)
                    rec["mismatches"] = [ids[i] for i in bad]
                    if lossless:
                        rec["mismatch_diagnosis"] = {ids[i]: diagnose_mismatch(target, prompts[i], toks[i], plain_tokens[i])
                                                     for i in bad}  # fmt: skip
                        if bad:
                            log.error("b=%d %s %s: speculative output differs from plain greedy on prompts %s: %s", bs,
                                      v.label, mode, rec["mismatches"], rec["mismatch_diagnosis"])  # fmt: skip
                runs.append(rec)
                run_outputs.append(toks)
                log.info("b=%d %s %s: tau %.3f, %.1f tok/s (plain %.1f), speedup %.2f, padding ratio %.3f%s", bs, v.label,
                         mode, rec["tau"], rec["tokens_per_s"], plain_rec["tokens_per_s"], rec["speedup"],
                         rec["padding_ratio"], "" if lossless else " (lossy)")  # fmt: skip
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
