"""Generation through the bundled engine, keeping the target's hidden states: the self-distillation backend.

:meth:`drafttrain.target.Target.generate` decodes a static left-padded batch with a Hugging Face
``DynamicCache``, which concatenates every layer's keys/values each step (a copy of the whole cache per
token) and compacts finished rows by copying again. :func:`engine_generate` decodes the same prompts
through :class:`~drafttrain.verify.engine.SpecEngine` with plain decoding: a preallocated ragged KV
cache written in place, continuous batching (a finished sequence's row is refilled from the queue at
once, EMS-SD's unpadded layout, so no row waits for the batch's longest answer), and the same
``Target.forward``. :class:`FeatureRecorder` is the proposer that drafts nothing and records the hidden
states the engine hands to every proposer (``start``: the prompt's, ``commit``: each step's root), so
the features come out of the generation itself as they do from ``Target.generate``.

Greedy only: ``Target.generate`` draws row i's tokens from its own generator (a reproducible
per-conversation stream); the engine shares one, so sampled self-distillation stays on ``Target.generate``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from drafttrain.sampling import GREEDY
from drafttrain.verify.tree import DraftTree


class FeatureRecorder:
    """A proposer that drafts nothing (plain decoding) and records every committed item's hidden state.

    Args:
        feature_layers: target layer ids to record (``Target.forward``'s convention; None = the final
            post-norm state), concatenated along the last dimension.
        dtype: dtype the recorded rows are kept in (fp32 default; self-distillation stores fp16).
    """

    name = "plain"
    lossless = True

    def __init__(self, feature_layers: Sequence[int] | None = None, dtype: torch.dtype = torch.float32):
        self.feature_layers = tuple(feature_layers) if feature_layers is not None else None
        self.dtype = dtype
        self._rows: dict[int, list[torch.Tensor]] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self._rows[slot] = [hidden.detach().to("cpu", self.dtype)]  # [P, F]: f_0 .. f_{P-1}

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        return [DraftTree.empty() for _ in slots]

    def commit(self, slot, tokens, hidden) -> None:
        self._rows[slot].append(hidden.detach().to("cpu", self.dtype))  # [1, F]: the step's root

    def finish(self, slot, hidden) -> torch.Tensor:
        """The sequence's features [P + G - 1, F]: every token's but the last generated one's."""
        rows = self._rows.pop(slot)
        rows.append(hidden.detach().to("cpu", self.dtype))
        return torch.cat(rows, dim=0)

    def release(self, slot) -> None:
        self._rows.pop(slot, None)


def engine_generate(
    target,
    prompts: list[list[int]],
    max_new_tokens: int | Sequence[int],
    stop_token_ids: int | Iterable[int] | None = None,
    return_features: bool = True,
    feature_layers: Sequence[int] | None = None,
    batch_size: int = 64,
    progress: bool | str = False,
) -> list[dict]:
    """Greedy generation of ``prompts`` through the engine; the same contract as ``Target.generate``.

    Args:
        target: a :class:`~drafttrain.target.Target`.
        prompts: b token id lists (each non-empty).
        max_new_tokens: generated tokens per prompt at most (>= 1): one int, or one per prompt.
        stop_token_ids: end-of-turn id(s); default eos; -1 or an empty set for none. A stop token is
            included in the output when produced.
        return_features: also return f for every token but the last generated one.
        feature_layers: layer ids of the returned features; None = the final post-norm state.
        batch_size: sequences decoded together (continuous batching refills finished rows).
        progress: a tqdm bar over finished prompts (a str is its description).

    Returns:
        One dict per prompt, in order: ``tokens`` (prompt + generated, list[int]), ``num_prompt``,
        ``finish_reason`` ("stop" | "length") and, with ``return_features``, ``features``
        [len(tokens) - 1, len(feature_layers) * d] float32 CPU tensor.

    Raises:
        ValueError: an empty prompt or a cap < 1.
    """
    from drafttrain.verify.engine import SpecEngine

    b = len(prompts)
    caps = [int(max_new_tokens)] * b if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
    if len(caps) != b or min(caps, default=1) < 1 or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs >= 1 token and a max_new_tokens >= 1")
    if stop_token_ids is None:
        stops = [target.eos_token_id] if target.eos_token_id is not None else []
    elif isinstance(stop_token_ids, int):
        stops = [stop_token_ids] if stop_token_ids >= 0 else []
    else:
        stops = [int(t) for t in stop_token_ids]
    if not b:
        return []
    proposer = FeatureRecorder(feature_layers) if return_features else None
    if proposer is None:
        from drafttrain.verify.proposers import PlainProposer

        proposer = PlainProposer()
    longest = max(len(p) for p in prompts) + max(caps)
    engine = SpecEngine(target, proposer, batch_size=min(batch_size, b), max_new_tokens=max(caps), mode="unpadded",
                        stop_token_ids=stops or [-1], initial_capacity=longest)  # fmt: skip
    run = engine.run(prompts, progress=progress, max_new_tokens=caps)
    out = []
    for p, r in zip(prompts, run.results):
        row = {"tokens": list(p) + r.tokens, "num_prompt": len(p), "finish_reason": r.finish_reason}
        if return_features:
            row["features"] = r.features
        out.append(row)
    return out


__all__ = ["FeatureRecorder", "engine_generate"]
