"""Batch-1 decoding speed against the peers a user would reach for, interleaved per prompt.

    python -m scripts.bench_peers drafter=outputs/parallelspec-smollm2-135m-instruct

For each prompt (MT-bench first turns, greedy, ``max_new_tokens`` tokens, stop at end of turn) every
method decodes it once, in a rotating order, in the same process:

- ``hf_generate``: Hugging Face ``model.generate`` (greedy) on the target as ``transformers`` loads
  it (``F.linear`` layers): what a user gets without this project;
- ``hf_prompt_lookup``: the same with prompt-lookup decoding (``prompt_lookup_num_tokens``);
- ``hf_generate_packed``: ``generate`` on the target with oneDNN prepacked linears
  (``target.fast_linear``), to separate what the linear layers buy from what the engine buys;
- ``engine_plain``: our engine, plain decoding (``PlainProposer``), prepacked linears (the default);
- ``engine_spec``: our engine with the drafter's own proposer, its tree and the online planner
  (``tree.plan``), prepacked linears: what ``scripts.evaluate`` runs at batch 1.
- ``engine_hybrid``: the same with SSSD's n-gram candidates from the prompt and the output so far merged
  into every tree (:mod:`drafttrain.verify.hybrid`, ``trainer.spec_eval.sssd.source=input``; the
  main job's ``data`` source also needs its training data, so it is not run here).
- ``engine_plain_compiled``, ``engine_spec_compiled``, ``engine_hybrid_compiled``: the same three on a copy of
  the target whose forward runs through ``torch.compile`` with freezing and dynamic shapes
  (``SpecEngine(compile_target=True)``, :meth:`drafttrain.target.Target.compiled_backbone`). The graphs
  are compiled once before the timed prompts (``compile_seconds`` in the JSON), not inside any method's
  time. Each compiled method has its own proposer (the planner learns each engine's forward costs).
- ``hf_generate_compiled``: Hugging Face ``generate`` with its own compiled decoding
  (``cache_implementation="static"`` and transformers' default ``CompileConfig``, which ``generate`` honours
  on CPU only when asked: ``_compile_all_devices``), on its own copy of the target as transformers loads it;
  the static cache is sized once for the longest prompt so that one decoding graph (static shapes: a
  1-token input and a fixed cache) serves every prompt. The fair baseline for the compiled engine rows:
  what a user gets from transformers' own compile switch. Compiled before the timed prompts, like the
  engine's. (Inductor's freezing with dynamic shapes, the engine's setting, crashed here inside
  ``generate``'s static-cache write on the 4th prompt: an index out of bounds in the generated kernel.)

tokens/s = generated tokens / wall time summed over the prompts; every output is compared with
``hf_generate``'s token for token. ``drafter``: a training run folder (or its ``drafter/``); null = a
fresh drafter of the shipped config (timing only: its acceptance is meaningless).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drafttrain.config import SSSDEvalConfig, TargetConfig
from drafttrain.verify.methods.drafter import TreeConfig

METHODS = ("hf_generate", "hf_prompt_lookup", "hf_generate_packed", "engine_plain", "engine_spec", "engine_hybrid",
           "hf_generate_compiled", "engine_plain_compiled", "engine_spec_compiled", "engine_hybrid_compiled")


@dataclass
class BenchPeersConfig:
    """Schema of ``python -m scripts.bench_peers`` (key=value overrides, validated before any work)."""

    drafter: str | None = None  # a training run folder or drafter/ folder; null = fresh ParallelSpec drafter
    prompts: str = "mt_bench"
    num_prompts: int = 8
    prompt_stride: int = 10  # MT-bench: every 10th question = one per category
    max_new_tokens: int = 64
    prompt_lookup_num_tokens: int = 10
    sssd_nodes: int = SSSDEvalConfig.nodes  # engine_hybrid: SSSD-only nodes per tree at most
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    threads: int = 2
    out: str = "docs/benchmarks/peers"
    tree: TreeConfig = field(default_factory=lambda: TreeConfig(widths=[4, 2, 1, 1, 1], budget=8))
    target: TargetConfig = field(default_factory=TargetConfig)


def bench(cfg: BenchPeersConfig) -> dict:
    from drafttrain.data.sources import load_eval_prompts
    from drafttrain.data.template import end_of_turn_ids, prompt_ids
    from drafttrain.compose import build_run
    from drafttrain.compose import Run
    from drafttrain.verify import PlainProposer
    from drafttrain.verify.proposers import proposer_for
    from scripts.bench_forward_cost import LinearSwitch
    from scripts.common import load_drafter

    bad = sorted(set(cfg.methods) - set(METHODS))
    if bad:
        raise ValueError(f"unknown methods {bad}; choose from {list(METHODS)}")
    torch.set_num_threads(cfg.threads)
    target = build_run(cfg, fast_linear="off").target
    switch = LinearSwitch(target.model)  # plain (as transformers loads it) <-> prepacked, same parameters
    drafted = {"engine_spec", "engine_hybrid", "engine_spec_compiled", "engine_hybrid_compiled"}
    switch.use(True)  # the drafter is packed like the target it drafts for (Drafter.pack_for_inference)
    drafter = load_drafter(target, cfg.drafter) if drafted & set(cfg.methods) else None
    switch.use(False)
    compiled = [m for m in cfg.methods if m.startswith("engine") and m.endswith("_compiled")]
    ctarget = None
    if compiled:  # its own copy: the module swaps of `switch` on the shared model would invalidate the graphs
        import copy

        from drafttrain.target import Target

        from drafttrain.target import fastlinear

        ctarget = Target(copy.deepcopy(target.model), target.tokenizer, target.source_dir)
        if fastlinear.available():  # the LM head runs eager (logits only where needed): prepacked, as by default
            fastlinear.pack_linears(ctarget.model, fastlinear.best_backend())
    rows_in = load_eval_prompts(cfg.prompts, limit=cfg.num_prompts, stride=cfg.prompt_stride)
    prompts = [prompt_ids(target.tokenizer, r["messages"]) for r in rows_in]
    stops = sorted(end_of_turn_ids(target.tokenizer))
    props = {}
    if drafter is not None:
        from drafttrain.verify.methods.sssd import SSSDConfig, SSSDDrafter

        def make(hybrid: bool):
            extra = {"sssd": SSSDDrafter(SSSDConfig()), "sssd_nodes": cfg.sssd_nodes} if hybrid else {}
            return proposer_for(drafter, widths=cfg.tree.widths, budget=cfg.tree.budget, choices=cfg.tree.choices,
                                batched=cfg.tree.batched_drafting, plan=cfg.tree.plan, **extra)  # fmt: skip

        props = {m: make("hybrid" in m) for m in drafted}  # one per method: a planner learns its engine's costs
    spec_prop = props.get("engine_spec")

    hf_model = None
    if "hf_generate_compiled" in cfg.methods:  # its own copy as transformers loads it (F.linear), compiled by generate
        import copy

        from transformers import CompileConfig

        hf_model = copy.deepcopy(target.model)
        hf_compile = {"cache_implementation": "static", "max_cache_len": max(map(len, prompts)) + cfg.max_new_tokens + 1,
                      "compile_config": CompileConfig()}  # fmt: skip
        hf_compile["compile_config"]._compile_all_devices = True  # transformers compiles on CPU only when asked

    def hf(p: list[int], lookup: bool, compiled: bool = False, max_new_tokens: int | None = None) -> list[int]:
        ids = torch.tensor([p])
        extra = {"prompt_lookup_num_tokens": cfg.prompt_lookup_num_tokens} if lookup else {}
        extra.update(hf_compile if compiled else {})
        out = (hf_model if compiled else target.model).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=max_new_tokens or cfg.max_new_tokens, eos_token_id=stops, pad_token_id=stops[0], **extra,
        )  # fmt: skip
        return out[0, len(p):].tolist()

    def engine(p: list[int], prop, compiled: bool = False) -> tuple[list[int], object]:
        run = Run(ctarget if compiled else target).engine(prop, batch_size=1, max_new_tokens=cfg.max_new_tokens,
                         stop_token_ids=stops, compile_target=compiled).run([p])  # fmt: skip
        return run.results[0].tokens, run.stats

    calls = {
        "hf_generate": (False, lambda p: (hf(p, False), None)),
        "hf_prompt_lookup": (False, lambda p: (hf(p, True), None)),
        "hf_generate_packed": (True, lambda p: (hf(p, False), None)),
        "engine_plain": (True, lambda p: engine(p, PlainProposer())),
        "engine_spec": (True, lambda p: engine(p, props["engine_spec"])),
        "engine_hybrid": (True, lambda p: engine(p, props["engine_hybrid"])),
        "hf_generate_compiled": (False, lambda p: (hf(p, False, compiled=True), None)),
        "engine_plain_compiled": (True, lambda p: engine(p, PlainProposer(), True)),
        "engine_spec_compiled": (True, lambda p: engine(p, props["engine_spec_compiled"], True)),
        "engine_hybrid_compiled": (True, lambda p: engine(p, props["engine_hybrid_compiled"], True)),
    }
    methods = [m for m in METHODS if m in cfg.methods]
    totals = {m: {"seconds": 0.0, "tokens": 0, "equal": 0, "steps": 0, "emitted": 0} for m in methods}
    compile_seconds = {}
    for m in compiled:  # one set of graphs per set of target layers the proposers read
        warm = Run(ctarget).engine(props.get(m) or PlainProposer(), batch_size=1, stop_token_ids=stops,
                          compile_target=True)  # fmt: skip
        key = str(list(warm.feature_layers))
        if key not in compile_seconds:
            compile_seconds[key] = warm.warm_up_compiled()
            print(f"compiled the target forward (feature layers {key}): {compile_seconds[key]:.0f} s", flush=True)
    if hf_model is not None:  # the decoding graph (the static cache's size is the same for every prompt)
        t = time.perf_counter()
        hf(prompts[0], False, compiled=True, max_new_tokens=4)
        compile_seconds["hf_generate_compiled"] = time.perf_counter() - t
        print(f"compiled Hugging Face generate's forward: {compile_seconds['hf_generate_compiled']:.0f} s", flush=True)
    calls[methods[0]][1](prompts[0][:8])  # warm-up (allocator, oneDNN primitives), untimed
    per_prompt = []
    for i, p in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]  # rotate who goes first
        outs = {}
        for m in order:
            packed, fn = calls[m]
            switch.use(packed)
            t = time.perf_counter()
            toks, stats = fn(p)
            dt = time.perf_counter() - t
            outs[m] = toks
            totals[m]["seconds"] += dt
            totals[m]["tokens"] += len(toks)
            if stats is not None:
                totals[m]["steps"] += stats.seq_steps
                totals[m]["emitted"] += stats.emitted
        ref = outs.get("hf_generate", outs[methods[0]])
        for m in methods:
            totals[m]["equal"] += int(outs[m] == ref)
        per_prompt.append({"prompt": i, "tokens": {m: len(outs[m]) for m in methods},
                           "equal": {m: outs[m] == ref for m in methods}})  # fmt: skip
        print(f"prompt {i}: " + ", ".join(f"{m} {len(outs[m])} tok" for m in methods), flush=True)
    switch.use(False)
    base = totals[methods[0]]["tokens"] / totals[methods[0]]["seconds"]
    rows = []
    for m in methods:
        t = totals[m]
        tps = t["tokens"] / t["seconds"]
        rows.append({"method": m, "tokens_per_s": tps, "vs_first": tps / base, "equal_outputs": t["equal"],
                     "prompts": len(prompts), "tau": t["emitted"] / t["steps"] if t["steps"] else None,
                     "tokens": t["tokens"], "seconds": t["seconds"]})  # fmt: skip
    planner = getattr(spec_prop, "planner", None)
    return {"rows": rows, "per_prompt": per_prompt, "planner": planner.summary() if planner is not None else None,
            "compile_seconds": compile_seconds,
            "drafter": cfg.drafter or "fresh parallelspec (untrained: timing only)"}  # fmt: skip


def markdown(res: dict, command: str, analysis: str) -> str:
    from scripts.common import machine_line

    m = res["machine"]
    shared = m.get("loadavg_1min", 0) > 0.5 * (m.get("cpus") or 1)
    c = res["config"]
    first = res["rows"][0]["method"]
    lines = [
        "# Batch-1 decoding speed against Hugging Face generate and prompt-lookup decoding",
        "",
        f"Measured {res['date']} on {machine_line(m)}; 1-minute load average {m['loadavg_1min']} at the start"
        + (" and the machine was **shared with other jobs** while this ran (times noisy; methods rotate per prompt)."
           if shared else "."),
        "",
        f"{c['num_prompts']} {c['prompts']} first turns (every {c['prompt_stride']}th), greedy, up to "
        f"{c['max_new_tokens']} new tokens, batch 1, every method on every prompt in turn. Drafter: {res['drafter']}; "
        f"tree {c['tree']}. Prompt lookup: `prompt_lookup_num_tokens={c['prompt_lookup_num_tokens']}`.",
        "",
        f"| method | tokens/s | vs {first} | τ | outputs equal to {first} |",
        "|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else ""
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.2f} | {r['vs_first']:.2f}x | {tau} | "
                     f"{r['equal_outputs']}/{r['prompts']} |")  # fmt: skip
    if res.get("compile_seconds"):
        lines += ["", "The `*_compiled` rows: compiled once before the timed prompts, "
                  + ", ".join(f"{v:.0f} s ({k if k.startswith('hf') else 'engine, feature layers ' + k})"
                              for k, v in res["compile_seconds"].items())
                  + "; not in any method's time."]
    if res.get("planner"):
        lines += ["", f"Planner (engine_spec): {res['planner']}"]
    lines += ["", "Reproduce (from the repository root):", "", "```bash", command, "```", "", analysis, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from scripts.common import run_bench

    return run_bench(BenchPeersConfig, bench, markdown, "bench_peers", argv)


if __name__ == "__main__":
    from drafttrain.cliconfig import run_cli

    run_cli(main)
