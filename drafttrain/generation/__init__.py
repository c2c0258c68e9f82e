"""Generation backends behind one protocol: the target writes continuations (self-distillation, benchmarks).

Three backends answer the same call, :meth:`Generator.generate`, with the contract of
:meth:`drafttrain.target.Target.generate` (one dict per prompt: ``tokens`` = prompt + generated ids,
``num_prompt``, ``finish_reason`` "stop" | "length", and ``features`` [len(tokens) - 1, F] where the
backend keeps hidden states):

- ``hf`` (:class:`HFGenerator`): :meth:`Target.generate`, a left-padded batch with Hugging Face's
  ``DynamicCache``; the only backend that samples (one generator per row, reproducible per conversation).
- ``engine`` (:class:`EngineGenerator`, :mod:`drafttrain.generation.engine`): plain decoding through the
  bundled engine (preallocated ragged KV cache, continuous batching), hidden states recorded from the
  generation itself. Greedy only.
- ``vllm`` (:class:`~drafttrain.generation.vllm_client.VllmGenerator`, :mod:`drafttrain.generation.vllm_client`): vLLM's
  CPU build in its own venv and process, one engine per job. Greedy only; keeps no hidden states (callers
  compute features with a teacher-forced target forward).

:func:`generator_for` picks one by name. Nothing here depends on the data pipeline; the data pipeline
depends on this (never on :mod:`drafttrain.verify` or :mod:`drafttrain.export` directly).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from drafttrain.config import BACKENDS  # the one list of generation backends (the schemas validate against it)


class Generator(Protocol):
    """What every backend answers (module docstring: the returned dicts)."""

    name: str
    keeps_features: bool

    def generate(self, prompts: list[list[int]], max_new_tokens: int | Sequence[int],
                 stop_token_ids: Iterable[int] | None = None, return_features: bool = True,
                 feature_layers: Sequence[int] | None = None, sampling=None, generators=None) -> list[dict]:
        ...  # fmt: skip


class HFGenerator:
    """``hf``: :meth:`drafttrain.target.Target.generate` (sampling too)."""

    name, keeps_features = "hf", True

    def __init__(self, target):
        self.target = target

    def generate(self, prompts, max_new_tokens, stop_token_ids=None, return_features=True, feature_layers=None,
                 sampling=None, generators=None) -> list[dict]:  # fmt: skip
        return self.target.generate(prompts, max_new_tokens, stop_token_ids=stop_token_ids,
                                    return_features=return_features, sampling=sampling, generators=generators,
                                    feature_layers=feature_layers)  # fmt: skip


class EngineGenerator:
    """``engine``: greedy plain decoding through the bundled engine, ``batch_size`` sequences at a time.

    Raises (from :meth:`generate`):
        ValueError: a sampling request (the engine's one generator cannot give each row its own stream).
    """

    name, keeps_features = "engine", True

    def __init__(self, target, batch_size: int = 64):
        self.target, self.batch_size = target, int(batch_size)

    def generate(self, prompts, max_new_tokens, stop_token_ids=None, return_features=True, feature_layers=None,
                 sampling=None, generators=None) -> list[dict]:  # fmt: skip
        from drafttrain.generation.engine import engine_generate

        if sampling is not None and not sampling.greedy:
            raise ValueError("the engine generation backend is greedy only; sample with backend hf")
        return engine_generate(self.target, prompts, max_new_tokens, stop_token_ids=stop_token_ids,
                               return_features=return_features, feature_layers=feature_layers,
                               batch_size=self.batch_size)  # fmt: skip


class VllmBackend:
    """``vllm``: a started-on-demand :class:`~drafttrain.generation.vllm_client.VllmGenerator`, greedy, no features."""

    name, keeps_features = "vllm", False

    def __init__(self, vllm):
        self.vllm = vllm

    def generate(self, prompts, max_new_tokens, stop_token_ids=None, return_features=True, feature_layers=None,
                 sampling=None, generators=None) -> list[dict]:  # fmt: skip
        if sampling is not None and not sampling.greedy:
            raise ValueError("generation.backend=vllm is greedy only (generation.sampling.temperature=0)")
        return self.vllm.generate(prompts, max_new_tokens, list(stop_token_ids or ()))


def generator_for(backend: str, target, batch_size: int = 64, vllm=None) -> Generator:
    """The :class:`Generator` called ``backend`` for ``target``.

    Args:
        backend: ``engine`` | ``hf`` | ``vllm``.
        batch_size: sequences the engine decodes together.
        vllm: the job's :class:`~drafttrain.generation.vllm_client.VllmGenerator` (backend ``vllm`` only).

    Raises:
        ValueError: an unknown backend, or ``vllm`` without its generator.
    """
    if backend == "hf":
        return HFGenerator(target)
    if backend == "engine":
        return EngineGenerator(target, batch_size)
    if backend == "vllm":
        if vllm is None:
            raise ValueError("the vllm backend needs the job's VllmGenerator (drafttrain.generation.vllm_client)")
        return VllmBackend(vllm)
    raise ValueError(f"unknown generation backend {backend!r}; choose from {BACKENDS}")


__all__ = ["BACKENDS", "EngineGenerator", "Generator", "HFGenerator", "VllmBackend", "generator_for"]
