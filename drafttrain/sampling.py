"""The one sampling vocabulary: :class:`SamplingParams` (temperature 0 = greedy) and the one
temperature + top-p transform :func:`process_logits`, used by generation (self-distillation,
``scripts.generate_data``) and by the verifier's acceptance rules and proposers alike.

Pure functions of the logits and random generators. Generation draws with one CPU generator per row
(:func:`sample_next`, :func:`row_generator`), so a sampled token depends only on its row's logits and
its row's generator: results do not depend on which other rows share the batch (up to the float
reassociation of the logits themselves), and a run restarted from a shard boundary replays the same
samples. Top-p is Holtzman et al. 2020 ("The Curious Case of Neural Text Degeneration", §3.1): keep the
smallest set of most probable tokens whose mass reaches p. Top-k (Fan et al. 2018) keeps the k most
probable tokens; with both, top-k is applied first, then top-p on the renormalised top-k mass (the
order of MTAD App. F and of Hugging Face's warpers).

Shape letters: a rows, v vocab.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """Decoding distribution. ``temperature == 0`` means greedy (argmax); ``temperature > 0`` divides the
    logits; ``top_k`` >= 1 keeps the k most probable tokens (0 = off); ``top_p`` in (0, 1] then keeps the
    nucleus of that mass (1 = off).

    Raises:
        ValueError: ``temperature < 0``, ``top_p`` outside (0, 1] or ``top_k < 0``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> the distribution decoding samples from, for generation, target and draft alike.

    softmax(logits / T); with ``top_k`` >= 1 only the k largest logits keep their mass (ties at the
    k-th value broken by ``torch.topk``'s order), renormalised; then nucleus (top-p) filtering: a token is
    kept when the mass of the tokens strictly more probable than it (ties broken by sort order) is <
    ``top_p``, so the most probable token is always kept and the token that crosses ``top_p`` is kept
    too; the kept mass is renormalised. Greedy (T = 0) returns the one-hot argmax distribution.

    Args:
        logits: [..., v] float.
        params: temperature, top-k and top-p.

    Returns:
        [..., v] float32 probabilities (rows sum to 1).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        idx = torch.topk(scaled, params.top_k, dim=-1).indices  # [..., k]
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, idx, scaled.gather(-1, idx))
    probs = torch.softmax(scaled, dim=-1)  # [..., v]
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)  # [..., v]
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more probable tokens
        keep = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, idx, mass_before < params.top_p)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, the same ids (the first maximum on ties; a NaN counts as the maximum), ~10x
    faster on CPU float32 through numpy's vectorised argmax: torch 2.13's CPU argmax reads ~1.2 GB/s, so
    the argmax of a batch-1 verification (9 rows x 49152) cost 0.36 ms of a ~45 ms step, against 0.03 ms.

    Args:
        logits: [..., v] float; any device and dtype (other than CPU float32 goes to torch's argmax).

    Returns:
        [...] int64 on ``logits.device``.
    """
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() == 0:
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))


def sample_next(
    logits: torch.Tensor, params: SamplingParams | None, generators: Sequence[torch.Generator] | torch.Generator | None = None
) -> torch.Tensor:
    """Pick one next token per row.

    Args:
        logits: [a, v] float, the last position's logits of each row.
        params: None or greedy params for argmax; else temperature / top-p sampling from
            :func:`process_logits`.
        generators: ``torch.Generator`` per row (a sequence of length a), or one for all rows.
            Each row draws one uniform number from its generator, on the generator's device (inverse-CDF
            sampling): CPU generators make the draw device-independent. Required when sampling.

    Returns:
        [a] int64 token ids on ``logits.device``.

    Raises:
        ValueError: sampling without generators, or a generator list of the wrong length.
    """
    if params is None or params.greedy:
        return greedy_argmax(logits)
    if generators is None:
        raise ValueError("sampling needs a torch.Generator per row (or one for all rows)")
    a = logits.shape[0]
    if isinstance(generators, torch.Generator):
        u = torch.rand(a, generator=generators, dtype=torch.float64, device=generators.device)  # the RNG's device
    else:
        if len(generators) != a:
            raise ValueError(f"{len(generators)} generators for {a} rows")
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device).to(logits.device)
                       for g in generators])  # fmt: skip
    probs = process_logits(logits, params).double()  # [a, v]
    cdf = probs.cumsum(-1)  # [a, v]
    total = cdf[:, -1:]  # [a, 1]
    u = torch.minimum(u.to(logits.device)[:, None] * total, total * (1 - 1e-15))  # [a, 1], u < total
    # the first index whose cdf exceeds u: a zero-probability token adds no CDF step, so it is never chosen
    idx = torch.searchsorted(cdf, u, right=True)  # [a, 1]
    return idx[:, 0]


def row_generator(seed: int, *keys: object) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and any keys (e.g. a conversation id and a turn number).

    The seed is a hash of the keys' text, so it does not depend on the process or the batch.
    """
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


__all__ = ["SamplingParams", "GREEDY", "greedy_argmax", "process_logits", "sample_next", "row_generator"]
