"""The verifier with a compiled target forward (``SpecEngine(compile_target=True)``).

``torch.compile`` with freezing must not change what is decoded: greedy plain and speculative (tree)
decoding through the compiled backbone equal Hugging Face ``generate`` on the plain model token for token,
and one compiled graph (plus dynamo's one-token specialisation) serves every step, prompt length and
cache capacity: a recompile per step would cost minutes each on the real target.
"""

from __future__ import annotations

import copy

import pytest
import torch

from drafttrain.target import fastlinear
from drafttrain.target import Target


@pytest.fixture(scope="module")
def varied(tiny_target):
    """A tiny target whose 2-D weights are redrawn (std 0.3; greedy output changes at every step), packed as
    the engine's default is."""
    model = copy.deepcopy(tiny_target.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    if fastlinear.available():
        fastlinear.pack_linears(model)  # PackedLinear must fall back to F.linear inside the compiled graph
    return Target(model, tiny_target.tokenizer)


def _hf_greedy(target: Target, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                min_new_tokens=new, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt):].tolist()


def test_compiled_engine_equals_hf_generate_without_recompiling(varied, make_drafter):
    from torch._dynamo.utils import counters

    from drafttrain.verify import ParallelSpecProposer, PlainProposer, SpecEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 9)]
    new = 20
    ref = [_hf_greedy(varied, p, new) for p in prompts]
    assert all(len(set(r)) > 3 for r in ref)  # the varied target changes token: an off-by-one would show

    def engine(proposer):  # capacity 8: the cache grows during the run, which must not recompile
        return SpecEngine(varied, proposer, batch_size=1, max_new_tokens=new, stop_token_ids=-1, initial_capacity=8,
                          compile_target=True)  # fmt: skip

    plain = engine(PlainProposer())
    plain.warm_up_compiled()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    spec_prop = ParallelSpecProposer(make_drafter(seed=1).eval(), widths=[2, 2, 1], budget=5)
    runs = [plain.run(prompts), engine(spec_prop).run(prompts)]
    assert counters["stats"]["unique_graphs"] == graphs, "a step, prompt length or cache size recompiled"
    for run in runs:
        assert [r.tokens for r in run.results] == ref
    assert runs[1].stats.tree_nodes > 0  # trees were verified, not only plain steps
    assert plain.cache.capacity > 8  # the cache did grow


def test_compile_target_needs_batch_one(varied):
    from drafttrain.verify import PlainProposer, SpecEngine

    with pytest.raises(ValueError, match="batch_size=1"):
        SpecEngine(varied, PlainProposer(), batch_size=2, compile_target=True)
    with pytest.raises(RuntimeError, match="compile_target=True"):
        SpecEngine(varied, PlainProposer()).warm_up_compiled()


def test_spec_eval_latency_runs_compiled(varied, make_drafter):
    """drafter_eval(compile_target=True) at batch 1 (the main job's eval/speedup_b1 runs with
    trainer.spec_eval.compile_target=true): compiled before timing, the same outputs and τ as eager."""
    from drafttrain.eval.in_training import drafter_eval

    drafter = make_drafter(seed=2).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 12)]
    kw = dict(batch_size=1, progress=False, tree_widths=[2, 1, 1], tree_budget=4, plan=True, interleave="step")
    eager = drafter_eval(varied, drafter, prompts, 12, **kw)
    comp = drafter_eval(varied, drafter, prompts, 12, compile_target=True, **kw)
    assert comp["greedy_equal"] and eager["greedy_equal"]
    assert [o["tokens"] for o in comp["outputs"]] == [o["tokens"] for o in eager["outputs"]]
    assert comp["tau"] == eager["tau"]
    assert comp["compile_seconds"] > 0 and eager["compile_seconds"] == 0
    with pytest.raises(ValueError, match="batch_size=1"):
        drafter_eval(varied, drafter, prompts, 4, compile_target=True, batch_size=2, progress=False)



def test_warm_up_compiled_for_other_feature_layers(varied):
    """warm_up_compiled(feature_layers=...) compiles the graphs another proposer's layer set needs (every hidden
    state instead of the final one) from any engine, restores the engine's own layers, and rejects a layer the
    target does not have before touching the cache."""
    from torch._dynamo.utils import counters

    from drafttrain.verify import PlainProposer, SpecEngine

    own = Target(copy.deepcopy(varied.model), varied.tokenizer)  # its own compiled backbone: no graph shared
    top = own.num_hidden_layers
    eng = SpecEngine(own, PlainProposer(), batch_size=1, compile_target=True)
    eng.warm_up_compiled()
    graphs = counters["stats"]["unique_graphs"]
    eng.warm_up_compiled()
    assert counters["stats"]["unique_graphs"] == graphs  # compiled once
    eng.warm_up_compiled(feature_layers=[1, top])
    assert counters["stats"]["unique_graphs"] > graphs  # the all-hidden-states graphs are new ones
    assert eng.feature_layers == (top,)  # the engine's own layers again
    cache = eng.cache
    with pytest.raises(ValueError):
        eng.warm_up_compiled(feature_layers=[top + 5])
    assert eng.cache is cache and eng.feature_layers == (top,)
