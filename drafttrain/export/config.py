"""Schemas of ``python -m scripts.export`` and ``python -m scripts.serve_check`` (validated from key=value)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExportConfig:
    """Export a trained drafter to a folder a serving engine loads.

    ``checkpoint``: a training run folder (``drafter/`` + ``config.json``) or a drafter folder.
    ``format``: speculators | sglang | vllm_medusa | vllm_eagle; null = the recipe's default
    (eagle3 / parallelspec_eagle3 -> speculators, medusa -> vllm_medusa, eagle -> vllm_eagle).
    ``target_path``: the target's HF folder; null = the run's own target (the converted SmolLM2 by default).
    A drafter trained on a random ``target=tiny`` needs the tiny target saved to disk and named here.
    ``verifier``: the target name written into the exported config (``vllm serve DIR`` serves it);
    null = the target's folder.
    ``num_speculative_tokens``: the default chain length in the speculators config; null = the drafter's depth.
    """

    checkpoint: str | None = None
    format: str | None = None
    output_dir: str | None = None  # null = outputs/export/<run name>-<format>
    target_path: str | None = None
    verifier: str | None = None
    num_speculative_tokens: int | None = None
    overwrite: bool = False


@dataclass
class ServeCheckConfig:
    """Run vLLM on the target with and without an exported drafter, beside drafttrain's own engine.

    ``export_dir``: a folder written by ``scripts.export`` (its ``export_info.json`` names the format and
    target); or ``checkpoint`` (+ ``format``): exported first into ``output_dir/export``.
    """

    export_dir: str | None = None
    checkpoint: str | None = None
    format: str | None = None
    target_path: str | None = None
    prompts: str = "mt_bench"
    num_prompts: int = 16
    prompt_offset: int = 0
    prompt_stride: int = 5  # every 5th MT-bench question: 2 of each of its 8 categories (the main job's eval set)
    max_new_tokens: int = 128
    num_speculative_tokens: int | None = None  # null = the drafter's depth
    vllm_python: str | None = None  # null = .venv-vllm/bin/python (scripts/install_vllm.sh), else $DRAFTTRAIN_VLLM_PYTHON
    vllm_threads: str = "0-1"  # VLLM_CPU_OMP_THREADS_BIND
    vllm_memory_gb: float = 4.0  # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = 1024
    ours: bool = True  # also run drafttrain's SpecEngine (tau, tokens/s) on the same prompts
    num_threads: int | None = None  # torch threads for our engine (null = torch's default)
    output_dir: str = "outputs/serve_check"
    timeout_s: int = 3600
    extra: dict = field(default_factory=dict)  # extra keys for vLLM's speculative_config
