"""Training strategies (drafttrain.strategies): the seam, on-policy and mixed runs, Spec-AUF's cut, the
divergences, and the refusals.

- A strategy that makes its own rows trains a tiny drafter through the unchanged loop.
- ``trainer.strategy=on_policy`` / ``mixed`` (with ``loss.cut_at_first_miss``) finish tiny runs of the main
  job's recipe, DFlash and EAGLE-3 with every speculative output equal to plain greedy decoding.
- On the target's own greedy rows, a drafter that drafts the rows gets on-policy labels equal to the offline
  ones (the theory behind ``train/policy_label_agree``); a drafter that drafts something else gets new ones.
- The cut: ``cut_weight=1`` is the offline loss to the bit; ``cut_weight=0`` leaves the slots after a group's
  first miss out.
- On the target's greedy rows, on-policy (greedy drafts) + cut is the offline cut's loss for the parallel, block
  and EAGLE-3 drafters: on-policy changes only what follows a group's first miss.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from drafttrain.config import ConfigError
from drafttrain.drafters import Objective, build_drafter
from drafttrain.drafters.groups import cut_weights, label_own_drafts, parallel_group_slots
from drafttrain.losses import after_first_miss, divergence, forward_kl, js_divergence, reverse_kl
from drafttrain.strategies import STRATEGIES, TrainingStrategy, label_drafts, register_strategy
from helpers import make_batch

TINY = [
    "target=tiny", "data.max_conversations=10", "data.generation.max_new_tokens=12", "data.heldout=2",
    "data.generation.batch_size=8", "trainer.max_steps=3", "trainer.micro_batch_size=2", "trainer.log_every=1",
    "trainer.progress=false", "trainer.num_threads=1", "logging.wandb=false", "trainer.mixed_precision=no",
    "trainer.spec_eval.num_prompts=3", "trainer.spec_eval.max_new_tokens=10", "trainer.spec_eval.latency_prompts=1",
]  # fmt: skip


def _run(tmp_path, overrides):
    from drafttrain.train import compose_config, run

    out = tmp_path / "run"
    c = compose_config(TINY + [f"data.cache_dir={tmp_path / 'data'}", f"output_dir={out}"] + overrides)
    final = run(c)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return final, [r for r in rows if "train/loss" in r]


# -- the seam ---------------------------------------------------------------------------------------
class SyntheticRows(TrainingStrategy):
    """A test strategy: ignores the dataset and makes its own rows (token 7 first, then random ids)."""

    name = "test_synthetic_rows"
    made: list[torch.Tensor] = []

    def make_batch(self, ds, indices, device):
        from drafttrain.data.batches import collate

        g = torch.Generator().manual_seed(len(self.made))
        v = self.target.config.vocab_size
        rows = []
        for _ in indices:
            ids = torch.cat([torch.tensor([7]), torch.randint(3, v, (11,), generator=g)])
            rows.append({"input_ids": ids, "loss_mask": torch.tensor([0, 0] + [1] * 10)})
        batch = collate(rows)
        batch["features"] = self.target.features(batch["input_ids"], feature_layers=self.feature_layers)[:, :-1]
        SyntheticRows.made.append(batch["input_ids"])
        return {k: v.to(device) for k, v in batch.items()}

    def loss(self, drafter, batch, generator, step, micro):
        assert bool((batch["input_ids"][:, 0] == 7).all()), "the loop handed the drafter rows the strategy did not make"
        return drafter(batch, generator)


def test_a_strategy_that_makes_its_own_rows_trains_through_the_unchanged_loop(tmp_path):
    register_strategy(SyntheticRows)
    SyntheticRows.made.clear()
    final, rows = _run(tmp_path, ["+recipe=parallelspec", "trainer.strategy=test_synthetic_rows",
                                  "trainer.spec_eval.num_prompts=0"])  # fmt: skip
    assert final["step"] == 3 and len(rows) == 3
    assert len(SyntheticRows.made) == 3 and all(x.shape == (2, 12) for x in SyntheticRows.made)
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 0 for r in rows)
    assert "test_synthetic_rows" in STRATEGIES
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(type("Other", (TrainingStrategy,), {"name": "offline"}))


def test_an_unknown_strategy_or_an_unsupported_objective_is_refused_before_any_model_loads():
    from drafttrain.train import compose_config

    with pytest.raises(ConfigError, match=r"trainer.strategy must be one of .*got 'on_polcy'"):
        compose_config(["+recipe=parallelspec", "target=tiny", "trainer.strategy=on_polcy"])
    with pytest.raises(ConfigError, match=r"drafter 'medusa' cannot train on its own drafts: Medusa heads read only"):
        compose_config(["+recipe=medusa", "target=tiny", "trainer.strategy=on_policy"])
    with pytest.raises(ConfigError, match=r"loss.divergence=js: drafter 'dflash' does not support it"):
        compose_config(["+recipe=dflash", "target=tiny", "loss.divergence=js"])
    with pytest.raises(ConfigError, match=r"loss.divergence must be one of"):
        compose_config(["+recipe=parallelspec", "target=tiny", "loss.divergence=kl"])
    with pytest.raises(ConfigError, match=r"trainer.on_policy.share must be in \[0, 1\], got 2.0"):
        compose_config(["+recipe=parallelspec", "target=tiny", "trainer.strategy=mixed", "trainer.on_policy.share=2"])


# -- on-policy and mixed runs -------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,extra", [
    ("parallelspec", ["trainer.strategy=on_policy"]),
    ("parallelspec", ["trainer.strategy=mixed", "trainer.on_policy.share=0.5", "trainer.on_policy.temperature=1.0",
                      "loss.cut_at_first_miss=true", "loss.divergence=js"]),
    ("dflash", ["trainer.strategy=on_policy", "loss.cut_at_first_miss=true", "drafter.block_size=4"]),
    ("eagle3", ["trainer.strategy=on_policy", "loss.cut_at_first_miss=true", "drafter.ttt_steps=3"]),
])  # fmt: skip
def test_on_policy_runs_finish_greedy_equal(tmp_path, recipe, extra):
    final, rows = _run(tmp_path, [f"+recipe={recipe}", *extra])
    assert final["step"] == 3 and final["eval/greedy_equal"] is True
    assert sum(r["train/on_policy_micro_batches"] for r in rows) >= 1
    labelled = [r for r in rows if r["train/on_policy_micro_batches"] > 0]
    assert all(r["train/policy_groups"] > 0 and r["train/label_seconds"] > 0 for r in labelled)
    if "trainer.strategy=mixed" in extra:  # share 0.5 over 3 steps x 1 micro-batch: the coin is per micro-batch
        assert all(r["train/label_seconds"] == 0 for r in rows if r["train/on_policy_micro_batches"] == 0)


# -- on-policy labels against the offline ones ---------------------------------------------------------
def _greedy_rows(target, n_rows=2, prompt=4, new=12):
    """Rows that are the target's own greedy continuations (as self-distillation writes them)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, target.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(n_rows)]
    outs = target.generate_greedy(prompts, new, stop_token_id=-1, return_features=False)
    ids = torch.tensor([o["tokens"][: prompt + new] for o in outs])  # prompt + generated ids
    mask = torch.zeros_like(ids)
    mask[:, prompt:] = 1
    return ids, mask, torch.full((n_rows,), ids.shape[1])


def _one_hot_drafter(target):
    v = target.config.vocab_size
    return SimpleNamespace(draft_token_ids=torch.arange(v), t2d=torch.ones(v, dtype=torch.bool),
                           shared=SimpleNamespace(lm_head=target.lm_head))  # fmt: skip


@pytest.mark.parametrize("drafts_match", [True, False])
def test_on_policy_labels_equal_the_offline_ones_where_the_drafts_are_the_targets_own(varied_target, drafts_match):
    from drafttrain import layout as L

    target = varied_target
    ids, mask, lengths = _greedy_rows(target)
    k = 3
    lays = []
    for i in range(ids.shape[0]):
        y = L.item_labels(ids[i], mask[i])
        lays.append(L.build_group_layout(y, L.select_anchors(y, k), k))
    lay = L.collate_layouts(lays, torch.float32)
    row, slots = parallel_group_slots(lay.slot_kind, lay.slot_anchor, lay.num_items, k)
    labels = lay.labels.clone()
    valid = labels != L.IGNORE_INDEX
    v = target.config.vocab_size
    want = labels.clamp_min(0) if drafts_match else (labels.clamp_min(0) + 1) % v  # what the fake drafter drafts
    hidden = torch.nn.functional.one_hot(want, v).float() * 10  # logits_fn = identity: argmax = want
    final = torch.zeros((*labels.shape, target.config.hidden_size))
    scored = valid.clone()
    obj = Objective(labeller=lambda groups: label_drafts(target, ids, lengths, groups))
    sums = label_own_drafts(_one_hot_drafter(target), hidden, row, slots, lay.slot_anchor[row, slots[:, 0]], labels,
                            valid, final, scored, obj, logits_fn=lambda h: h)  # fmt: skip
    assert sums["policy_groups"] > 0
    changed = (labels != lay.labels)[valid]
    if drafts_match:
        # the target's greedy rows: after the same tokens the same labels (positions after a prompt-region
        # draft, which the rows do not hold, may change)
        assert sums["policy_agree_den"] > 0 and sums["policy_agree_num"] == sums["policy_agree_den"]
    else:
        assert sums["policy_agree_den"] == 0  # no labelled position had its offline context
        assert changed.any()  # after other drafts the target says other things


# -- Spec-AUF's cut ----------------------------------------------------------------------------------
def test_after_first_miss_cuts_what_follows_the_first_miss_only():
    t, f = True, False
    correct = torch.tensor([[t, f, t, f], [t, t, t, t], [f, t, t, t]])
    valid = torch.tensor([[t, t, t, t], [t, t, t, t], [f, t, t, t]])
    scored = torch.tensor([[t, t, t, t], [t, t, f, t], [t, t, t, t]])
    assert after_first_miss(correct, valid, scored).tolist() == [
        [f, f, t, t],  # miss at 1: 2 and 3 cut, 1 kept (the position to learn)
        [f, f, f, t],  # position 2's label cannot be drafted: a miss
        [f, f, f, f],  # position 0 has no label: neither hit nor miss
    ]
    w = cut_weights(torch.tensor([0]), torch.tensor([[1, 3, 4]]), torch.tensor([[t, f, t, f, t]]),
                    torch.ones(1, 5, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool), 0.25)  # fmt: skip
    assert w.tolist() == [[1.0, 1.0, 1.0, 0.25, 0.25]]  # group slots 1 (hit), 3 (miss), 4 (after it); 0, 2 in no group


@pytest.mark.parametrize("name,config", [("parallelspec_eagle3", {"num_mask_tokens": 3, "anchor_ratio": 1.0}),
                                         ("eagle3", {"ttt_steps": 4}),
                                         ("dflash", {"block_size": 4, "num_layers": 1})])  # fmt: skip
def test_cut_weight_one_is_the_offline_loss_and_zero_drops_the_slots_after_a_miss(varied_target, name, config):
    torch.manual_seed(0)
    d = build_drafter(name, config, varied_target).train()
    batch = make_batch(varied_target)
    batch["features"] = varied_target.features(batch["input_ids"], feature_layers=d.feature_layers)[:, :-1]
    off = d.training_loss(batch, torch.Generator().manual_seed(1))
    one = d.training_loss(batch, torch.Generator().manual_seed(1), Objective(cut_at_first_miss=True, cut_weight=1.0))
    zero = d.training_loss(batch, torch.Generator().manual_seed(1), Objective(cut_at_first_miss=True, cut_weight=0.0))
    assert torch.equal(off.loss, one.loss)
    key = "ce_count" if name == "dflash" else "kl_count"  # per-position (weighted) slot counts
    assert zero.sums[key][0] == off.sums[key][0]  # nothing precedes position 0
    assert (zero.sums[key][1:] <= off.sums[key][1:]).all()
    assert (zero.sums[key][1:] < off.sums[key][1:]).any()  # an untrained drafter misses
    assert zero.loss != off.loss


# -- divergences -------------------------------------------------------------------------------------
def test_divergences():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    for fn in (forward_kl, reverse_kl, js_divergence):
        assert torch.allclose(fn(a, a), torch.zeros(5), atol=1e-6)
        assert (fn(a, b) > 0).all()
    assert torch.allclose(reverse_kl(a, b), forward_kl(b, a))  # KL(q||p) with the roles swapped
    assert (js_divergence(a * 50, b * 50) <= math.log(2) + 1e-5).all()
    assert torch.equal(divergence(a, b, "js"), js_divergence(a, b))
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence(a, b, "kl")


# -- why on-policy adds nothing under greedy verification of greedy rows ---------------------------
@pytest.mark.parametrize("name,config", [("parallelspec_eagle3", {"num_mask_tokens": 3, "anchor_ratio": 1.0}),
                                         ("dflash", {"block_size": 4, "num_layers": 1}),
                                         ("eagle3", {"ttt_steps": 4})])  # fmt: skip
def test_on_policy_with_the_cut_is_the_offline_cut_on_the_targets_greedy_rows(varied_target, name, config):
    """On the target's own greedy rows (what self-distillation writes) a group's drafts before its first miss ARE
    the row's tokens, so the drafter's inputs and the target's labels there are the offline ones, for a drafter fed
    [MASK] tokens (parallel, block) and for EAGLE-3, which feeds its own drafts back, alike. On-policy changes only
    what follows the first miss, which greedy verification never accepts, and ``cut_weight=0`` drops exactly
    that: on-policy + cut is the offline cut's loss. Without the cut the relabelled slots change the loss."""
    target = varied_target
    torch.manual_seed(0)
    d = build_drafter(name, config, target).train()
    ids, mask, lengths = _greedy_rows(target, n_rows=3, prompt=1, new=20)  # every label is the target's argmax
    batch = {"input_ids": ids, "loss_mask": mask, "lengths": lengths,
             "features": target.features(ids, feature_layers=d.feature_layers)[:, :-1]}  # fmt: skip
    policy = dict(labeller=lambda groups: label_drafts(target, ids, lengths, groups), groups_per_row=0)

    def loss(**kw):
        return d.training_loss(batch, torch.Generator().manual_seed(1), Objective(**kw))

    off_cut, pol_cut = loss(cut_at_first_miss=True), loss(cut_at_first_miss=True, **policy)
    assert pol_cut.sums["policy_groups"] > 0
    assert torch.allclose(pol_cut.loss, off_cut.loss, rtol=1e-4, atol=1e-5)
    off, pol = loss(), loss(**policy)
    assert not torch.allclose(pol.loss, off.loss, rtol=1e-3)  # an untrained drafter misses: the labels after differ


def test_what_a_strategy_needs_is_its_declaration():
    """Validation reads the strategies' declarations (``requires``), not their names: a strategy registered
    elsewhere that needs an objective no drafter of the run has is refused the same way, before any model loads."""
    from drafttrain.cliconfig import ConfigError
    from drafttrain.train import compose_config
    from drafttrain.strategies import STRATEGIES, OfflineStrategy, register_strategy

    class NeedsCut(OfflineStrategy):
        name = "test_needs_on_policy"
        requires = {"on_policy": "cannot be trained this way"}

    register_strategy(NeedsCut)
    try:
        with pytest.raises(ConfigError, match=r"trainer.strategy=test_needs_on_policy: drafter 'medusa' cannot be trained this way"):
            compose_config(["+recipe=medusa", "target=tiny", "trainer.strategy=test_needs_on_policy"])
        c = compose_config(["+recipe=eagle3", "target=tiny", "trainer.strategy=test_needs_on_policy"])  # eagle3 has it
        assert c.trainer.strategy == "test_needs_on_policy"
    finally:
        STRATEGIES.pop("test_needs_on_policy", None)


def test_a_strategy_defined_elsewhere_brings_its_own_config_section(tmp_path):
    """A strategy's keys are its own dataclass (``config``, ``config_section``): once registered, validation
    reads ``trainer.<section>.*`` against it (defaults, unknown keys, value ranges), the strategy reads them as
    ``options`` and the run's saved config holds them; nothing in drafttrain.config names the strategy."""
    from dataclasses import asdict, dataclass

    from drafttrain.cliconfig import ConfigError
    from drafttrain.config import GE1, TrainerConfig
    from drafttrain.strategies import OfflineStrategy, build_strategy, strategy_sections
    from drafttrain.train import compose_config
    from drafttrain.validation import train_schema

    @dataclass
    class RepeatConfig:
        times: int = 2  # each micro-batch's loss counted this many times
        numeric_ranges = dict(times=GE1)

    class Repeat(OfflineStrategy):
        name = "test_repeat"
        config, config_section = RepeatConfig, "test_repeat"

    assert "test_repeat" not in {f for f in TrainerConfig.__dataclass_fields__}
    register_strategy(Repeat)
    try:
        assert strategy_sections()["test_repeat"] is RepeatConfig and "test_repeat" in train_schema()().trainer.__dict__
        c = compose_config(["+recipe=parallelspec", "target=tiny", "trainer.strategy=test_repeat"])
        assert c.trainer.test_repeat == RepeatConfig() and asdict(c)["trainer"]["test_repeat"] == {"times": 2}
        c = compose_config(["+recipe=parallelspec", "target=tiny", "trainer.strategy=test_repeat",
                            "+trainer.test_repeat.times=5"])  # fmt: skip
        assert build_strategy(c, None, [], None).options.times == 5
        with pytest.raises(ConfigError, match=r"trainer.test_repeat.times must be >= 1, got 0"):
            compose_config(["+recipe=parallelspec", "target=tiny", "+trainer.test_repeat.times=0"])
        with pytest.raises(ConfigError, match=r"trainer.test_repeat.tims"):
            compose_config(["+recipe=parallelspec", "target=tiny", "+trainer.test_repeat.tims=3"])

        class Clash(OfflineStrategy):  # the same section with another class: refused at registration
            name = "test_clash"
            config, config_section = TrainerConfig, "test_repeat"

        with pytest.raises(ValueError, match=r"trainer.test_repeat is declared by another strategy"):
            register_strategy(Clash)

        class Half(OfflineStrategy):
            name = "test_half"
            config_section = "x"

        with pytest.raises(ValueError, match=r"both or neither"):
            register_strategy(Half)
    finally:
        for n in ("test_repeat", "test_clash", "test_half"):
            STRATEGIES.pop(n, None)
    with pytest.raises(ConfigError, match=r"test_repeat"):  # unregistered: its section is an unknown key again
        compose_config(["+recipe=parallelspec", "target=tiny", "+trainer.test_repeat.times=5"])


class CountingRows(TrainingStrategy):
    """A test strategy with state of its own: micro-batches seen, kept across a resume through the checkpoint."""

    name = "test_counting_rows"
    restored: list[dict] = []

    def __init__(self, c, target, feature_layers):
        super().__init__(c, target, feature_layers)
        self.seen = 0

    def loss(self, drafter, batch, generator, step, micro):
        self.seen += 1
        return drafter(batch, generator)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        CountingRows.restored.append(dict(state))
        self.seen = int(state.get("seen", 0))


def test_a_strategys_own_state_survives_a_resume(tmp_path):
    register_strategy(CountingRows)
    CountingRows.restored.clear()
    base = ["+recipe=parallelspec", "trainer.strategy=test_counting_rows", "trainer.spec_eval.num_prompts=0",
            "trainer.save_every=2", "trainer.export=false"]  # fmt: skip
    _run(tmp_path, base + ["trainer.max_steps=2"])
    meta = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_0000002/meta.json")).read_text())
    assert meta["strategy_state"]["seen"] >= 2  # one loss per micro-batch, 2 steps
    _run(tmp_path, base + ["trainer.max_steps=3", "resume=true"])
    assert CountingRows.restored == [meta["strategy_state"]]
