"""Typed configuration: one dataclass per Hydra group, the schemas of every entry point.

This module holds the schemas only (dataclasses, numeric ranges, moved keys) and imports nothing of
drafttrain's but the CLI helpers (:mod:`drafttrain.cliconfig`), so anything may import it.
:mod:`drafttrain.validation` is where a composed config meets the registries (drafters, decoding methods,
backends, target families): :func:`drafttrain.validation.validate` merges a composed Hydra config into
these dataclasses, so a typo'd key or a wrong type fails with a message naming the key before any model
loads (docs/design.md, "Configuration conventions").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import OmegaConf

from drafttrain.cliconfig import ConfigError

# target.fast_linear (drafttrain.target.fastlinear.resolve says what each does)
FAST_LINEAR_MODES = ("auto", "on", "off", "kernel", "onednn")

__all__ = ["ConfigError"]  # ConfigError's home: drafttrain.cliconfig; validation: drafttrain.validation


@dataclass
class TargetConfig:
    """The frozen target. ``path`` = a local HF folder; null = the packaged GGUF, converted once."""

    name: str = "smollm2-135m-instruct"
    path: str | None = None
    gguf_file: str | None = None  # a GGUF file to convert instead of the packaged one
    # a packaged target by name (drafttrain.assets.PACKAGED_TARGETS: smollm2-135m-instruct |
    # qwen2.5-coder-0.5b-instruct), converted once from its GGUF; null = smollm2-135m-instruct
    packaged: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (bf16 where the host computes it natively, else fp32)
    attn_implementation: str = "sdpa"
    # linear layers on prepacked weights (drafttrain.target.fastlinear): auto = for float32 on CPU, drafttrain's
    # kernel (AVX2 or AVX-512VL build) where it builds, else oneDNN; on = the same but an error where neither applies;
    # kernel | onednn = that backend only; off = F.linear. Verification then costs far less
    fast_linear: str = "auto"
    # tiny random target for tests: a config of this family (drafttrain.target.families: llama | qwen2 | qwen3 |
    # qwen3_moe | mistral | gemma3 | phi3 | gpt_oss) built from these (only when random_init is true)
    random_init: bool = False
    family: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seed: int = 0


@dataclass
class DataConfig:
    """Training data: a source of conversations and how answers are produced."""

    # sharegpt | a .jsonl / .json of conversations | an HF dataset folder of conversations |
    # generated (a dataset written by `python -m scripts.generate_data`, read from `path`)
    source: str = "sharegpt"
    path: str | None = None  # source=generated: the folder scripts.generate_data wrote (its output_dir)
    split: str | None = None  # split of an HF DatasetDict source
    max_conversations: int = 512  # conversations read from the source (kept ones)
    first_turn_only: bool = True
    max_length: int = 512  # tokens per training sequence
    # self-distillation: the target regenerates every answer (greedy, features kept) before training
    self_distill: bool = True
    generation: DistillConfig = field(default_factory=lambda: DistillConfig())
    # self-distillation's time budget: minutes of generation at most, planned from the speed measured on the first
    # shards (a slow host keeps a prefix of the shards in a fixed order, recorded with the job); null = every shard
    self_distill_minutes: float | None = 11.0
    # with self_distill: the share of conversations kept as they are (dataset rows), the rest self-distilled; the
    # drafter's labels are the target's own on both (chosen per conversation id: data.pipeline.split_share)
    dataset_share: float = 0.0
    heldout: int = 16  # sequences held out for eval/tau_sim
    cache_dir: str | None = None  # default: <cache_root>/data
    # where the target's features come from: auto (the dataset's stored `features` column if it has
    # one, else a live target forward per batch) | live | cache (a folder from scripts.cache_features)
    features: str = "auto"
    # features=cache: the folder scripts.cache_features wrote, or auto: the run labels its rows itself once (the
    # target's teacher-forced features of the drafter's layers, cached under cache_dir/features, resumable)
    feature_cache: str | None = None
    feature_cache_dtype: str = "bfloat16"  # feature_cache=auto: storage dtype float16 | bfloat16
    pack_tokens: int = 0  # feature_cache=auto: > 0 packs rows into forwards of this many tokens (no padding); 0 = padded batches
    heldout_split: str = "random"  # random (seeded draw) | head (the first `heldout` rows: the same rows whatever max_conversations)


@dataclass
class DrafterConfig:
    """A drafter: ``name`` selects a registered class (:data:`drafttrain.drafters.DRAFTERS`: medusa | eagle |
    parallelspec | parallelspec_eagle | any class added with ``register_drafter``).

    Its other keys are not listed here: they are the class's own ``defaults``, the one source of every
    drafter key and its default. :func:`drafter_schema` derives each drafter's schema (a subclass of
    this dataclass) from them, so a key the chosen drafter does not read is an unknown key (e.g.
    ``drafter.num_mask_tokens=3`` with Medusa, whose K is ``num_heads``), and a drafter defined outside
    the library has its keys validated the same way once registered. ``conf/drafter/NAME.yaml`` lists
    the same keys with the same values (tests/test_config.py holds them equal); a recipe
    (``conf/recipe/NAME.yaml``) sets the values it tunes.
    """

    name: str = "parallelspec"


#: The flat drafter schema of older runs: their saved config.json holds every one of these keys. When such a
#: file is validated again, a key the drafter does not read is dropped if it still has this old default (as
#: the old schema allowed); any other value of it stays an error.
LEGACY_DRAFTER_KEYS: dict[str, Any] = {
    "num_mask_tokens": 4, "num_heads": 4, "draft_depth": 5, "loss_decay": 0.8, "anchor_ratio": 0.25,
    "init_from_target_layer": True, "fc_bias": True, "draft_vocab_size": 0, "kd_weight": 0.0, "reg_weight": 1.0,
    "cls_weight": 0.1, "feature_noise": 0.1,
}  # fmt: skip


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (conf/optim/adamw.yaml mirrors these defaults, tested)."""

    lr: float = 2.0e-3  # measured better than 1e-3 for short CPU runs (docs/benchmarks/main_job.md); paper: 5e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    # the cosine runs over trainer.max_steps (steps) or over trainer.max_minutes of training time (minutes:
    # a run bounded by a time budget, e.g. recipes compared at equal minutes, still ends its decay at the budget)
    decay_over: str = "steps"


# ==================================================================================================
# Speculative evaluation: one schema for scripts.evaluate (EvalConfig) and the in-training evaluation
# (trainer.spec_eval: SpecEvalConfig). The classes hold scripts.evaluate's defaults; the training run's own
# values (prompt stride, draft tree) are a preset set in TrainerConfig.spec_eval and conf/trainer/default.yaml.
# ==================================================================================================


@dataclass
class EvalPromptsConfig:
    """The prompts of a speculative evaluation (:func:`drafttrain.data.sources.load_eval_prompts`): the same
    keys and defaults in ``scripts.evaluate`` (:class:`EvalConfig`) and ``trainer.spec_eval`` (:class:`SpecEvalConfig`)."""

    prompts: str = "mt_bench"  # mt_bench | gsm8k | path to a .jsonl of prompts
    # prompts read (every prompt_stride-th from prompt_offset); scripts.evaluate: null = all of them;
    # trainer.spec_eval: an int, 0 = no speculative evaluation
    num_prompts: int | None = 16
    prompt_offset: int = 0
    prompt_stride: int = 1  # every N-th prompt from the offset (MT-bench: 10 per category, so 10 = one per category)
    max_new_tokens: int = 128  # tokens generated per prompt at most


@dataclass
class TreeConfig:
    """The drafter's draft tree (docs/design.md, "The verifier"; ParallelSpec Appendix A.3): ``tree.*`` of
    ``conf/evaluate.yaml`` and ``trainer.spec_eval.tree.*`` of a training run (the trainer's own widths and
    budget are set in :class:`TrainerConfig`; these defaults are a chain).

    ``widths``: candidates per depth (null = a chain over all K + 1 depths); ``budget``: maximum nodes
    (null = one per depth); ``choices``: a static shape instead of the best-first one: ``eagle_default``,
    ``medusa_default`` or a list of rank lists, e.g. ``[[0], [1], [0, 0]]``. ``batched_drafting``: the
    drafter drafts the whole batch in shared forwards (ParallelSpec: one forward; EAGLE: one per
    depth); false = one sequence at a time, each with its own drafter cache (a reference to compare).
    ``plan``: the online planner (:mod:`drafttrain.verify.planner`) chooses every step how many of the
    tree's nodes to verify, including none (τ is then per verification step of the pruned trees; the
    in-training evaluation decodes the full tree as well and reports its τ as ``eval/tau``).
    ``choices`` and ``batched_drafting`` are read by ``scripts.evaluate`` only (validation refuses them
    under ``trainer.spec_eval``).
    """

    widths: list[int] | None = None
    budget: int | None = None
    choices: Any = None
    batched_drafting: bool = True
    # verify per step only the nodes that pay for their measured cost, pause drafting while nothing does
    # (drafttrain/verify/planner.py; lossless); false = verify the whole tree every step
    plan: bool = True


@dataclass
class SSSDEvalConfig:
    """SSSD in an evaluation (SSSD §3.1-3.2): ``sssd.*`` of ``conf/evaluate.yaml`` and ``trainer.spec_eval.sssd.*``.

    Read by both: ``max_prefix_len`` and ``max_depth`` (the drafting parameters; the others are the
    verifier-level ``SSSDConfig``'s defaults, drafttrain/verify/methods/sssd.py, whose values these two
    equal, held by tests/verify/test_sssd.py). Read by ``scripts.evaluate``'s ``sssd`` method only:
    ``datastore``, ``node_budgets``, ``tau_table``, ``planner_context``, ``num_threads``. Read by the
    in-training evaluation only (hybrid trees: SSSD's candidates merged into the drafter's,
    :mod:`drafttrain.verify.hybrid`; batched runs, ``spec_eval.batch_size`` > 1): ``source`` none | input
    (n-grams of the prompt and the output so far) | data (input + a datastore of the run's training answers,
    the target's own self-distilled outputs) and ``nodes`` (SSSD-only nodes per tree at most). Validation
    refuses a key set where it is not read.
    """

    source: str = "data"
    nodes: int = 8
    datastore: str = "data/datastore/sharegpt"  # folder from `python -m scripts.build_datastore`
    node_budgets: list[int] | None = None  # one run per tree size; null = the planner's choice per batch size
    tau_table: str = "docs/benchmarks/sssd_grid.json"  # the planner's tau(n) (`python -m scripts.sssd_grid`)
    planner_context: int = 256  # cached tokens per sequence while forward times are measured
    max_prefix_len: int = 6  # P, longest context suffix looked up
    max_depth: int = 8  # D, deepest candidate below the root
    num_threads: int = 1  # threads of SSSD's per-sequence drafting


#: Keys of the evaluation sections that only one of the two evaluations reads (validation refuses a value
#: other than the default where it is not read): section -> (read by scripts.evaluate only, by the trainer only).
EVAL_ONLY_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tree": ((), ()),  # one driver: both evaluations read every tree key
    "sssd": (("datastore", "node_budgets", "tau_table", "planner_context"), ("source", "nodes")),
}


@dataclass
class SpecEvalConfig(EvalPromptsConfig):
    """In-training speculative evaluation (greedy) on held-out prompts, at the end and every ``every`` steps:
    ``trainer.spec_eval``, a preset of the evaluation schema. The prompt keys, ``tree`` and ``sssd`` are
    ``scripts.evaluate``'s (:class:`EvalPromptsConfig`, :class:`TreeConfig`, :class:`SSSDEvalConfig`, the same
    defaults); the training run's values (``prompt_stride`` 5, tree widths [4, 2, 1, 1, 1] budget 8) are set
    in :class:`TrainerConfig` (and conf/trainer/default.yaml). ``num_prompts`` 0 = no speculative evaluation.
    """

    every: int = 0  # also run it every N steps (0 = only at the end)
    # sequences decoded together by the bundled batched verifier (1 = one sequence at a time: the drafter's chain,
    # which also gives batch-1 latency speedup; N > 1: plain and speculative runs of the engine at batch N)
    batch_size: int = 16
    # the drafter's tree (needs batch_size > 1; null widths+budget = a chain); tree.plan: decode once more with
    # the online planner (verify/planner.py: per step only the draft nodes that pay for their verification,
    # none when nothing does), eval/speedup_b<N> is then the planned run's
    tree: TreeConfig = field(default_factory=TreeConfig)
    chain: bool = False  # with a tree, also decode the chain (eval/tau_chain; ~1 min more on 2 CPU cores)
    # also decode with the drafter alone (its chain, no SSSD candidates): eval/tau_alone, printed beside eval/tau
    drafter_alone: bool = True
    # batch-1 latency: N of the prompts, spread evenly over the list (latency_subset: with 16 MT-bench prompts,
    # 2 per category, N = 8 is one per category), also go through the engine one sequence at a time, plain vs
    # speculative side by side (eval/speedup_b1); 0 = off (needs batch_size > 1: batch 1 is then the main run)
    latency_prompts: int = 8
    # the batch-1 latency runs' target forward under torch.compile (SpecEngine(compile_target=True)): ~6.5 min of
    # compilation on 2 cores before the timed runs, so off in the 30-minute main job
    compile_target: bool = False
    sssd: SSSDEvalConfig = field(default_factory=SSSDEvalConfig)  # hybrid trees: the drafter's + SSSD's candidates




def training_spec_eval() -> SpecEvalConfig:
    """``trainer.spec_eval``'s defaults: the evaluation schema with the training run's values (16 MT-bench prompts,
    every 5th: 2 per category; the hybrid tree of widths [4, 2, 1, 1, 1], 8 nodes, with SSSD's candidates)."""
    return SpecEvalConfig(prompt_stride=5, tree=TreeConfig(widths=[4, 2, 1, 1, 1], budget=8))


#: ``loss.divergence``: the distance between the target's distribution p and the drafter's q at a labelled slot.
DIVERGENCES = ("forward_kl", "reverse_kl", "js")


@dataclass
class LossConfig:
    """``loss``: what every multi-token drafter's objective does with its labelled slots, on offline and
    on-policy rows alike (the drafter's own loss keys, e.g. ``drafter.loss_decay``, stay in ``drafter``)."""

    divergence: str = "forward_kl"  # forward_kl (KL(p||q), the default) | reverse_kl (KL(q||p)) | js (Jensen-Shannon)
    cut_at_first_miss: bool = False  # Spec-AUF: slots after a group's first predicted miss count cut_weight
    cut_weight: float = 0.0  # the weight of the slots after the first miss (0 = left out)


@dataclass
class TrainerConfig:
    """The loop's settings (conf/trainer/default.yaml mirrors these defaults, tested)."""

    max_steps: int = 800
    max_minutes: float | None = 15.0  # stop (checkpoint, evaluate) once this much training time has passed; null = none
    micro_batch_size: int = 8  # sequences per process per forward
    grad_accum_steps: int = 1
    length_group_steps: int = 8  # sort each run of this many steps' samples by length (less padding); 1 = off
    mixed_precision: str = "auto"  # no | bf16 | fp16 | auto (bf16 where the hardware runs it fast, else no)
    attention: str = "dense"  # dense | flex: the training layouts' masks (flex block masks need CUDA: drafttrain/attention.py)
    log_every: int = 10
    eval_every: int = 100  # held-out eval/tau_sim every N steps (0 = only at the end)
    save_every: int = 100
    keep_checkpoints: int = 2
    num_threads: int | None = None  # torch intra-op threads per process (None = torch default)
    spec_eval: SpecEvalConfig = field(default_factory=training_spec_eval)  # the training run's preset
    # how a batch becomes a loss: a registered strategy's name (drafttrain/strategies); a strategy with keys of its
    # own adds the section trainer.<its config_section> to the schema (drafttrain.validation.train_schema)
    strategy: str = "offline"
    export: bool = True  # at the end, write the drafter's serving-engine folder (output_dir/export) and print its `vllm serve` line
    progress: bool = True


#: Keys that moved (old dotted key -> new one): an old key fails naming its new home (train.py, validate).
MOVED_KEYS: dict[str, str] = {
    **{f"trainer.spec_eval_{k}": f"trainer.spec_eval.{v}" for k, v in (
        ("every", "every"), ("prompts", "prompts"), ("num_prompts", "num_prompts"), ("offset", "prompt_offset"),
        ("stride", "prompt_stride"), ("max_new_tokens", "max_new_tokens"), ("batch_size", "batch_size"),
        ("tree_widths", "tree.widths"), ("tree_budget", "tree.budget"), ("chain", "chain"))},
    "trainer.spec_eval.plan": "trainer.spec_eval.tree.plan",  # the planner is the tree's key, as in scripts.evaluate
    "data.max_new_tokens": "data.generation.max_new_tokens",
    "data.max_prompt_length": "data.generation.max_prompt_length",
    "data.distill_batch_size": "data.generation.batch_size",
}  # fmt: skip


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_project: str = "drafttrain"
    wandb_mode: str = "offline"  # used when WANDB_MODE is not set in the environment


@dataclass
class DecisionModelConfig:
    """``python -m scripts.train_decision_model``: the MCSD early-stop decision model (MCSD-improved §3.3),
    a job of its own (no target, no drafter), trained on decision logs of verifier runs."""

    data: list[str] = field(default_factory=list)  # jsonl decision logs (scripts.evaluate mcsd.decisions_out=...)
    hidden: int = 64
    num_layers: int = 2  # type 2 (MCSD-improved §3.3): two linear layers
    lr: float = 1e-2
    epochs: int = 30
    batch_size: int = 256
    heldout_fraction: float = 0.2
    beta: float = 0.4  # early-stop threshold reported on the held-out rows (the paper's 0.4)
    seed: int = 0
    run_name: str = "decision_model"
    output_dir: str = "outputs/decision_model"  # writes decision_model/, metrics.jsonl, final_metrics.json
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    progress: bool = True


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    run_name: str = "run"
    output_dir: str = "outputs/run"
    seed: int = 0
    resume: bool = False


@dataclass
class SamplingConfig:
    """Greedy (``temperature: 0``) or temperature / top-p sampling, seeded per conversation and turn.

    The same vocabulary as :class:`~drafttrain.sampling.SamplingParams` and the evaluation's
    ``temperature`` / ``top_p`` / ``top_k`` (the former ``do_sample`` switch is gone: a temperature > 0 samples).
    """

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; else only the k most probable tokens (applied before top_p)
    seed: int = 0


@dataclass
class VllmConfig:
    """``generation.vllm``: the vLLM engine of ``generation.backend=vllm`` (a second venv, run as a subprocess:
    :class:`drafttrain.generation.vllm_client.VllmGenerator`). Operational settings: none is part of a job's key."""

    python: str | None = None  # the vLLM venv's python (null: $DRAFTTRAIN_VLLM_PYTHON, else .venv-vllm/bin/python)
    threads: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1" (null: every core this process may use)
    kv_cache_gb: int = 4  # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on the CPU backend
    memory_utilization: float = 0.3  # vLLM's gpu_memory_utilization (CPU memory on the CPU backend)
    eager: bool = False  # no torch.compile / graphs in vLLM: minutes less start-up on a small CPU, slower decoding
    timeout_s: int = 3600  # the engine's start-up and each round's request at most (seconds)


@dataclass
class GenerationConfig:
    """How the target regenerates assistant turns (:func:`drafttrain.data.selfdistill.generate_dataset`)."""

    max_new_tokens: int = 256  # tokens per assistant turn at most
    max_length: int = 2048  # context window: prompt + regenerated turns of one conversation, in tokens
    max_prompt_length: int | None = None  # a first prompt longer than this is skipped ("prompt too long")
    max_turns: int | None = None  # assistant turns regenerated per conversation (null = all, 1 = first turn)
    batch_size: int = 32  # sequences per generation batch
    max_batch_tokens: int | None = 16384  # padded prompt slots per batch (rows x longest prompt): long prompts get smaller batches
    max_padding: float | None = 0.5  # a batch's padded prompt slots stay <= (1 + this) x its real tokens
    shard_size: int | None = None  # conversations per shard (the unit of resume); null = batch_size
    # a turn cut by max_new_tokens: "close" appends the template's end-of-turn token (loss 0) and goes
    # on with the next turn; "stop" ends the conversation there
    on_length: str = "close"
    store_features: bool = False  # keep the target's last hidden states (fp16) from the generation itself
    check_template: bool = True  # check the template renders the regenerated text as the ids we assemble
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # engine: greedy generation through the bundled engine (preallocated ragged KV cache, no per-step cache
    # copy, drafttrain/generation/engine.py); hf: Target.generate (HF DynamicCache; also what sampling uses);
    # vllm: greedy through vLLM in its own venv (scripts/install_vllm.sh), features from a teacher-forced pass
    backend: str = "engine"
    vllm: VllmConfig = field(default_factory=VllmConfig)  # backend=vllm only


@dataclass
class DistillConfig:
    """``data.generation``: the keys of :class:`GenerationConfig` that in-training self-distillation
    (``data.self_distill``) reads, with the same names and defaults (read off GenerationConfig: one source).
    The rest is fixed by the training path: first turns (``data.first_turn_only``), context
    ``data.max_length``, features kept, greedy, one batch per shard."""

    max_new_tokens: int = GenerationConfig.max_new_tokens  # tokens per regenerated answer at most
    max_prompt_length: int | None = GenerationConfig.max_prompt_length  # longer first prompts are skipped (counted)
    batch_size: int = GenerationConfig.batch_size  # conversations per generation batch (and per shard)
    backend: str = GenerationConfig.backend  # engine | hf | vllm (see GenerationConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)  # backend=vllm only


@dataclass
class GenerateConfig:
    """``python -m scripts.generate_data`` (conf/generate.yaml)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    source: str = "sharegpt"  # sharegpt | .jsonl / .json of conversations | HF dataset folder
    split: str | None = None
    max_conversations: int | None = 200  # conversations kept from the source (null = all)
    output_dir: str = "data/generated/run"
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    num_threads: int | None = None
    progress: bool = True
    max_minutes: float | None = None  # stop starting new shards after this long; the same command continues


@dataclass
class CacheFeaturesConfig:
    """``python -m scripts.cache_features`` (conf/cache_features.yaml)."""

    target: TargetConfig = field(default_factory=TargetConfig)
    dataset: str = ""  # folder of a dataset with input_ids (a scripts.generate_data output_dir, or save_to_disk)
    output_dir: str = ""  # the cache folder; empty = <dataset>/features-<target.name>
    dtype: str = "float16"  # storage dtype of the hidden states: float16 | bfloat16
    top_k: int = 0  # also store the target's top-k logits per position (0 = none)
    # target layer ids to store (a drafter's declared feature_layers: id i = the hidden state entering decoder
    # layer i, 0 = embeddings, -1 or L = the final post-norm state); null = the final state
    feature_layers: list[int] | None = None
    batch_size: int = 8
    shard_size: int = 64  # rows per shard (the unit of resume)
    estimate: bool = False  # print the bytes the cache will take and exit
    num_threads: int | None = None
    progress: bool = True


def upgrade_saved(d: dict[str, Any]) -> dict[str, Any]:
    """A run's saved ``config.json`` written before keys moved, with every :data:`MOVED_KEYS` entry moved
    to its new place (so old runs still validate); other keys are left for :func:`validate` to judge."""
    d = json.loads(json.dumps(d))  # a deep copy
    for old, new in MOVED_KEYS.items():
        *path, leaf = old.split(".")
        parent = d
        for p in path:
            parent = parent.get(p) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or leaf not in parent:
            continue
        value = parent.pop(leaf)
        *npath, nleaf = new.split(".")
        node = d
        for p in npath:
            node = node.setdefault(p, {})
        node[nleaf] = value
    return d


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric config key: ``low``/``high`` bounds (None = unbounded), inclusive or not."""

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True

    def ok(self, x: float) -> bool:
        if self.low is not None and (x < self.low or (x == self.low and not self.low_inclusive)):
            return False
        return self.high is None or (x < self.high or (x == self.high and self.high_inclusive))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>=' if self.low_inclusive else '>'} {self.low}"
        return f"in {'[' if self.low_inclusive else '('}{self.low}, {self.high}{']' if self.high_inclusive else ')'}"


GE0, GE1, GT0 = Range(0), Range(1), Range(0, low_inclusive=False)
UNIT, UNIT_OPEN_LOW, UNIT_OPEN_HIGH = Range(0, 1), Range(0, 1, False, True), Range(0, 1, True, False)

#: The range of every numeric key of every schema (ints, floats, optional ones, lists of them), by class
#: and field name (a decoding method's section declares its own: :func:`numeric_ranges`). ``None`` (an optional key left unset) is always allowed. ``tests/test_config_values.py``
#: fails for a numeric field missing here, and checks each range is enforced. Semantics of 0 where it
#: is allowed: ``*_every`` = only at the end / never periodic, ``draft_vocab_size`` = the full vocabulary,
#: ``num_mask_tokens`` = no mask tokens, ``heldout`` / ``spec_eval.num_prompts`` = none, ``top_k`` = none.
NUMERIC_RANGES: dict[str, dict[str, Range]] = {
    "TargetConfig": dict(hidden_size=GE1, intermediate_size=GE1, num_hidden_layers=GE1, num_attention_heads=GE1,
                         num_key_value_heads=GE1, seed=GE0),
    "DataConfig": dict(max_conversations=GE1, max_length=Range(2), heldout=GE0, self_distill_minutes=GT0, dataset_share=UNIT,
                       pack_tokens=GE0),
    "DistillConfig": dict(max_new_tokens=GE1, max_prompt_length=GE1, batch_size=GE1),
    "DrafterConfig": dict(num_mask_tokens=GE0, num_heads=GE1, draft_depth=GE1, loss_decay=GT0, anchor_ratio=UNIT_OPEN_LOW,
                          draft_vocab_size=GE0, kd_weight=UNIT, reg_weight=GE0, cls_weight=GE0, feature_noise=GE0,
                          ttt_steps=GE1, mask_token_id=Range(-1), aux_layer_ids=GE0, num_layers=GE1, block_size=Range(2),
                          num_target_layers=GE1, loss_decay_gamma=GT0, num_anchors=GE1, target_layer_ids=GE0),
    "OptimConfig": dict(lr=GT0, weight_decay=GE0, betas=UNIT_OPEN_HIGH, warmup_steps=GE0, min_lr_ratio=UNIT,
                        max_grad_norm=GT0),
    "TrainerConfig": dict(max_steps=GE1, max_minutes=GT0, micro_batch_size=GE1, grad_accum_steps=GE1,
                          length_group_steps=GE1, log_every=GE1, eval_every=GE0, save_every=GE0, keep_checkpoints=GE1,
                          num_threads=GE1),
    "EvalPromptsConfig": dict(num_prompts=GE1, prompt_offset=GE0, prompt_stride=GE1, max_new_tokens=GE1),
    "SpecEvalConfig": dict(every=GE0, num_prompts=GE0, batch_size=GE1, latency_prompts=GE0),  # num_prompts 0 = none
    "SSSDEvalConfig": dict(nodes=GE0, node_budgets=GE0, planner_context=GE1, max_prefix_len=GE1, max_depth=GE1,
                           num_threads=GE1),
    "TreeConfig": dict(widths=GE1, budget=GE1),
    "TrainConfig": dict(seed=GE0),
    "LossConfig": dict(cut_weight=UNIT),
    "DecisionModelConfig": dict(seed=GE0, hidden=GE1, num_layers=GE1, lr=GT0, epochs=GE1, batch_size=GE1, heldout_fraction=UNIT_OPEN_HIGH,
                           beta=UNIT),
    "GenerateConfig": dict(max_conversations=GE1, num_threads=GE1, max_minutes=GT0),
    "GenerationConfig": dict(max_new_tokens=GE1, max_length=Range(2), max_prompt_length=GE1, max_turns=GE1, batch_size=GE1,
                             max_batch_tokens=GE1, max_padding=GE0, shard_size=GE1),
    "SamplingConfig": dict(temperature=GE0, top_p=UNIT_OPEN_LOW, top_k=GE0, seed=GE0),
    "VllmConfig": dict(kv_cache_gb=GE1, memory_utilization=UNIT_OPEN_LOW, timeout_s=GE1),
    # feature_layers: a loose sanity bound; the real one, [-(L + 1), L], needs the target's depth L and is
    # checked (target.resolve_feature_layers) from its config before the target loads
    "CacheFeaturesConfig": dict(top_k=GE0, batch_size=GE1, shard_size=GE1, num_threads=GE1,
                                feature_layers=Range(-1025, 1024)),
    "EvalConfig": dict(replay_accept_prob=UNIT, replay_depth=GE1, batch_sizes=GE1, temperature=GE0, top_p=UNIT_OPEN_LOW, top_k=GE0, seed=GE0, stop_token_ids=GE0, num_threads=GE1),
}  # fmt: skip


def numeric_ranges(cls: type) -> dict[str, Range]:
    """The ranges of ``cls``'s numeric fields, its base classes' first (a subclass's entry wins, e.g.
    :class:`SpecEvalConfig`'s ``num_prompts`` over :class:`EvalPromptsConfig`'s): per class its own
    ``numeric_ranges`` class attribute (a decoding method's config section declares them beside its
    fields, drafttrain/verify/methods/), else :data:`NUMERIC_RANGES` by class name."""
    out: dict[str, Range] = {}
    for k in reversed(cls.__mro__):
        own = vars(k).get("numeric_ranges")
        out.update(own if own is not None else NUMERIC_RANGES.get(k.__name__, {}))
    return out


def numeric_problems(obj, prefix: str = "") -> list[str]:
    """Every numeric value of a config (dataclass instance, nested ones included) outside its
    :data:`NUMERIC_RANGES` range, as ``"trainer.log_every must be >= 1, got 0"``."""
    problems = []
    ranges = numeric_ranges(type(obj))  # a drafter's schema (a DrafterConfig subclass) takes DrafterConfig's ranges
    for f in fields(obj):
        v, key = getattr(obj, f.name), prefix + f.name
        if hasattr(v, "__dataclass_fields__"):
            problems += numeric_problems(v, key + ".")
            continue
        rule = ranges.get(f.name)
        values = v if isinstance(v, (list, tuple)) else [v]
        if rule is not None and any(isinstance(x, (int, float)) and not isinstance(x, bool) and not rule.ok(x)
                                    for x in values):  # fmt: skip
            problems.append(f"{key} must be {'all ' if isinstance(v, (list, tuple)) else ''}{rule}, got {v}")
    return problems


#: Generation backends (``generation.backend``); :mod:`drafttrain.generation` implements one for each.
BACKENDS = ("engine", "hf", "vllm")


def to_dict(c) -> dict[str, Any]:
    """Plain dict of a validated config (for saving next to checkpoints and logging)."""
    return OmegaConf.to_container(OmegaConf.structured(c), resolve=True)


# ==================================================================================================
# Evaluation (python -m scripts.evaluate; conf/evaluate.yaml)
# ==================================================================================================


@dataclass
class EvalConfig(EvalPromptsConfig):
    """``python -m scripts.evaluate`` (conf/evaluate.yaml), less the decoding methods' own sections.

    Every registered decoding method's section (``tree``, ``sssd``, ``mcsd``, ``mtad``, ...: the
    ``config`` dataclass of its :class:`~drafttrain.verify.methods.registry.Method`) is an attribute of
    the validated config too: :func:`validate_eval` merges into :func:`eval_schema`, a subclass of this
    one with a field per section, so the sections are validated (unknown keys, types) like the rest.
    """

    target: TargetConfig = field(default_factory=TargetConfig)
    checkpoint: str | None = None  # a training run folder (drafter/ + config.json) or a drafter/ folder
    # training: run the training run's own evaluation (its trainer.spec_eval: prompts, trees, SSSD, lock-step
    # timing) on checkpoint=<run folder>, reproducing its eval/tau (drafttrain/eval/preset.py); null = the harness
    preset: str | None = None
    untrained_drafter: bool = False  # no checkpoint: time a fresh ParallelSpec drafter (τ is meaningless)
    proposer: str = "parallelspec"  # a registered method; parallelspec = drafter | replay (verifier benchmark)
    methods: list[str] | None = None  # null = [proposer]; registered method names (drafttrain.verify.methods), one report
    perplexity: bool | None = None  # output perplexity under the target per run; null = when a lossy method runs
    replay_accept_prob: float = 0.7
    replay_depth: int = 5
    # prompts, num_prompts, prompt_offset, prompt_stride, max_new_tokens: EvalPromptsConfig's
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    modes: list[str] = field(default_factory=lambda: ["unpadded", "padded"])  # speculative runs
    plain_mode: str = "unpadded_kv"  # engine mode of the plain-decoding baseline
    pack_inputs: str = "auto"  # unpadded mode: auto (plain steps batched [B, 1], tree steps packed) | always
    compile_target: bool = False  # batch-1 runs (plain and speculative): the target forward under torch.compile
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; else only the k most probable tokens (applied before top_p; MTAD App. F uses 20)
    seed: int = 0
    stop_token_ids: list[int] | None = None  # default: the tokenizer's end-of-turn ids
    num_threads: int | None = None
    warmup: bool = True  # one short untimed run first (allocations, first-call overheads)
    run_name: str = "eval"
    output_dir: str = "outputs/eval/eval"
    progress: bool = True
    plots: bool = True

    def method_names(self) -> list[str]:
        """The decoding methods to run: ``methods``, or ``[proposer]`` when it is null."""
        return list(self.methods) if self.methods is not None else [self.proposer]


