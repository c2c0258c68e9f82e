"""The one training loop for every drafter (accelerate): steps, metrics, the run's stages.

``run(cfg)`` is what ``train.py`` (the Hydra entry point) calls and what tests call directly.
Order of work: validate the config (a typo fails here, before any model loads) -> Accelerator ->
target -> data (self-distilled by default) -> drafter, AdamW, warm-up + cosine -> resume -> steps ->
held-out eval/tau_sim -> speculative eval on MT-bench (eval/tau, greedy equality) -> final save.

The data pipeline (sources -> rows -> datasets, held-out split) is :mod:`drafttrain.data.pipeline`; rows
-> batches and their order :mod:`drafttrain.data.batches`. Data order is a pure function of (seed,
global sample index), and anchor subsampling draws from a
generator seeded by (seed, step, global micro-batch index = micro-step x world + rank), so a run
resumed from a checkpoint replays the same batches as an uninterrupted one, and 2 processes x 1
micro-batch see exactly the samples and anchors of 1 process x 2 accumulated micro-batches (tested).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drafttrain.config import TrainConfig, to_dict
from drafttrain.eval import in_training
from drafttrain.fingerprint import dataset_fingerprint, git_sha
from drafttrain.train.checkpoint import (
    CHECKPOINTS,
    TrainState,
    atomic_save_pretrained,
    check_resume,
    fault_point,
    remove_incomplete_checkpoints,
    save_checkpoint,
)
from drafttrain.train.schedule import lr_lambda, set_schedule_lr
from drafttrain.validation import resolve_mixed_precision, validate

log = logging.getLogger(__name__)


# ==================================================================================================
# config (the data pipeline is drafttrain/data/pipeline.py, batches and their order drafttrain/data/batches.py)
# ==================================================================================================
def compose_config(overrides: list[str]) -> TrainConfig:
    """Compose ``conf/train.yaml`` with Hydra ``overrides`` (e.g. ``["+recipe=eagle", "target=tiny"]``) and
    validate it, as ``train.py`` would (for scripts and tests; raises ConfigError like a launch)."""
    from hydra import compose, initialize_config_dir

    from drafttrain.cliconfig import check_moved
    from drafttrain.config import MOVED_KEYS

    check_moved(overrides, MOVED_KEYS)  # an old key names its new home
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return validate_run(cfg)


def validate_run(cfg) -> TrainConfig:
    """:func:`drafttrain.validation.validate` of a composed config (a validated one is returned as it is): every
    problem in one ConfigError, before any model loads."""
    return cfg if isinstance(cfg, TrainConfig) else validate(cfg)



# ==================================================================================================
# metrics
# ==================================================================================================
def reduce_sums(accelerator, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All-reduce (sum) every tensor in ``sums`` across ranks."""
    keys = sorted(sums)
    if not keys:  # a drafter that reports no metric sums (every rank alike)
        return {}
    flat = torch.cat([sums[k].reshape(-1).float() for k in keys]).to(accelerator.device)
    flat = accelerator.reduce(flat, reduction="sum")
    out, i = {}, 0
    for k in keys:
        n = sums[k].numel()
        out[k] = flat[i : i + n].reshape(sums[k].shape).cpu()
        i += n
    return out


@torch.no_grad()
def heldout_sums(drafter, ds, target, c: TrainConfig, accelerator, feature_layers=None) -> dict[str, torch.Tensor] | None:
    """Metric sums of the drafter on this rank's share of the held-out split (all anchors).

    Runs the prepared (wrapped) drafter, so that DeepSpeed ZeRO-3 gathers its sharded weights, and
    every rank runs the same number of forward passes (ZeRO-3's gathers are collective): a rank whose
    share is used up runs a padding batch whose sums are dropped.
    """
    from drafttrain.data.batches import get_batch
    from drafttrain.metrics import merge_sums

    if ds is None:
        return None
    drafter.eval()  # eval mode: every group scored, no input noise (the drafter interface)
    sums = None
    world, mbs = accelerator.num_processes, c.trainer.micro_batch_size
    idx = list(range(accelerator.process_index, len(ds), world))
    n_batches = math.ceil(math.ceil(len(ds) / world) / mbs)
    for i in range(n_batches):
        rows = idx[i * mbs : (i + 1) * mbs]
        batch = get_batch(ds, target, rows or [0], accelerator.device, feature_layers)
        with accelerator.autocast():
            out = drafter(batch)  # through the wrapper: ZeRO-3 gathers the partitioned parameters
        if rows:
            sums = merge_sums(sums, out.sums)
    if sums is None:  # this rank had no held-out rows: contribute zeros to the all-reduce
        sums = {k: torch.zeros_like(v) for k, v in out.sums.items()}
    drafter.train()
    return sums


class MetricsLog:
    """Rank 0's JSONL file of every logged metric dict (``metrics.jsonl`` in the run folder).

    ``lines`` counts its rows; a checkpoint records it, and :meth:`start` cuts the file back to the
    checkpoint's count on resume (a fresh run starts an empty file), so a resumed run logs each step once.
    """

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled, self.lines = path, enabled, 0

    def start(self, keep_lines: int | None) -> None:
        """Fresh run (``keep_lines=None``): empty the file. Resume: keep its first ``keep_lines`` rows."""
        if not self.enabled:
            return
        from drafttrain.data.shards import atomic_write_text

        rows = []
        if keep_lines and self.path.is_file():
            rows = self.path.read_text().splitlines(keepends=True)[:keep_lines]
            if len(rows) < keep_lines:
                log.warning("%s has %d rows, the checkpoint expected %d", self.path, len(rows), keep_lines)
        atomic_write_text(self.path, "".join(rows))
        self.lines = len(rows)

    def write(self, metrics: dict[str, Any], step: int) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            self.lines += 1


def wandb_run_id(out_dir: Path, resume_from: Path | None) -> str:
    """The W&B run id of this run folder: a resumed run reuses the one in ``out_dir/wandb_run_id``
    (written by the run that started the folder), so W&B continues the same run; a fresh run makes a new one."""
    path = out_dir / "wandb_run_id"
    if resume_from is not None and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id


# ==================================================================================================
# run
# ==================================================================================================
@dataclass
class _Run:
    """What the stages of :func:`run` share: the validated config, the accelerator, the run folder, and what
    each stage adds (target and data; drafter, optimizer, schedule and loop counters; the metrics log)."""

    c: TrainConfig
    accelerator: Any
    out_dir: Path
    t_start: float  # time.time() when the run started (after the accelerator, before the target loads)
    target: Any = None
    layers: Any = None  # the target layers the drafter declares (Drafter.layers_for)
    dcfg: dict[str, Any] | None = None  # the drafter's config dict (drafter_config)
    train_ds: Any = None
    held_ds: Any = None
    drafter: Any = None
    opt: Any = None
    sched: Any = None
    base_lrs: list[float] | None = None
    state: TrainState | None = None
    n_params: int = 0
    launch: dict[str, Any] | None = None
    mlog: MetricsLog | None = None
    strategy: Any = None  # the training strategy (drafttrain.strategies): rows -> batch -> loss
    data_reports: dict[str, Any] = field(default_factory=dict)  # prepare_data's (the self-distillation report)
    preflight: Any = None  # the pre-flight check's report (drafttrain.preflight)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """One row of ``metrics.jsonl`` (rank 0) and, with ``logging.wandb``, the numeric values to W&B."""
        self.mlog.write(metrics, step)
        if self.c.logging.wandb:
            self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)


def run(cfg) -> dict[str, Any]:
    """Train a drafter as configured. Returns the final metrics (also written to ``final_metrics.json``).

    The stages, in order: :func:`_start_run` (accelerator, run folder, seed), :func:`_load_target_and_data`,
    :func:`_build_drafter` (drafter, AdamW, schedule), :func:`_resume`, :func:`_start_logging`,
    :func:`_train_steps`, :func:`_final_evaluation` (held-out metrics, checkpoint, drafter, speculative eval).

    Args:
        cfg: a composed Hydra ``DictConfig``, a plain dict, or a :class:`TrainConfig`.

    Raises:
        ConfigError: unknown key / bad value (before anything is loaded).
    """
    c = validate_run(cfg)
    from drafttrain.validation import smoke_size_hint

    if hint := smoke_size_hint(c):  # a small local model at the main job's sizes: say how to shrink them
        print(f"[drafttrain] {hint}", flush=True)
    c.trainer.mixed_precision = resolve_mixed_precision(c.trainer.mixed_precision)
    resume_from = check_resume(c) if c.resume else None  # a changed job fails here, before anything loads
    r = _start_run(c)
    _load_target_and_data(r)
    _build_drafter(r)
    metrics_lines = _resume(r, resume_from)
    _start_logging(r, resume_from, metrics_lines)
    stopped_early = _train_steps(r)
    final = _final_evaluation(r, stopped_early)
    accelerator, out_dir, main = r.accelerator, r.out_dir, r.main
    if main:
        from drafttrain.data.shards import atomic_write_text

        atomic_write_text(out_dir / "final_metrics.json", json.dumps(final, indent=1))
        if budget_line(final, c):
            print(f"[drafttrain] {budget_line(final, c)}", flush=True)
        summary = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in final.items()
                            if not k.startswith("eval/planner_"))  # the planners' counters: final_metrics.json
        print(f"[drafttrain] done: {summary}", flush=True)
        if "eval/tau" in final:
            print(f"[drafttrain] {in_training.speedup_line(final)}", flush=True)
        if c.trainer.export:
            export_for_serving(c, out_dir)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


def _start_run(c: TrainConfig) -> _Run:
    """Threads, the Accelerator (CPU/GPU, DDP or DeepSpeed: :mod:`drafttrain.train.distributed`), the run folder
    with ``config.json`` and ``target.json`` (rank 0), and the seed."""
    from accelerate.utils import set_seed

    from drafttrain.train.distributed import close_file_logs, make_accelerator
    from drafttrain.fingerprint import target_fingerprint

    target_fp = target_fingerprint(c.target)  # config + weights hash (cached); recorded with every checkpoint
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    os.environ.setdefault("WANDB_MODE", c.logging.wandb_mode)
    out_dir = Path(c.output_dir)
    accelerator = make_accelerator(c, str(out_dir))
    main = accelerator.is_main_process
    if not main:
        close_file_logs()  # Hydra's train.log: rank 0's only
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(to_dict(c), indent=1))
        (out_dir / "target.json").write_text(json.dumps({"name": c.target.name, "fingerprint": target_fp}, indent=1))
    set_seed(c.seed)
    return _Run(c, accelerator, out_dir, time.time())


def _load_target_and_data(r: _Run) -> None:
    """The frozen target (whole on every rank, outside DeepSpeed), the drafter's config and declared target
    layers, and the train / held-out datasets (:func:`drafttrain.data.pipeline.prepare_data`)."""
    from drafttrain.data.pipeline import prepare_data
    from drafttrain.train.distributed import frozen_target_context
    from drafttrain.compose import build_run
    from drafttrain.drafters import drafter_class, drafter_config

    c = r.c
    with frozen_target_context(r.accelerator):  # whole on every rank, outside DeepSpeed (never partitioned)
        r.target = build_run(c, device=r.accelerator.device).target
    r.dcfg = drafter_config(c.drafter.name, to_dict(c)["drafter"])
    _preflight(r)  # before any work: the target's structure, the engine, the drafter (one line if it fails)
    # the target layers the drafter declares: what self-distillation stores and every batch carries
    r.layers = drafter_class(c.drafter.name).layers_for(r.dcfg, r.target.num_hidden_layers)
    r.train_ds, r.held_ds = prepare_data(c, r.target, r.accelerator, r.layers, reports=r.data_reports)
    log.info("train sequences %d, held-out %d", len(r.train_ds), len(r.held_ds) if r.held_ds is not None else 0)


def _preflight(r: _Run) -> None:
    """:func:`drafttrain.preflight.check_target` on the loaded target: its structure and forward; the engine where
    the run decodes with it (self-distillation through the engine, the speculative evaluation); the recipe's
    drafter. Runs under a forked RNG, so the run's own draws (drafter init, batches) are the ones without it."""
    from drafttrain.preflight import check_target

    c = r.c
    engine = c.data.generation.backend == "engine" or c.trainer.spec_eval.num_prompts > 0
    with torch.random.fork_rng(devices=[]):
        r.preflight = check_target(r.target, engine=engine, drafter=(c.drafter.name, r.dcfg))


def _build_drafter(r: _Run) -> None:
    """The drafter (its draft vocabulary from the training answers where it has one), AdamW, the warm-up +
    cosine schedule, all prepared by the accelerator, and the loop counters registered for checkpointing."""
    from drafttrain.train.distributed import prepare
    from drafttrain.drafters import build_drafter

    c, target = r.c, r.target
    drafter = build_drafter(c.drafter.name, r.dcfg, target)
    drafter.set_attention(c.trainer.attention, device=r.accelerator.device)  # flex on a CPU device fails here
    draft_vocab_size = int(r.dcfg.get("draft_vocab_size", 0))  # a key of the drafters that restrict their vocabulary
    if draft_vocab_size:
        from drafttrain.data.vocab import frequent_tokens

        ids, coverage = frequent_tokens(r.train_ds, draft_vocab_size, target.lm_head.weight.shape[0])
        drafter.set_draft_vocab(ids)
        log.info("draft vocabulary: %d tokens cover %.1f%% of training answer tokens", ids.numel(), 100 * coverage)
    r.n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    from drafttrain.memory import check_training_fits

    check_training_fits(c.trainer.micro_batch_size, c.data.max_length,  # a run that cannot fit fails here, one line
                        draft_vocab_size or target.lm_head.weight.shape[0], target.config.hidden_size,
                        len(r.layers), r.n_params)
    opt = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad],
        lr=c.optim.lr,
        betas=tuple(c.optim.betas),
        weight_decay=c.optim.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, c.optim.warmup_steps, c.trainer.max_steps, c.optim.min_lr_ratio)
    )
    r.drafter, r.opt, r.sched = prepare(r.accelerator, c, drafter, opt, sched, hidden_size=target.config.hidden_size)
    r.state = TrainState()
    r.accelerator.register_for_checkpointing(r.state)
    from drafttrain.data.batches import get_batch
    from drafttrain.strategies import build_strategy

    r.strategy = build_strategy(c, target, r.layers, get_batch)  # trainer.strategy: how a batch becomes a loss
    r.base_lrs = r.sched.scheduler.base_lrs if hasattr(r.sched, "scheduler") else r.sched.base_lrs  # (accelerate wraps it)


def _resume(r: _Run, resume_from: Path | None) -> int | None:
    """Remove what an interrupted save left, then load ``resume_from`` (accelerate state, loop counters,
    the schedule's lr). Returns the checkpoint's ``metrics_lines`` (None: a fresh run, metrics.jsonl starts empty)."""
    c, accelerator, out_dir = r.c, r.accelerator, r.out_dir
    metrics_lines = None  # fresh run: metrics.jsonl starts empty
    if r.main and (out_dir / CHECKPOINTS).is_dir():
        remove_incomplete_checkpoints(out_dir)
    accelerator.wait_for_everyone()
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        meta = json.loads((resume_from / "meta.json").read_text())
        metrics_lines = meta.get("metrics_lines")
        r.strategy.load_state_dict(meta.get("strategy_state", {}))  # the strategy's own state (none for the built-in ones)
        set_schedule_lr(r.opt, r.base_lrs, r.state.step, c, r.state.train_seconds)
        log.info("resumed from %s at step %d (samples %d)", resume_from, r.state.step, r.state.samples)
    elif c.resume:
        log.info("resume=true but no checkpoint in %s: starting fresh", out_dir / CHECKPOINTS)
    elif r.main and (out_dir / CHECKPOINTS).exists():
        log.warning("%s has checkpoints from an earlier run; resume=false starts over", out_dir)
    return metrics_lines


def _start_logging(r: _Run, resume_from: Path | None, metrics_lines: int | None) -> None:
    """``launch.json`` (processes and the host facts that decide the speed figures), the W&B run (a resumed
    run continues its own) and ``metrics.jsonl`` (cut back to ``metrics_lines`` on resume)."""
    from drafttrain.target import fastattention, fastlinear
    from drafttrain.train.distributed import launch_info
    from drafttrain.host import describe

    c, accelerator, out_dir = r.c, r.accelerator, r.out_dir
    launch = launch_info(accelerator)
    # the host (drafttrain.host.describe: CPU model, ISA, native bf16, ...) and the facts of this run that decide
    # the speed figures (docs/benchmarks/main_job.md names them)
    launch["host"] = {**describe(), "cpu_capability": fastlinear.cpu_capability(), "cpu_threads": torch.get_num_threads(),
                      "target_linears": fastlinear.describe(r.target.model), "decode_attention": fastattention.backend(),
                      "mixed_precision": c.trainer.mixed_precision}
    r.launch = launch
    if r.main:
        (out_dir / "launch.json").write_text(json.dumps(launch, indent=1))
    if c.logging.wandb:
        accelerator.init_trackers(
            c.logging.wandb_project,
            config={**to_dict(c), "git_sha": git_sha() or "unknown", "trainable_params": r.n_params, "launch": launch},
            init_kwargs={"wandb": {"dir": str(out_dir), "name": c.run_name,
                                   "id": wandb_run_id(out_dir, resume_from) if r.main else None, "resume": "allow"}},
        )
    r.mlog = MetricsLog(out_dir / "metrics.jsonl", r.main)
    r.mlog.start(metrics_lines)


def _train_steps(r: _Run) -> bool:
    """Optimizer steps until ``trainer.max_steps`` or ``trainer.max_minutes`` of training time: per step
    ``grad_accum_steps`` micro-batches (data order and anchors: module docstring), clipping, the schedule,
    and every ``log_every`` / ``eval_every`` / ``spec_eval.every`` / ``save_every`` steps their work.
    Returns whether the time budget stopped the run before ``max_steps``."""
    from tqdm.auto import tqdm

    from drafttrain.data.batches import sample_indices
    from drafttrain.train.distributed import full_drafter, peak_memory_mb, per_rank
    from drafttrain.metrics import finalize, merge_sums
    from drafttrain.train.tracking import log_eval_table

    c, accelerator, state, drafter, opt = r.c, r.accelerator, r.state, r.drafter, r.opt
    target, layers, train_ds, held_ds, main = r.target, r.layers, r.train_ds, r.held_ds, r.main
    world, mbs, accum = accelerator.num_processes, c.trainer.micro_batch_size, c.trainer.grad_accum_steps
    per_step = world * mbs * accum
    lengths = [len(x) for x in train_ds.with_format(None)["input_ids"]]
    group = per_step * c.trainer.length_group_steps if c.trainer.length_group_steps > 1 else 0
    bar = tqdm(total=c.trainer.max_steps, initial=state.step, desc="train", disable=not (main and c.trainer.progress))
    window_sums, window_tokens, window_seq_tokens, window_t0 = None, 0, 0, time.time()
    window_loss, window_n = 0.0, 0
    seg_start = time.time()
    base_seconds = state.train_seconds
    stopped_early = False
    drafter.train()
    while state.step < c.trainer.max_steps:
        if c.trainer.max_minutes is not None and state.train_seconds >= 60 * c.trainer.max_minutes:
            stopped_early = True
            break
        for m in range(accum):
            start = state.samples + m * world * mbs + accelerator.process_index * mbs
            idx = sample_indices(start, mbs, len(train_ds), c.seed, lengths, group)
            batch = r.strategy.make_batch(train_ds, idx, accelerator.device)
            # anchors drawn from (seed, step, global micro-batch index): the same samples get the same anchors
            # whether a micro-batch runs on another rank or as another accumulation step (1 process: m)
            micro = m * world + accelerator.process_index
            gen = torch.Generator().manual_seed(c.seed * 1_000_003 + state.step * 1009 + micro * 31)
            # accumulate(): no gradient sync before the last micro-step; backward() divides the loss by
            # accum (DeepSpeed: by its gradient_accumulation_steps) and DeepSpeed steps at the boundary
            with accelerator.accumulate(drafter), accelerator.autocast():
                out = r.strategy.loss(drafter, batch, gen, state.step, micro)  # trainer.strategy: rows -> loss
                accelerator.backward(out.loss)
            fault_point("step", state.step + 1)
            window_sums = merge_sums(window_sums, out.sums)
            window_tokens += out.num_tokens
            window_seq_tokens += int(batch["lengths"].sum())
            window_loss += float(out.loss.detach()) / accum
        window_n += 1
        grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), c.optim.max_grad_norm)
        opt.step()
        r.sched.step()
        opt.zero_grad(set_to_none=True)
        state.step += 1
        state.samples += per_step
        state.train_seconds = base_seconds + (time.time() - seg_start)
        if c.optim.decay_over == "minutes":  # the cosine follows the clock (LambdaLR counts steps only)
            set_schedule_lr(opt, r.base_lrs, state.step, c, state.train_seconds)
        bar.update(1)

        if state.step % c.trainer.log_every == 0 or state.step == c.trainer.max_steps:
            sums = reduce_sums(accelerator, window_sums)
            tok, seq_tok = accelerator.reduce(
                torch.tensor([float(window_tokens), float(window_seq_tokens)], device=accelerator.device), "sum"
            ).tolist()
            loss = float(accelerator.reduce(torch.tensor([window_loss / window_n], device=accelerator.device), "mean"))
            metrics = {
                "train/loss": loss,
                "train/lr": opt.param_groups[0]["lr"],  # the lr of the next step (the schedule's, either clock)
                "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                "train/tokens_per_s": tok / max(time.time() - window_t0, 1e-9),  # drafter input slots
                "train/seq_tokens_per_s": seq_tok / max(time.time() - window_t0, 1e-9),  # training sequence tokens
                "train/seconds_per_step": (time.time() - window_t0) / window_n,
                "train/samples": state.samples,
                "train/peak_mem_mb": max(per_rank(accelerator, peak_memory_mb(accelerator.device))),
                **r.strategy.window_metrics(),
                **finalize(sums, "train"),
            }
            r.log_metrics(metrics, state.step)
            bar.set_postfix(loss=f"{loss:.3f}", tau_sim=f"{metrics.get('train/tau_sim', 0):.2f}",
                            tok_s=f"{metrics['train/tokens_per_s']:.0f}")
            window_sums, window_tokens, window_seq_tokens, window_t0 = None, 0, 0, time.time()
            window_loss, window_n = 0.0, 0
        if c.trainer.eval_every and state.step % c.trainer.eval_every == 0 and held_ds is not None:
            hs = heldout_sums(drafter, held_ds, target, c, accelerator, layers)
            r.log_metrics(finalize(reduce_sums(accelerator, hs), "eval"), state.step)
        se_every = c.trainer.spec_eval.every
        if se_every and state.step % se_every == 0 and state.step < c.trainer.max_steps:
            model = full_drafter(accelerator, drafter)  # collective under ZeRO-3
            if main:
                res = in_training.spec_eval(c, target, model, train_ds)
                r.log_metrics(res, state.step)
                if c.logging.wandb:
                    log_eval_table(accelerator, res, state.step)
                model.train()
            accelerator.wait_for_everyone()
            seg_start, base_seconds = time.time(), state.train_seconds  # eval time is not training time
        if c.trainer.save_every and state.step % c.trainer.save_every == 0:
            save_checkpoint(accelerator, drafter, c, state, r.out_dir, r.mlog.lines, r.strategy.state_dict())
    bar.close()
    return stopped_early


def _final_evaluation(r: _Run, stopped_early: bool) -> dict[str, Any]:
    """The final metrics: counters, held-out metrics, a last checkpoint, the drafter saved to
    ``output_dir/drafter`` and, on rank 0, the speculative evaluation (:func:`drafttrain.eval.in_training.spec_eval`) and ``wall_seconds``
    (logged to metrics.jsonl / W&B). Every rank returns its dict; rank 0's has the evaluation."""
    from drafttrain.train.distributed import full_drafter, peak_memory_mb, per_rank
    from drafttrain.metrics import finalize
    from drafttrain.train.tracking import log_eval_table

    c, accelerator, state, drafter, main = r.c, r.accelerator, r.state, r.drafter, r.main
    target, layers, train_ds, held_ds = r.target, r.layers, r.train_ds, r.held_ds
    train_seconds = state.train_seconds
    final: dict[str, Any] = {
        "step": state.step,
        "samples": state.samples,  # training sequences seen (all ranks)
        "train_rows": len(train_ds),  # epochs = samples / train_rows
        "train_data_sha": dataset_fingerprint(train_ds, ("input_ids", "loss_mask")),  # same value = same sequences
        "train_seconds": round(train_seconds, 1),
        "trainable_params": r.n_params,
        "stopped_by_time_budget": stopped_early,
        "peak_memory_mb": peak_memory_mb(accelerator.device),
    }
    budget = r.data_reports.get("selfdistill", {}).get("budget")
    if budget is not None and budget["shards"] < budget["shards_total"]:  # a slow host: self-distillation was cut
        final["data_cut_by_time_budget"] = {
            "conversations": budget["conversations"], "of": budget["conversations_total"],
            "generated_tokens_per_s": round(budget["tokens_per_s"], 1), "budget_minutes": c.data.self_distill_minutes}
    if held_ds is not None:
        final.update(finalize(reduce_sums(accelerator, heldout_sums(drafter, held_ds, target, c, accelerator, layers)), "eval"))
    save_checkpoint(accelerator, drafter, c, state, r.out_dir, r.mlog.lines, r.strategy.state_dict())
    final["peak_mem_mb_per_rank"] = [round(x, 1) for x in per_rank(accelerator, peak_memory_mb(accelerator.device))]
    final["launch"] = r.launch
    model = full_drafter(accelerator, drafter)  # collective under ZeRO-3
    if main:
        atomic_save_pretrained(model, r.out_dir / "drafter")
        if c.trainer.spec_eval.num_prompts > 0:
            model.pack_for_inference()  # training is over (never mid-run: DeepSpeed updates param.data)
            store = in_training.training_datastore(c, train_ds, r.out_dir)  # saved: scripts.evaluate preset=training reads it
            final.update(in_training.spec_eval(c, target, model, train_ds, datastore=store))
        final["wall_seconds"] = round(time.time() - r.t_start, 1)
        r.log_metrics({k: v for k, v in final.items() if k.startswith(("eval/", "train/"))}, state.step)
        if c.logging.wandb and "eval/tau" in final:
            log_eval_table(accelerator, final, state.step)
    return final


def export_for_serving(c: TrainConfig, out_dir: Path) -> Path | None:
    """Write the trained drafter's serving-engine folder to ``out_dir/export`` and print its ``vllm serve`` line.

    The recipe's default format (:func:`drafttrain.export.formats_for`); a recipe without one, or a random
    tiny target that exists on no disk, prints why and returns None (never fails the finished run).
    """
    from drafttrain.config import ConfigError
    from drafttrain.export import alternative_label, export_run, formats_for

    name = c.drafter.name
    if not formats_for(name):
        print(f"[drafttrain] serve: no serving-engine format exists for '{name}' drafters (docs/serving.md)", flush=True)
        return None
    if c.target.random_init:
        print("[drafttrain] serve: not exported (the random tiny target exists on no disk; scripts.export "
              "target_path=DIR exports against a saved one)", flush=True)  # fmt: skip
        return None
    try:
        out = export_run(out_dir, output_dir=out_dir / "export", overwrite=True)
    except ConfigError as err:  # ExportError is a ConfigError
        print(f"[drafttrain] serve: not exported: {err}", flush=True)
        return None
    info = json.loads((out / "export_info.json").read_text())
    print(f"[drafttrain] serve it in vLLM ({info['format']} folder {out}): {info['commands'][-1]}", flush=True)
    for alt in info.get("alternatives") or []:  # a K for fewer requests at a time than the line serves
        print(f"[drafttrain] with {alternative_label(alt)} at a time only: {alt['command']}", flush=True)
    return out


def budget_line(final: dict[str, Any], c: TrainConfig) -> str | None:
    """One sentence saying what the host's speed cut, from ``final`` (:func:`run`'s metrics): the
    self-distilled conversations (``data_cut_by_time_budget``, ``data.self_distill_minutes``) and the
    optimizer steps (``stopped_by_time_budget``, ``trainer.max_minutes``). None when neither was cut."""
    parts = []
    data = final.get("data_cut_by_time_budget")
    if data:
        parts.append(f"self-distillation kept {data['conversations']} of {data['of']} conversations (measured "
                     f"{data['generated_tokens_per_s']:.1f} generated tokens/s; data.self_distill_minutes="
                     f"{data['budget_minutes']:g})")  # fmt: skip
    if final.get("stopped_by_time_budget"):
        parts.append(f"training stopped at step {final['step']} of {c.trainer.max_steps} "
                     f"(trainer.max_minutes={c.trainer.max_minutes:g})")  # fmt: skip
    if not parts:
        return None
    return "time budgets cut this run to the host's speed: " + "; ".join(parts)
