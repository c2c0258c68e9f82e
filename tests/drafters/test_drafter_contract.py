"""The drafter contract (drafttrain/drafters/base.py: ``DrafterSpec``) is all a new drafter needs.

Why: a drafter should be one module + its config, with no consumer dispatching on drafter
names or probing attributes. A toy drafter defined *in this file only* (the library does not know it)
declares that it reads two target layers, (1, 2) of the 2-layer tiny target; it is registered, trained
3 steps through the real training loop (``drafttrain.train.run`` on a Hydra-composed config, whose
``drafter`` section is validated against the toy's own keys), reloaded from its checkpoint and decoded
with through the batched engine (batch 2, unpadded mode). The output must equal plain greedy decoding
token for token, and at every step the toy must have been handed exactly the declared layers'
hidden states (compared with Hugging Face's ``output_hidden_states``), in training and in decoding.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from drafttrain import layout as L
from drafttrain.drafters import Drafter, DrafterSpec, LossOutput, SharedTargetModules, register_drafter
from drafttrain.metrics import group_acceptance_sums

D = 64  # the tiny target's hidden size (conf/target/tiny.yaml)
LAYERS = (1, 2)  # the hidden state entering decoder layer 1, and the final post-norm state (L = 2)


class TwoLayerToyDrafter(Drafter):
    """Parallel toy drafter on two target layers: K linear heads on [f^(1)_i ; f^(2)_i ; e(x_{i+1})], each
    through the target's frozen final norm + LM head (head k guesses x_{i+k+2}). It records what it is handed.

    Config keys (``defaults``): ``num_heads`` K, ``init_scale`` (std of the heads' init).
    """

    name = "toy_two_layer"
    spec = DrafterSpec(drafting="parallel", feature_layers=LAYERS, step_input="items", batched=False)
    defaults: dict[str, Any] = {"num_heads": 3, "init_scale": 0.02}
    seen_batches: list[dict[str, torch.Tensor]] = []  # training batches handed to training_loss
    seen_items: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (cache, next_ids [n], features [n, F]) per propose

    def __init__(self, config: dict[str, Any], shared: SharedTargetModules, init_weights: bool = True):
        super().__init__(config, shared)
        d = shared.model_config.hidden_size
        self.heads = nn.Linear(self.feature_dim + d, int(self.config["num_heads"]) * d)  # [F + d] -> [K * d]
        if init_weights:
            nn.init.normal_(self.heads.weight, std=float(self.config["init_scale"]))
            nn.init.zeros_(self.heads.bias)
        self._init_draft_vocab(0)
        self.to(shared.embed_tokens.weight.device)

    @property
    def draft_depth(self) -> int:
        return int(self.config["num_heads"])

    def head_logits(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[..., F] features + [...] next ids -> [..., K, v] float32."""
        x = torch.cat([features.to(self.heads.weight.dtype), self.shared.embed_tokens(next_ids)], dim=-1)
        h = self.heads(x).unflatten(-1, (self.draft_depth, -1))  # [..., K, d]
        return self.vocab_logits(self.shared.final_norm(h))

    def training_loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> LossOutput:
        type(self).seen_batches.append({k: v.detach().clone() for k, v in batch.items()})
        ids, feats = batch["input_ids"], batch["features"]  # [b, L], [b, L-1, F]
        labels = L.batch_item_labels(ids, batch["loss_mask"], batch["lengths"])  # [b, t]: y_i = x_{i+2}
        group = L.shifted_labels(labels, self.draft_depth)  # [b, t, K]
        logits = self.head_logits(ids[:, 1:], feats)  # [b, t, K, v]
        valid = group != L.IGNORE_INDEX
        loss = nn.functional.cross_entropy(logits[valid], group[valid]) if valid.any() else logits.sum() * 0
        rows = valid.any(-1)  # positions with a labelled head: acc_k / tau_sim as for the library's drafters
        sums = group_acceptance_sums((logits.argmax(-1) == group)[rows], valid[rows])
        return LossOutput(loss=loss, sums=sums, num_tokens=int(rows.sum()))

    @torch.no_grad()
    def propose(self, next_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        type(self).seen_items.append((cache, next_ids[0].clone(), features[0].clone()))
        return self.head_logits(next_ids[:, -1], features[:, -1])  # [1, K, v]


@pytest.fixture(autouse=True)
def registered():
    """The toy is registered for this module's tests only (other test modules enumerate the library's drafters)."""
    from drafttrain.drafters import DRAFTERS

    register_drafter(TwoLayerToyDrafter)
    yield
    DRAFTERS.pop(TwoLayerToyDrafter.name, None)


def test_toy_drafter_declaration():
    assert TwoLayerToyDrafter.layers_for({}, 2) == (1, 2)
    with pytest.raises(ValueError, match="outside"):
        TwoLayerToyDrafter.layers_for({}, 0)  # a target too shallow for layer 1
    with pytest.raises(ValueError, match="already registered"):
        register_drafter(type("Other", (TwoLayerToyDrafter,), {"name": "toy_two_layer"}))
    with pytest.raises(ValueError, match="drafting"):
        DrafterSpec(drafting="sideways")


def _hidden_states(target, tokens: list[int]) -> torch.Tensor:
    """Hugging Face's own output_hidden_states[1] ++ [2] over ``tokens``: [len, 2d]."""
    hs = target.model.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in LAYERS], dim=-1)[0]


def test_toy_drafter_trains_through_the_loop_and_decodes_greedy_equal(tmp_path, varied_target):
    from drafttrain.config import ConfigError
    from drafttrain.validation import validate
    from drafttrain.train import compose_config, run
    from drafttrain.verify import PlainProposer, SpecEngine, proposer_for

    # -- train 3 steps through the real loop on a composed config -----------------------------------
    out = tmp_path / "run"
    overrides = [
        "target=tiny", "~drafter", "+drafter.name=toy_two_layer", "+drafter.num_heads=2",  # the toy's own keys
        "data.max_conversations=10", "data.generation.max_new_tokens=8", "data.heldout=2", "data.generation.batch_size=8",
        f"data.cache_dir={tmp_path / 'data'}", f"output_dir={out}", "trainer.max_steps=3", "trainer.micro_batch_size=2",
        "trainer.log_every=1", "trainer.progress=false", "trainer.spec_eval.num_prompts=0", "trainer.num_threads=1",
        "logging.wandb=false",
        # fp32: auto is bf16 on an AVX-512-BF16 CPU, and an Accelerator made earlier in this pytest process
        # (fp32) cannot be re-made with another precision
        "trainer.mixed_precision=no",
    ]  # fmt: skip
    c = compose_config(overrides)
    assert c.drafter.name == "toy_two_layer" and c.drafter.num_heads == 2 and c.drafter.init_scale == 0.02
    with pytest.raises(ConfigError, match=r"drafter\.num_mask_tokens"):  # a key the toy does not read
        validate({"drafter": {"name": "toy_two_layer", "num_mask_tokens": 3}})
    TwoLayerToyDrafter.seen_batches.clear()
    final = run(c)
    assert final["step"] == 3
    losses = [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert len(losses) == 3 and all(x == x and x > 0 for x in losses)
    # every training batch carried the declared layers' states (self-distilled, stored fp16): [b, L-1, 2d]
    from drafttrain.config import TargetConfig
    from drafttrain.target import load_target

    tiny = load_target(TargetConfig(random_init=True))  # the run's target (deterministic from its seed)
    assert len(TwoLayerToyDrafter.seen_batches) >= 3
    for batch in TwoLayerToyDrafter.seen_batches:
        assert batch["features"].shape[-1] == 2 * D
        for i, n in enumerate(batch["lengths"].tolist()):
            want = _hidden_states(tiny, batch["input_ids"][i, :n].tolist())[:-1]  # f_0..f_{n-2}
            torch.testing.assert_close(batch["features"][i, : n - 1], want, atol=2e-2, rtol=2e-3)

    # -- reload by name and decode through the batched engine ----------------------------------------
    drafter = Drafter.from_pretrained(out / "drafter", varied_target)  # registered name -> the toy class
    assert isinstance(drafter, TwoLayerToyDrafter) and drafter.feature_layers == (1, 2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 9, 7)]
    new = 12
    plain = SpecEngine(varied_target, PlainProposer(), batch_size=2, max_new_tokens=new, stop_token_ids=[-1]).run(prompts)
    TwoLayerToyDrafter.seen_items.clear()
    prop = proposer_for(drafter)
    assert prop.name == "toy_two_layer" and prop.feature_layers == (1, 2)
    spec = SpecEngine(varied_target, prop, batch_size=2, max_new_tokens=new, mode="unpadded",
                      stop_token_ids=[-1]).run(prompts)  # fmt: skip
    assert [r.tokens for r in spec.results] == [r.tokens for r in plain.results]
    assert spec.stats.seq_steps > 0 and spec.stats.tree_nodes > 0

    # the items it was handed per sequence (one drafter cache each) are x_1.. and f_0.. of layers (1, 2)
    per_seq: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
    caches = {}
    for cache, ids, feats in TwoLayerToyDrafter.seen_items:
        caches[id(cache)] = cache  # keep it alive: ids stay distinct
        toks, fs = per_seq.setdefault(id(cache), ([], []))
        toks += ids.tolist()
        fs.append(feats)
    assert len(per_seq) == len(prompts)
    for toks, fs in per_seq.values():
        p = next(p for p in prompts if p[1:] == toks[: len(p) - 1])
        full = p + plain.results[prompts.index(p)].tokens
        assert toks == full[1 : len(toks) + 1]
        got = torch.cat(fs)  # [N, 2d]: f_0..f_{N-1}
        assert got.shape == (len(toks), 2 * D)
        torch.testing.assert_close(got, _hidden_states(varied_target, full)[: len(toks)], atol=1e-4, rtol=1e-4)
