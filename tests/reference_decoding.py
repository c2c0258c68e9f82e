"""The one-sequence reference of greedy chain speculative decoding: what the engine is tested against.

Each step: the drafter proposes a chain of ``depth`` tokens (ParallelSpec: K + 1 in one forward pass,
Algorithm 1 with a chain instead of a tree; Medusa: K heads; EAGLE: D autoregressive drafter passes),
the target verifies ``[last token, d_1..d_depth]`` in one forward pass with transformers' own
``DynamicCache``, the longest prefix of drafts equal to the target's own argmax is accepted, and the
target's argmax after it is the bonus token; rejected positions are cropped from both KV caches. Greedy
acceptance makes the output identical to plain greedy decoding of the target. This loop shares nothing
with the bundled engine (:mod:`drafttrain.verify.engine`) but the drafter's ``propose``: the tests hold the
engine, the drafters' feature handling and τ's counting to it. The toolkit's evaluations run through the
engine (:mod:`drafttrain.eval.driver`); this module lives with the tests.

τ (acceptance length) = tokens emitted by verification steps / verification forwards; the prefill
forward (which emits the first token in both plain and speculative decoding) is not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from drafttrain.eval.driver import plain_greedy


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    target_forwards: int  # verification forwards (prefill excluded)
    emitted: int  # tokens emitted by verification forwards
    accept_lengths: list[int] = field(default_factory=list)  # drafts accepted per step (0..K+1)
    seconds: float = 0.0


def _truncate(tokens: list[int], max_new_tokens: int, stop: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if stop is not None and stop in tokens:
        tokens = tokens[: tokens.index(stop) + 1]
    return tokens


@torch.no_grad()
def speculative_greedy(target, drafter, prompt: list[int], max_new_tokens: int, stop: int | None = None) -> SpecResult:
    """Greedy chain speculative decoding of one prompt with any drafter.

    Args:
        target: :class:`drafttrain.target.Target`.
        drafter: a drafter with ``propose(next_ids [1, n], features [1, n, F], cache) -> [1, depth, v]``
            (row j: the (j+1)-th token after the last item's x_{i+1}); it keeps its own ``cache``
            (a ``DynamicCache`` of the real items, created here) consistent. It is handed what it
            declares (``drafter.spec``): the features of its ``feature_layers`` (F = len(ids) * d), for
            every new item (``step_input="items"``) or the last one (``"last"``).
        prompt: prompt token ids.
        max_new_tokens: generation cap; ``stop``: end-of-turn id (default the target's eos).

    Returns:
        :class:`SpecResult`.
    """
    from transformers import DynamicCache

    stop = target.eos_token_id if stop is None else stop
    device = target.device
    t0 = time.perf_counter()
    tcache, dcache = DynamicCache(), DynamicCache()
    layers = drafter.feature_layers  # the declared target layers (drafters/base.py)
    keep = -1 if drafter.spec.step_input == "last" else 0  # "last": only the last item's feature is handed over
    ids = torch.tensor([prompt], device=device)
    out = target.forward(ids, cache=tcache, use_cache=True, feature_layers=layers)
    last = int(out.logits[0, -1].argmax())
    generated = [last]
    # drafter items for the prompt: (x_{i+1}, f_i), i = 0..n-1, with x_n = the first generated token
    item_ids = torch.tensor([prompt[1:] + [last]], device=device)[:, keep:]
    item_feats = out.features[:, keep:]
    res = SpecResult(tokens=[], target_forwards=0, emitted=0)
    while len(generated) < max_new_tokens and generated[-1] != stop:
        draft = drafter.propose(item_ids, item_feats, dcache)[0].argmax(-1)  # [depth]
        k1 = draft.numel()
        cache_len = tcache.get_seq_length()
        verify = torch.cat([torch.tensor([last], device=device), draft])[None]  # [1, depth + 1]
        pos = torch.arange(cache_len, cache_len + k1 + 1, device=device)[None]
        tout = target.forward(verify, position_ids=pos, cache=tcache, use_cache=True, feature_layers=layers)
        preds = tout.logits[0].argmax(-1)  # [depth + 1] target's next token after each verify input
        match = (draft == preds[:k1]).long()
        m = int(torch.cumprod(match, 0).sum())  # accepted drafts
        bonus = int(preds[m])
        new = draft[:m].tolist() + [bonus]
        tcache.crop(-(k1 - m))  # keep last + accepted drafts; drop the rejected ones
        if stop is not None and stop in new:  # an accepted draft may already end the answer
            new = new[: new.index(stop) + 1]
        new = new[: max_new_tokens - len(generated)]  # emitted tokens past the cap do not count
        res.target_forwards += 1
        res.emitted += len(new)
        res.accept_lengths.append(m)
        generated.extend(new)
        item_ids = torch.tensor([new], device=device)[:, keep:]
        item_feats = tout.features[:, : m + 1][:, keep:]
        last = bonus
    res.tokens = _truncate(generated, max_new_tokens, stop)
    res.seconds = time.perf_counter() - t0
    return res


def evaluate_prompts(
    target, drafter, prompts: list[list[int]], max_new_tokens: int, progress: bool = True, timing_prompts: int = 2
) -> dict:
    """Speculative vs plain greedy decoding on each prompt.

    The plain greedy reference of all prompts comes from one batched generation (much cheaper than
    one sequence at a time on a CPU); where a speculative output differs from it, the prompt is
    decoded again alone and only a difference from that single-sequence reference counts as a
    mismatch (batched and single matmuls may round differently at a near tie). Wall-clock speedup
    is timed side by side, one sequence at a time, on the first ``timing_prompts`` prompts.

    Returns:
        dict with ``tau`` (emitted / verification forwards over all prompts), ``greedy_equal`` (bool:
        every prompt's speculative output equals plain greedy token for token), ``mismatches`` (prompt
        indices that differ), ``accept_hist`` (count of steps per accepted-draft count),
        ``plain_tokens_per_s`` and ``spec_tokens_per_s`` (batch 1, timed prompts), ``speedup``,
        ``num_prompts``, ``generated_tokens``, ``outputs`` (per prompt: tokens, tau).
    """
    batch_ref = target.generate_greedy(prompts, max_new_tokens, return_features=False)
    emitted = forwards = 0
    plain_s = spec_s = 0.0
    timed_tokens = n_tokens = 0
    mismatches, outputs = [], []
    hist: dict[int, int] = {}
    for i, p in enumerate(tqdm(prompts, desc="spec-eval", disable=not progress, leave=False)):
        r = speculative_greedy(target, drafter, p, max_new_tokens)
        ref = batch_ref[i]["tokens"][len(p) :]
        if r.tokens != ref:
            ref, _ = plain_greedy(target, p, max_new_tokens)
            if r.tokens != ref:
                mismatches.append(i)
        if i < timing_prompts:
            _, dt = plain_greedy(target, p, max_new_tokens)
            plain_s += dt
            spec_s += r.seconds
            timed_tokens += len(ref)
        emitted += r.emitted
        forwards += r.target_forwards
        n_tokens += len(ref)
        for a in r.accept_lengths:
            hist[a] = hist.get(a, 0) + 1
        outputs.append({"tokens": r.tokens, "tau": r.emitted / max(r.target_forwards, 1), "equal": i not in mismatches})
    return {
        "tau": emitted / max(forwards, 1),
        "greedy_equal": not mismatches,
        "mismatches": mismatches,
        "accept_hist": dict(sorted(hist.items())),
        "plain_tokens_per_s": timed_tokens / max(plain_s, 1e-9),
        "spec_tokens_per_s": timed_tokens / max(spec_s, 1e-9),
        "speedup": plain_s / max(spec_s, 1e-9),
        "num_prompts": len(prompts),
        "generated_tokens": n_tokens,
        "outputs": outputs,
    }
