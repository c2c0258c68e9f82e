"""The trainer's speculative evaluation, run through the one evaluation path of :mod:`drafttrain.eval.spec`.

``trainer.spec_eval.*`` (a run's config) is a preset of the evaluation: :func:`spec_eval` decodes the
held-out prompts with plain decoding, the draft tree and the online planner in lock-step (one decoding
step each in turn) and returns the ``eval/*`` metrics a run logs. The training loop
(:mod:`drafttrain.train.loop`) and ``scripts.evaluate preset=training`` (:mod:`drafttrain.eval.preset`) both
call it, so a re-evaluation equals the run's figures by construction. Nothing here imports the trainer.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from drafttrain.config import TrainConfig

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


def spec_eval(c: TrainConfig, target, drafter, train_ds=None, datastore=None) -> dict[str, Any]:
    """Greedy speculative decoding of held-out prompts: eval/tau, token-for-token equality, and wall-clock speedup.

    With ``trainer.spec_eval.batch_size`` N > 1 the prompts go through the bundled batched verifier N at a
    time: plain decoding, the full draft tree (``eval/tau``, the drafter's quality) and, with ``tree.plan``, the
    online planner (:mod:`drafttrain.verify.planner`). ``eval/speedup_b<N>`` is the tokens/s ratio of the
    speculative engine (planned where ``tree.plan``) to plain decoding in the same engine at batch N;
    ``latency_prompts`` > 0 adds ``eval/speedup_b1`` from that many prompts (:func:`latency_subset`)
    decoded one at a time (the latency a single user sees). At both batch sizes the runs advance in lock-step, one decoding step each
    in turn, so that the ratios hold on a host whose speed drifts (:func:`~drafttrain.eval.spec.run_interleaved`). ``eval/speedup`` is the main batch size's figure. Batch 1 as the main
    run uses the one-sequence reference implementation (:func:`~drafttrain.eval.spec.evaluate_prompts`).
    ``compile_target`` runs the batch-1 latency runs on the compiled target forward (compiled first, untimed;
    ``eval/compile_seconds_b1``). ``sssd.source`` != none merges SSSD's training-free candidates into every tree
    (:mod:`drafttrain.verify.hybrid`; ``train_ds`` is the datastore's text for ``source=data``, or ``datastore``
    the datastore itself, :func:`training_datastore`).
    """
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import prompt_ids
    from drafttrain.eval.spec import evaluate_prompts, evaluate_prompts_batched

    drafter.eval()
    se = c.trainer.spec_eval
    rows = load_eval_prompts(se.prompts, limit=se.num_prompts, offset=se.prompt_offset, stride=se.prompt_stride)
    prompts = [prompt_ids(target.tokenizer, r["messages"]) for r in rows]
    bs = se.batch_size
    tree = dict(tree_widths=se.tree.widths, tree_budget=se.tree.budget)
    chains_only = getattr(target, "recurrent", False)  # a recurrent state follows one sequence: no tree branches
    if chains_only and (se.tree.widths is not None or se.tree.budget is not None or se.sssd.source != "none"):
        from drafttrain.target import families

        log.warning("%s: the evaluation verifies the drafter's chain (trainer.spec_eval.tree and sssd make trees, "
                    "which the engine verifies on attention-only targets)", families.recurrent_layers_text(target))
        tree = dict(tree_widths=None, tree_budget=None)
    if bs > 1 and not chains_only:
        tree.update(sssd=sssd_for_eval(c, train_ds, datastore), sssd_nodes=se.sssd.nodes)
    lat = None
    b1 = latency_subset(list(range(len(prompts))), se.latency_prompts)  # the batch-1 prompts' indices
    with torch.autocast("cpu", enabled=False):
        if bs > 1:
            r = evaluate_prompts_batched(target, drafter, prompts, se.max_new_tokens, batch_size=bs,
                                         progress=c.trainer.progress, also_chain=se.chain, plan=se.tree.plan,
                                         also_alone=se.drafter_alone,
                                         interleave="step", **tree)  # fmt: skip
            if se.latency_prompts > 0:
                lat = evaluate_prompts_batched(target, drafter, [prompts[i] for i in b1], se.max_new_tokens,
                                               batch_size=1, progress=c.trainer.progress, plan=se.tree.plan,
                                               full_tree=not se.tree.plan, interleave="step",
                                               compile_target=se.compile_target, **tree)  # fmt: skip
        else:
            r = evaluate_prompts(target, drafter, prompts, se.max_new_tokens, progress=c.trainer.progress)
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
        **({"eval/tree": f"widths {se.tree.widths} budget {se.tree.budget}"}
           if bs > 1 and not chains_only and (se.tree.widths is not None or se.tree.budget is not None) else {}),
        **({"eval/tree": "chain (the target has recurrent layers)"} if chains_only else {}),
        "eval/prompts": f"{se.prompts} ids {','.join(r['id'] for r in rows)}",
    }
    return out
