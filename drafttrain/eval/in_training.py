"""The training run's evaluation of its drafter: a plan for the one driver (:mod:`drafttrain.eval.driver`) and
the ``eval/*`` keys derived from its records.

``trainer.spec_eval.*`` (a run's config) is a preset of the evaluation: :func:`spec_eval` builds one
:class:`~drafttrain.eval.driver.EvalPlan` (at ``batch_size`` the draft tree, the chain, the drafter alone, plain
decoding and the online planner in lock-step, one decoding step each in turn; at batch 1 the latency prompts,
plain against the planner), runs it and derives the ``eval/*`` metrics a run logs from the records. The training
loop (:mod:`drafttrain.train.loop`) and ``scripts.evaluate preset=training`` (:mod:`drafttrain.eval.preset`) both
call it, so a re-evaluation equals the run's figures by construction. :func:`drafter_eval` is the same plan at one
batch size for scripts and tests. Nothing here imports the trainer.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from drafttrain.config import TrainConfig
from drafttrain.eval.driver import PLAIN, EvalPlan, Variant, run_plan
from drafttrain.verify.hybrid import DEFAULT_EXTRA_NODES

log = logging.getLogger(__name__)


def speedup_line(final: dict[str, Any]) -> str:
    """One sentence with what the evaluation means for a user: τ, speedup at each batch size, losslessness."""
    def by_batch(prefix: str) -> str:  # "batch 1: 1.17x, batch 16: 0.98x" from the keys prefix<N>, by N
        found = sorted((int(k[len(prefix):]), v) for k, v in final.items()
                       if k.startswith(prefix) and k[len(prefix):].isdigit() and isinstance(v, float))  # fmt: skip
        return ", ".join(f"batch {b}: {v:.2f}x" for b, v in found)

    parts, dec = by_batch("eval/speedup_b"), by_batch("eval/speedup_decode_b")
    eq = "every output equal to plain greedy decoding" if final.get("eval/greedy_equal") else "OUTPUTS DIFFER from plain greedy"
    dtype = final.get("eval/target_dtype", "float32")
    if not final.get("eval/greedy_equal") and dtype != "float32":  # measured: rounding, not the acceptance rule
        eq += (f" (the target runs in {dtype}: its batched verification rounds differently from its plain steps, "
               f"so greedy outputs part at near ties; check losslessness with target.dtype=float32)")
    decode = f" (decoding steps alone, prompt forwards left out: {dec})" if dec else ""
    what = str(final.get("eval/tree", "chain"))
    what = f"tree {what}" if what.startswith("widths") else what
    if final.get("eval/sssd"):
        what += f" + SSSD candidates: {final['eval/sssd']}"
    alone = (f"; the drafter alone (its chain, no SSSD): tau {final['eval/tau_alone']:.3f}"
             if "eval/tau_alone" in final else "")  # fmt: skip
    return (f"eval: tau {final['eval/tau']:.3f} tokens per verification step ({what}){alone}; speculative vs plain "
            f"decoding, tokens/s in the same engine: {parts or 'not timed'}{decode}; {eq}")


def latency_subset(items: list, k: int) -> list:
    """``k`` of ``items`` spread evenly over the list (index ``floor(i * n / k)``, i < k; all of them when
    k >= n): the batch-1 latency prompts. The main job's 16 MT-bench prompts are 2 per category in
    category order, so k = 8 takes one per category (the first k would cover only the first k / 2).

    Raises:
        ValueError: k < 0.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = len(items)
    if k >= n:
        return list(items)
    return [items[i * n // k] for i in range(k)]


#: The folder of a training run (its ``output_dir``) that holds the SSSD datastore its final evaluation used
#: (``trainer.spec_eval.sssd.source=data``): ``scripts.evaluate preset=training`` reads it (:mod:`drafttrain.eval.preset`).
EVAL_DATASTORE = "eval_datastore"


def uses_datastore(c: TrainConfig) -> bool:
    """Whether ``trainer.spec_eval`` builds SSSD's datastore over the training answers (``sssd.source=data``,
    hybrid trees: the batched evaluation, ``batch_size`` > 1)."""
    se = c.trainer.spec_eval
    return se.num_prompts > 0 and se.batch_size > 1 and se.sssd.source == "data"


def answers_datastore(train_ds):
    """SSSD's datastore (:class:`~drafttrain.verify.methods.sssd_datastore.Datastore`) over the answers of
    ``train_ds`` (rows with ``input_ids`` and ``loss_mask``: the self-distilled rows, the target's own outputs)."""
    from drafttrain.verify.methods.sssd_datastore import Datastore, documents_from_rows

    t0 = time.time()
    store = Datastore.from_documents(documents_from_rows(train_ds.with_format(None).select_columns(["input_ids", "loss_mask"])))
    log.info("SSSD datastore over the training answers: %d tokens in %.1f s", len(store), time.time() - t0)
    return store


def training_datastore(c: TrainConfig, train_ds, out_dir: str | Path):
    """The datastore of the run's final evaluation (:func:`answers_datastore`), also saved to
    ``out_dir/eval_datastore`` (:data:`EVAL_DATASTORE`; int32/int64 arrays of the answer tokens and their suffix
    array, a few MB for the main job) so that ``scripts.evaluate preset=training`` evaluates with the same one
    without the training data. None when the evaluation uses none (:func:`uses_datastore`).

    Raises:
        OSError: ``out_dir`` cannot be written.
    """
    if not uses_datastore(c):
        return None
    store = answers_datastore(train_ds)
    store.save(Path(out_dir) / EVAL_DATASTORE)
    return store


def sssd_for_eval(c: TrainConfig, train_ds=None, datastore=None):
    """The SSSD drafter of ``trainer.spec_eval.sssd`` (None for ``source=none``): input trie only, or with a
    datastore over the answers of ``train_ds`` (the self-distilled rows: the target's own outputs), or
    ``datastore`` itself where given (one built already, e.g. loaded from a run's :data:`EVAL_DATASTORE`).

    Raises:
        ValueError: ``source=data`` with neither ``train_ds`` nor ``datastore``.
    """
    from drafttrain.verify.methods.sssd import SSSDDrafter, drafting_config

    sc = c.trainer.spec_eval.sssd
    if sc.source == "none":
        return None
    store = None
    if sc.source == "data":
        if datastore is None and train_ds is None:
            raise ValueError("trainer.spec_eval.sssd.source=data needs the training data")
        store = datastore if datastore is not None else answers_datastore(train_ds)
    return SSSDDrafter(drafting_config(sc), store, num_threads=sc.num_threads)


def drafter_variants(drafter, tree_widths: list[int] | None = None, tree_budget: int | None = None, sssd=None,
                     sssd_nodes: int = DEFAULT_EXTRA_NODES, also_chain: bool = False, also_alone: bool = False,
                     plan: bool = False, full_tree: bool = True, tree_choices=None,
                     batched: bool = True) -> tuple[list[Variant], int, str | None]:  # fmt: skip
    """The decoding runs of a drafter's evaluation, in timing order, as driver variants.

    ``tree`` (the draft tree of ``tree_widths`` / ``tree_budget``, :func:`~drafttrain.verify.tree.parallelspec_tree`,
    or the static shape ``tree_choices``: a name of :data:`~drafttrain.verify.tree.NAMED_CHOICES` or rank lists;
    ``chain`` when all are None; ``batched``: the proposer drafts every sequence in one call) unless ``full_tree``
    is False; ``chain`` (the drafter's own chain) with a tree and
    ``also_chain``; ``alone`` (the drafter's chain without SSSD's candidates) with ``also_alone`` where no run
    already is that; ``planned`` (the online planner, :mod:`drafttrain.verify.planner`: per step only the nodes that
    pay; its record gets ``planner``, the planner's counters) with ``plan``. ``sssd`` (an
    :class:`~drafttrain.verify.methods.sssd.SSSDDrafter`) merges up to ``sssd_nodes`` training-free candidates into
    every tree of the tree, chain and planned runs (:class:`~drafttrain.verify.hybrid.HybridProposer`).

    Returns:
        (variants, the index plain decoding takes among them: next to the speedup's run, the label of the run that
        is the drafter alone or None).

    Raises:
        ValueError: ``full_tree=False`` without ``plan`` (there would be no speculative run).
    """
    from drafttrain.verify.proposers import proposer_for

    from drafttrain.verify.tree import NAMED_CHOICES

    choices = NAMED_CHOICES[tree_choices] if isinstance(tree_choices, str) else tree_choices
    tree = tree_widths is not None or tree_budget is not None or choices is not None
    if not full_tree and not plan:
        raise ValueError("full_tree=False needs plan=True (there would be no speculative run)")
    kw = dict(sssd=sssd, sssd_nodes=sssd_nodes, batched=batched)
    shape = dict(widths=tree_widths, budget=tree_budget, choices=choices)
    variants = []
    if full_tree:
        variants.append(Variant("tree" if tree else "chain", lambda bs, refs: proposer_for(drafter, **shape, **kw)))
    if tree and also_chain:
        variants.append(Variant("chain", lambda bs, refs: proposer_for(drafter, **kw)))
    alone = None
    if also_alone:
        if sssd is None and ((not tree and full_tree) or (tree and also_chain)):
            alone = "chain"  # a run already is
        else:
            variants.append(Variant("alone", lambda bs, refs: proposer_for(drafter, batched=batched)))
            alone = "alone"
    plain_at = len(variants)  # plain next to the speedup's run (the planned one, else the tree)
    if plan:
        def planner_counters(prop, rec, bs):
            rec["planner"] = prop.planner.summary()

        variants.append(Variant("planned", lambda bs, refs: proposer_for(drafter, **shape, plan=True, **kw),
                                finish=planner_counters))  # fmt: skip
    return variants, plain_at, alone


def summarize(records: list[dict[str, Any]], alone: str | None = None) -> dict[str, Any]:
    """One batch size's records of a drafter's evaluation (:func:`drafter_variants`) as the flat figures the run logs.

    Returns:
        ``tau`` (the speculative run's: the full tree, else the chain, else the planned run), ``greedy_equal`` (every
        run), ``mismatches``, ``accept_hist``, ``plain_tokens_per_s``, ``spec_tokens_per_s``, ``speedup``,
        ``speedup_decode``, ``num_prompts``, ``generated_tokens``, ``outputs`` (per prompt: tokens, tau, equal),
        ``batch_size``, ``compile_seconds``, ``mode``, ``tree_nodes_per_step``; with a chain beside a tree
        ``tau_chain``, ``speedup_chain``, ``spec_tokens_per_s_chain``, ``accept_hist_chain``; with the drafter alone
        ``tau_alone``, ``accept_hist_alone``; with the planner ``speedup_planned``, ``speedup_planned_decode``,
        ``tau_planned``, ``spec_tokens_per_s_planned``, ``planner``.
    """
    by = {r["method"]: r for r in records}
    plain = by[PLAIN]
    spec = by.get("tree") or by.get("chain") or by["planned"]
    bad = sorted({i for r in records for i in r.get("mismatches") or []})
    outputs = [{"tokens": t, "tau": tau, "equal": g not in bad}
               for g, t, tau in zip(spec["prompts"], spec["tokens"], spec["sequence_tau"])]  # fmt: skip
    out = {
        "tau": spec["tau"],
        "greedy_equal": all(r.get("greedy_equal") is not False for r in records),
        "mismatches": bad,
        "accept_hist": spec["accept_hist"],
        "plain_tokens_per_s": plain["tokens_per_s"],
        "spec_tokens_per_s": spec["tokens_per_s"],
        "speedup": spec["speedup"],
        "speedup_decode": spec["speedup_decode"],
        "num_prompts": len(spec["prompts"]),
        "generated_tokens": plain["generated_tokens"],
        "outputs": outputs,
        "batch_size": spec["batch_size"],
        "compile_seconds": spec["compile_seconds"],
        "mode": spec["mode"],
        "tree_nodes_per_step": spec["mean_tree_nodes"],
    }
    if "tree" in by and "chain" in by:
        ch = by["chain"]
        out.update(tau_chain=ch["tau"], speedup_chain=ch["speedup"], spec_tokens_per_s_chain=ch["tokens_per_s"],
                   accept_hist_chain=ch["accept_hist"])  # fmt: skip
    if alone is not None and alone in by:
        out.update(tau_alone=by[alone]["tau"], accept_hist_alone=by[alone]["accept_hist"])
    if "planned" in by:
        q = by["planned"]
        out.update(speedup_planned=q["speedup"], tau_planned=q["tau"], speedup_planned_decode=q["speedup_decode"],
                   spec_tokens_per_s_planned=q["tokens_per_s"], planner=q.get("planner"))  # fmt: skip
    return out


def drafter_eval(target, drafter, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16,
                 mode: str = "unpadded", progress: bool = True, tree_widths: list[int] | None = None,
                 tree_budget: int | None = None, also_chain: bool = False, also_alone: bool = False, plan: bool = False,
                 full_tree: bool = True, sssd=None, sssd_nodes: int = DEFAULT_EXTRA_NODES, interleave: str = "run",
                 compile_target: bool = False, tree_choices=None, batched: bool = True) -> dict[str, Any]:  # fmt: skip
    """A drafter's evaluation at one batch size (:func:`drafter_variants` in the driver, :func:`summarize`'s figures).

    Every run decodes ``prompts`` with ``batch_size`` sequences at a time in the bundled engine (continuous
    batching, engine ``mode``), greedy, stopping at the target's eos; ``speedup`` is the tokens/s ratio to plain
    decoding in the same engine at this batch size, prompt forwards included, ``speedup_decode`` the same over the
    decoding steps alone. ``interleave`` is the driver's unit (run | prompt | step); ``compile_target`` (batch 1
    only) runs every engine's target forward compiled, compiled first (``compile_seconds``).

    Raises:
        ValueError: ``compile_target`` with ``batch_size`` > 1, ``full_tree=False`` without ``plan``, an unknown unit.
    """
    from drafttrain.compose import build_run

    if compile_target and batch_size != 1:
        raise ValueError(f"compile_target needs batch_size=1, got {batch_size}")
    variants, plain_at, alone = drafter_variants(drafter, tree_widths, tree_budget, sssd, sssd_nodes, also_chain,
                                                 also_alone, plan, full_tree, tree_choices, batched)  # fmt: skip
    p = EvalPlan(prompts, variants, batch_sizes=(batch_size,), max_new_tokens=max_new_tokens, modes=(mode,),
                 plain_mode=mode, unit=interleave, plain_at=plain_at, compile_target=compile_target,
                 progress=progress)  # fmt: skip
    return summarize(run_plan(build_run(None, target=target), p), alone)


def spec_eval(c: TrainConfig, target, drafter, train_ds=None, datastore=None) -> dict[str, Any]:
    """Greedy speculative decoding of held-out prompts: eval/tau, token-for-token equality, and wall-clock speedup.

    One :class:`~drafttrain.eval.driver.EvalPlan`: at ``trainer.spec_eval.batch_size`` N the prompts go through the
    bundled batched verifier N at a time: plain decoding, the full draft tree (``eval/tau``, the drafter's
    quality), the chain and the drafter alone where asked and, with ``tree.plan``, the online planner
    (:mod:`drafttrain.verify.planner`). ``eval/speedup_b<N>`` is the tokens/s ratio of the speculative run (planned
    where ``tree.plan``) to plain decoding in the same engine at batch N; ``latency_prompts`` > 0 adds
    ``eval/speedup_b1`` from that many prompts (:func:`latency_subset`) decoded one at a time (the latency a single
    user sees). At both batch sizes the runs advance in lock-step, one decoding step each in turn, so that the
    ratios hold on a host whose speed drifts (:func:`~drafttrain.eval.driver.run_interleaved`). ``eval/speedup`` is
    the main batch size's figure. N = 1 decodes the drafter's chain (no tree, no SSSD) against plain decoding.
    ``compile_target`` runs the batch-1 latency runs on the compiled target forward (compiled first, untimed;
    ``eval/compile_seconds_b1``). ``sssd.source`` != none merges SSSD's training-free candidates into every tree
    (:mod:`drafttrain.verify.hybrid`; ``train_ds`` is the datastore's text for ``source=data``, or ``datastore``
    the datastore itself, :func:`training_datastore`). Writes ``eval_outputs.jsonl`` to ``c.output_dir``.
    """
    from drafttrain.compose import build_run
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids

    drafter.eval()
    se = c.trainer.spec_eval
    rows = load_eval_prompts(se.prompts, limit=se.num_prompts, offset=se.prompt_offset, stride=se.prompt_stride)
    prompts = [prompt_ids(target.tokenizer, r["messages"]) for r in rows]
    bs = se.batch_size
    tree = dict(tree_widths=se.tree.widths, tree_budget=se.tree.budget, tree_choices=se.tree.choices)
    shaped = any(v is not None for v in tree.values())
    chains_only = getattr(target, "recurrent", False)  # a recurrent state follows one sequence: no tree branches
    if chains_only and (shaped or se.sssd.source != "none"):
        from drafttrain.target import families

        log.warning("%s: the evaluation verifies the drafter's chain (trainer.spec_eval.tree and sssd make trees, "
                    "which the engine verifies on attention-only targets)", families.recurrent_layers_text(target))
        tree = dict(tree_widths=None, tree_budget=None, tree_choices=None)
    if bs == 1:  # one sequence at a time: the drafter's chain against plain decoding
        tree = dict(tree_widths=None, tree_budget=None, tree_choices=None)
    elif not chains_only:
        tree.update(sssd=sssd_for_eval(c, train_ds, datastore), sssd_nodes=se.sssd.nodes)
    plan_b = se.tree.plan and bs > 1
    variants, plain_at, alone = drafter_variants(drafter, **tree, also_chain=se.chain and bs > 1,
                                                 also_alone=se.drafter_alone and bs > 1, plan=plan_b,
                                                 batched=se.tree.batched_drafting)  # fmt: skip
    b1 = latency_subset(list(range(len(prompts))), se.latency_prompts)  # the batch-1 prompts' indices
    latency = bs > 1 and se.latency_prompts > 0
    speedup_run = "planned" if plan_b else variants[0].label
    plan = EvalPlan(prompts, variants, batch_sizes=(bs, 1) if latency else (bs,), max_new_tokens=se.max_new_tokens,
                    unit="step", plain_at=plain_at, subsets={1: b1} if latency else {},
                    variants_at={1: [speedup_run]} if latency else {}, compile_target=se.compile_target and latency,
                    progress=c.trainer.progress)  # fmt: skip
    with torch.autocast("cpu", enabled=False):
        records = run_plan(build_run(None, target=target), plan)
    r = summarize([x for x in records if x["batch_size"] == bs], alone)
    lat = summarize([x for x in records if x["batch_size"] == 1]) if latency else None
    if not r["greedy_equal"]:
        log.error("speculative output differs from plain greedy on prompts %s", r["mismatches"])
    if lat is not None and not lat["greedy_equal"]:
        log.error("batch-1 speculative output differs from plain greedy on prompts %s", lat["mismatches"])
    with (Path(c.output_dir) / "eval_outputs.jsonl").open("w") as f:
        for row, o in zip(rows, r["outputs"]):
            text = target.tokenizer.decode(o["tokens"])
            f.write(json.dumps({"id": row["id"], "tau": o["tau"], "equal_to_plain_greedy": o["equal"], "text": text}) + "\n")
    planned = "speedup_planned" in r
    speedup = r["speedup_planned"] if planned else r["speedup"]
    out = {
        "eval/tau": r["tau"],
        "eval/greedy_equal": r["greedy_equal"] and (lat is None or lat["greedy_equal"]),
        f"eval/speedup_b{bs}": speedup,
        **({"eval/speedup_b1": lat["speedup"]} if lat is not None else {}),
        # the same ratios over the decoding steps alone (both runs make the same prompt forwards)
        f"eval/speedup_decode_b{bs}": r["speedup_planned_decode"] if planned else r["speedup_decode"],
        **({"eval/speedup_decode_b1": lat["speedup_decode"]} if lat is not None else {}),
        "eval/speedup": speedup,
        "eval/spec_tokens_per_s": r["spec_tokens_per_s_planned"] if planned else r["spec_tokens_per_s"],
        "eval/plain_tokens_per_s": r["plain_tokens_per_s"],
        "eval/accept_hist": r["accept_hist"],
        "eval/batch_size": bs,
        "eval/target_dtype": target.dtype_name if hasattr(target, "dtype_name") else "float32",
        **({"eval/speedup_full_tree": r["speedup"], "eval/tau_planned": r["tau_planned"]} if planned else {}),
        # what the planner did (steps skipped, nodes verified, calibration): the speedup depends on its path
        **({f"eval/planner_b{bs}": r["planner"]} if planned else {}),
        **({"eval/planner_b1": lat["planner"]} if lat is not None and "planner" in lat else {}),
        **({"eval/plain_tokens_per_s_b1": lat["plain_tokens_per_s"], "eval/spec_tokens_per_s_b1": lat["spec_tokens_per_s"],
            "eval/tau_b1": lat["tau"], "eval/latency_prompts": len(lat["outputs"]),
            "eval/prompts_b1": ",".join(rows[i]["id"] for i in b1)} if lat is not None else {}),
        **({"eval/compile_seconds_b1": lat["compile_seconds"]} if lat is not None and se.compile_target else {}),
        **{f"eval/{k}": r[k] for k in ("tau_chain", "speedup_chain", "spec_tokens_per_s_chain", "accept_hist_chain",
                                       "tau_alone", "accept_hist_alone", "tree_nodes_per_step") if k in r},  # fmt: skip
        **({"eval/sssd": f"{se.sssd.source}, {se.sssd.nodes} nodes"} if tree.get("sssd") is not None else {}),
        **({"eval/tree": (f"widths {se.tree.widths} budget {se.tree.budget}" if se.tree.choices is None
                          else f"choices {se.tree.choices}")}
           if bs > 1 and not chains_only and shaped else {}),
        **({"eval/tree": "chain (the target has recurrent layers)"} if chains_only else {}),
        "eval/prompts": f"{se.prompts} ids {','.join(r['id'] for r in rows)}",
    }
    return out
