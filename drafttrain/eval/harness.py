"""The evaluation harness: what a trained drafter is worth, measured with the bundled batched verifier.

For every batch size it decodes the same prompts with plain decoding (the baseline, through the same
engine) and with speculative decoding in each engine mode (unpadded = EMS-SD, padded = vanilla), in
one process, one after the other, and records τ, tokens/s, speedup, padding, the accepted-length
histogram and per-depth acceptance. Under greedy decoding every speculative output is compared
token for token with the plain output of the same batch size (``greedy_equal``).

Entry point: ``python -m scripts.evaluate`` (conf/evaluate.yaml); library entry: :func:`evaluate`.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from drafttrain.config import ConfigError, EvalConfig, validate_eval

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def _drafter_dir(checkpoint: Path) -> Path:
    from drafttrain.drafters.base import DRAFTER_CONFIG

    if (checkpoint / DRAFTER_CONFIG).is_file():
        return checkpoint
    if (checkpoint / "drafter" / DRAFTER_CONFIG).is_file():
        return checkpoint / "drafter"
    raise FileNotFoundError(f"no drafter checkpoint in {checkpoint} (expected drafter/{DRAFTER_CONFIG} or {DRAFTER_CONFIG})")


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
    ddir = _drafter_dir(ckpt)
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


def load_prompts(c: EvalConfig, tokenizer) -> tuple[list[str], list[list[int]]]:
    """Prompt ids (chat template applied) and their token ids."""
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids

    rows = load_eval_prompts(c.prompts, limit=c.num_prompts, offset=c.prompt_offset)
    if not rows:
        raise ValueError(f"no prompts in {c.prompts!r} at offset {c.prompt_offset}")
    return [r["id"] for r in rows], [prompt_ids(tokenizer, r["messages"]) for r in rows]


def make_proposer(c: EvalConfig, drafter):
    """The drafter's own proposer (:func:`~drafttrain.verify.proposers.proposer_for`) with the configured tree."""
    from drafttrain.verify.proposers import proposer_for
    from drafttrain.verify.tree import NAMED_CHOICES

    choices = c.tree.choices
    if isinstance(choices, str):
        choices = NAMED_CHOICES[choices]
    return proposer_for(drafter, widths=c.tree.widths, budget=c.tree.budget, choices=choices,
                        batched=c.tree.batched_drafting)


def measure_forward_seconds(target, batch_size: int, lengths, context: int = 256, steps: int = 6,
                            mode: str = "unpadded") -> dict[tuple[int, int], float]:  # fmt: skip
    """Mean time of one verification forward of ``batch_size`` sequences x s tokens (root + a chain of
    s - 1 drafts) through the engine itself (same cache, masks and attention path as the timed runs),
    over ``context`` cached tokens, for every s in ``lengths``: the forward-time curve of SSSD §3.2 / Fig. 2.

    The drafts are random tokens (rejected), so every step is one forward at the same context length;
    a short run at each size comes first as a warm-up.

    Returns:
        ``{(batch_size, s): seconds}`` (the table :func:`~drafttrain.verify.sssd.plan_speculation_length` reads).
    """
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.proposers import PlainProposer
    from drafttrain.verify.tree import DraftTree

    g = torch.Generator().manual_seed(0)
    vocab = int(target.config.vocab_size)
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch_size)]

    class FixedChain(PlainProposer):  # a chain of n random drafts per sequence: the forward shape, no drafting cost
        name = "timing"

        def __init__(self, n):
            self.n = n

        def draft(self, slots, sampling=None, generator=None):
            return [DraftTree(torch.randint(0, vocab, (self.n,), generator=g), torch.arange(-1, self.n - 1))
                    for _ in slots]  # fmt: skip

    out = {}
    with torch.no_grad():
        for s in sorted(set(int(x) for x in lengths)):
            for n_steps, keep in ((2, False), (steps, True)):  # warm-up, then timed
                eng = SpecEngine(target, FixedChain(s - 1), batch_size=batch_size, max_new_tokens=n_steps + 1,
                                 mode=mode, stop_token_ids=[-1], initial_capacity=context + 2 * (steps + s))  # fmt: skip
                eng.run(prompts)
                if keep:
                    out[(batch_size, s)] = eng.stats.forward_seconds / max(eng.stats.forwards, 1)
    return out


def plan_sssd_budget(c: EvalConfig, target, batch_size: int) -> dict[str, Any]:
    """The speculation-length planner (SSSD §3.2) for one batch size: forward times measured now on this
    machine, τ(n) from ``c.sssd.tau_table`` (the grid search's simulated acceptance per tree size).

    Raises:
        FileNotFoundError: no τ table (the message names the command that writes it).
    """
    from drafttrain.verify.sssd import plan_speculation_length

    table = Path(c.sssd.tau_table)
    if not table.is_file():
        raise FileNotFoundError(f"no SSSD τ(n) table at {table}: run `python -m scripts.sssd_grid` "
                                f"(or pass sssd.node_budgets=[...])")  # fmt: skip
    tau = {int(n): float(t) for n, t in json.loads(table.read_text())["tau_by_size"].items()}
    fwd = measure_forward_seconds(target, batch_size, [n + 1 for n in tau] + [1], c.sssd.planner_context,
                                  mode=c.modes[0])  # fmt: skip
    plan = plan_speculation_length(fwd, tau, batch_size)
    return {"batch_size": batch_size, "best_size": plan.best_size, "expected_speedup": plan.speedup,
            "tau_by_size": tau, "forward_seconds": {str(k[1]): v for k, v in fwd.items()},
            "expected_tokens_per_s": {str(n): v for n, v in plan.tokens_per_s.items()}}  # fmt: skip


def diagnose_mismatch(target, prompt: list[int], spec: list[int], plain: list[int]) -> dict[str, Any]:
    """Where a speculative output first leaves the plain one, and the target's top-2 logit gap there.

    A gap of ~1e-5 means a near-tie that float reassociation (different batch shapes, kernels) can flip;
    a large gap means a real bug.
    """
    i = next((k for k, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    logits = target.forward(torch.tensor([prompt + plain[:i]], device=target.device)).logits[0, -1]
    top = torch.topk(logits, 2).values
    return {"position": i, "top2_gap": float(top[0] - top[1])}


def _git_sha() -> str | None:
    """The code's git commit (``DRAFTTRAIN_GIT_SHA`` wins: runs from an exported copy of the repository)."""
    import os

    if os.environ.get("DRAFTTRAIN_GIT_SHA"):
        return os.environ["DRAFTTRAIN_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


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
        "seconds": st.seconds,
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
    """Run the evaluation described by ``cfg`` (a composed ``conf/evaluate.yaml``, a dict, or an
    :class:`~drafttrain.config.EvalConfig`) and write ``results.json``, ``report.md`` and ``plots/`` to
    ``output_dir``.

    Returns:
        The results dict (as written to ``results.json``).

    Raises:
        ConfigError: bad config or a checkpoint trained for another target (before the target loads).
        FileNotFoundError: no drafter in the checkpoint folder.
    """
    c = cfg if isinstance(cfg, EvalConfig) else validate_eval(cfg)
    ddir = check_checkpoint(c)
    from drafttrain.drafters import Drafter, build_drafter
    from drafttrain.data.template import end_of_turn_ids
    from drafttrain.eval.report import write_report
    from drafttrain.target import load_target
    from drafttrain.sampling import SamplingParams
    from drafttrain.verify.engine import SpecEngine
    from drafttrain.verify.proposers import PlainProposer, ReplayProposer

    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    out_dir = Path(c.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = list(c.methods) if c.methods is not None else [c.proposer]
    needs_drafter = bool({"parallelspec", "drafter", "mcsd", "mtad"} & set(methods))
    datastore = None
    if "sssd" in methods:  # before the target loads: a missing datastore fails fast
        from drafttrain.verify.datastore import Datastore

        if not Path(c.sssd.datastore).is_dir():
            raise FileNotFoundError(f"no SSSD datastore at {c.sssd.datastore}: run `python -m scripts.build_datastore`")
        datastore = Datastore.load(c.sssd.datastore)
    target = load_target(c.target)
    if not needs_drafter:
        drafter = None
    elif ddir is not None:
        drafter = Drafter.from_pretrained(ddir, target).eval()
    else:
        torch.manual_seed(c.seed)
        drafter = build_drafter("parallelspec", {}, target).eval()  # its class defaults
    if drafter is not None and drafter.spec.drafting != "parallel" and "mcsd" in methods:
        raise ValueError(f"mcsd grows its trees from the per-depth distributions of one drafter pass: use a "
                         f"parallel drafter's checkpoint for it (parallelspec, parallelspec_eagle, medusa), not "
                         f"'{drafter.name}', which drafts {drafter.spec.drafting}")
    ids, prompts = load_prompts(c, target.tokenizer)
    stops = c.stop_token_ids if c.stop_token_ids is not None else sorted(end_of_turn_ids(target.tokenizer))
    sampling = SamplingParams(c.temperature, c.top_p)
    log.info("evaluating %d prompts of %s, batch sizes %s, modes %s", len(prompts), c.prompts, c.batch_sizes, c.modes)

    def engine(proposer, bs, mode, max_new_tokens=c.max_new_tokens):
        return SpecEngine(target, proposer, batch_size=bs, max_new_tokens=max_new_tokens, mode=mode,
                          sampling=sampling, stop_token_ids=stops, seed=c.seed, pack_inputs=c.pack_inputs)  # fmt: skip

    from drafttrain.verify.mcsd import MCSDConfig
    from drafttrain.verify.methods import MCSDProposer, MTADEagleProposer, MTADProposer, SSSDProposer
    from drafttrain.verify.mtad import output_perplexity
    from drafttrain.verify.sssd import SSSDConfig, SSSDDrafter

    sssd_drafter = None
    if datastore is not None:
        sssd_drafter = SSSDDrafter(SSSDConfig(max_prefix_len=c.sssd.max_prefix_len, max_depth=c.sssd.max_depth),
                                   datastore, num_threads=c.sssd.num_threads)  # fmt: skip
    plans: dict[int, dict[str, Any]] = {}
    decision_model = None
    if "mcsd" in methods and c.mcsd.decision_model:
        from drafttrain.decision import load_decision_model

        decision_model = load_decision_model(c.mcsd.decision_model)
    decisions_file = Path(c.mcsd.decisions_out) if "mcsd" in methods and c.mcsd.decisions_out else None

    def sssd_budget(bs: int) -> int:
        if bs not in plans:
            plans[bs] = plan_sssd_budget(c, target, bs)
            log.info("SSSD planner, batch %d: tree size %d (expected speedup %.2f)", bs, plans[bs]["best_size"],
                     plans[bs]["expected_speedup"])  # fmt: skip
        return plans[bs]["best_size"]

    # (label, factory(batch_size, plain outputs) -> proposer) for every speculative run of a batch size
    variants: list[tuple[str, Any]] = []
    for m in methods:
        if m == "replay":
            variants.append(("replay", lambda bs, refs: ReplayProposer(
                {tuple(p): r for p, r in zip(prompts, refs)}, depth=c.replay_depth,
                accept_prob=c.replay_accept_prob, seed=c.seed)))  # fmt: skip
        elif m in ("parallelspec", "drafter"):  # the checkpoint's drafter, drafting its own way (any recipe)
            variants.append((drafter.name, lambda bs, refs: make_proposer(c, drafter)))
        elif m == "sssd" and c.sssd.node_budgets is None:
            variants.append(("sssd", lambda bs, refs: SSSDProposer(sssd_drafter, sssd_budget(bs))))
        elif m == "sssd":
            for n in c.sssd.node_budgets:
                variants.append((f"sssd_n{n}", lambda bs, refs, n=n: SSSDProposer(sssd_drafter, n)))
        elif m == "mcsd":
            log_dec = c.mcsd.decisions_out is not None
            for w in c.mcsd.target_roots:
                variants.append((f"mcsd_w{w}", lambda bs, refs, w=w: MCSDProposer(
                    drafter, MCSDConfig(tuple(c.mcsd.ks), w), log_decisions=log_dec and w == 1,
                    decision_topk=c.mcsd.decision_topk)))  # fmt: skip
            if decision_model is not None:
                betas = [("mcsd_w1_dm", c.mcsd.beta)] if not c.mcsd.betas else [(f"mcsd_w1_dm_b{b:g}", b) for b in c.mcsd.betas]
                for label, beta in betas:
                    variants.append((label, lambda bs, refs, beta=beta: MCSDProposer(
                        drafter, MCSDConfig(tuple(c.mcsd.ks), 1), decision_model=decision_model, beta=beta)))  # fmt: skip
        elif m == "mtad":
            # an autoregressive drafter gives MTAD the joint q; a parallel one its per-depth marginals
            mtad_cls = MTADEagleProposer if drafter.spec.drafting == "autoregressive" else MTADProposer
            variants.append(("mtad", lambda bs, refs: mtad_cls(drafter, c.mtad.num_beams, c.mtad.num_steps,
                                                               c.mtad.threshold)))  # fmt: skip
    any_lossy = "mtad" in methods or ("mcsd" in methods and max(c.mcsd.target_roots) > 1)
    with_ppl = c.perplexity if c.perplexity is not None else any_lossy

    if c.warmup:  # first calls allocate and initialise: keep them out of the timed runs
        few = prompts[:2] if len(prompts) > 1 else prompts * 2
        for mode in sorted(set(c.modes) | {c.plain_mode}):
            warm = engine(PlainProposer(), 2, mode, max_new_tokens=8).run(few)
            for label, make in variants:  # (the planner is not run for a warm-up)
                prop = SSSDProposer(sssd_drafter, 8) if label == "sssd" else make(2, [r.tokens for r in warm.results])
                engine(prop, 2, mode, max_new_tokens=8).run(few)

    runs: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    t_all = time.perf_counter()
    for bs in c.batch_sizes:
        plain = engine(PlainProposer(), bs, c.plain_mode).run(prompts, progress=c.progress and f"plain b={bs}")
        plain_rec = _run_record(plain, "plain", c.plain_mode, bs)
        plain_rec["speedup"] = 1.0
        plain_rec["lossless"] = True
        plain_tokens = [r.tokens for r in plain.results]
        if with_ppl:
            plain_rec["perplexity"] = output_perplexity(target, prompts, plain_tokens)
        runs.append(plain_rec)
        outputs[f"plain/b{bs}"] = plain_tokens
        for label, make in variants:
            for mode in c.modes:
                proposer = make(bs, plain_tokens)  # a fresh one per run (proposers keep per-sequence state)
                lossless = bool(getattr(proposer, "lossless", True))
                spec = engine(proposer, bs, mode).run(prompts, progress=c.progress and f"{label} {mode} b={bs}")
                rec = _run_record(spec, label, mode, bs)
                rec["lossless"] = lossless
                if decisions_file is not None and getattr(proposer, "decisions", None):
                    decisions_file.parent.mkdir(parents=True, exist_ok=True)
                    with decisions_file.open("a") as f:
                        for row in proposer.decisions:
                            f.write(json.dumps({**row, "prompts": c.prompts, "batch_size": bs}) + "\n")
                    rec["decisions_logged"] = len(proposer.decisions)
                if label.startswith("sssd"):
                    rec["node_budget"] = getattr(proposer, "node_budget", None)
                rec["speedup"] = rec["tokens_per_s"] / max(plain_rec["tokens_per_s"], 1e-9)
                toks = [r.tokens for r in spec.results]
                outputs[f"{label}/{mode}/b{bs}"] = toks
                if with_ppl:
                    rec["perplexity"] = output_perplexity(target, prompts, toks)
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
                                      label, mode, rec["mismatches"], rec["mismatch_diagnosis"])  # fmt: skip
                runs.append(rec)
                log.info("b=%d %s %s: tau %.3f, %.1f tok/s (plain %.1f), speedup %.2f, padding ratio %.3f%s", bs, label,
                         mode, rec["tau"], rec["tokens_per_s"], plain_rec["tokens_per_s"], rec["speedup"],
                         rec["padding_ratio"], "" if lossless else " (lossy)")  # fmt: skip
    results = {
        "command_config": to_dict_eval(c),
        "git_sha": _git_sha(),
        "machine": {
            "device": str(target.device), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "processor": platform.processor() or platform.machine(),
        },  # fmt: skip
        "drafter": {"proposer": methods[0] if len(methods) == 1 else "+".join(methods), "methods": methods,
                    "checkpoint": str(ddir) if ddir else None,
                    "untrained": ddir is None and drafter is not None,
                    "name": drafter.name if drafter is not None else None,
                    "draft_depth": drafter.draft_depth if drafter is not None else None,
                    "num_mask_tokens": drafter.config.get("num_mask_tokens") if drafter is not None else None,
                    "drafting": drafter.spec.drafting if drafter is not None else None,
                    "feature_layers": list(drafter.feature_layers) if drafter is not None else None,
                    "replay_accept_prob": c.replay_accept_prob if "replay" in methods else None},  # fmt: skip
        "lossy_methods": list(dict.fromkeys(r["method"] for r in runs if not r["lossless"])),
        "sssd_planner": {str(b): p for b, p in sorted(plans.items())},
        "prompts": {"set": c.prompts, "ids": ids, "num": len(ids), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts)},
        "greedy": sampling.greedy,
        "greedy_equal": all(r.get("greedy_equal", True) for r in runs if r["lossless"]) if sampling.greedy else None,
        "runs": runs,
        "total_seconds": time.perf_counter() - t_all,
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


__all__ = ["evaluate", "check_checkpoint", "load_prompts", "make_proposer"]
