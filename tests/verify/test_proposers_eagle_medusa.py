"""The EAGLE and Medusa proposers in the batched verifier (drafttrain.verify.proposers), on tiny targets.

- Greedy output equals plain greedy decoding for Medusa (chain, Medusa's choice-list tree) and EAGLE
  (chain, EAGLE's default tree, a widths tree) in every engine mode, for prompts of different lengths
  finishing at different steps; on the tiny target as loaded (a drafter copied from its last layer
  accepts most drafts, so accepted keys/values move) and on the "varied" target (drafts rejected).
- EAGLE's chain through the engine takes exactly the steps of the single-sequence reference loop
  that calls the drafter's own ``propose`` (same tokens, same accepted lengths).
- EAGLE's tree is autoregressive: every node's children are the top-m of (greedy) or draws from
  (sampling) the drafter's distribution *conditioned on the node's path*, recomputed here from
  scratch; the drafter cache is back to the committed items after drafting.
- ``proposer_for`` picks each drafter's own proposer and depth (the bug it fixes: Medusa/EAGLE drafters
  used to be verified at depth 1 only through the batched path).
"""

from __future__ import annotations


import pytest
import torch

from reference_decoding import speculative_greedy
from drafttrain.verify import (
    EAGLE_DEFAULT_CHOICES,
    MEDUSA_DEFAULT_CHOICES,
    MODES,
    EagleProposer,
    ParallelSpecProposer,
    PlainProposer,
    SamplingParams,
    SpecEngine,
    proposer_for,
)

PROMPT_LENGTHS = (3, 11, 30, 7, 19)
NEW = 20
ENGINES = [(m, "auto") for m in MODES] + [("unpadded", "always")]


def _drafter(name: str, target, seed: int = 0, **config):
    """A drafter of ``name`` for ``target`` whose layer (EAGLE) is the target's last layer."""
    from drafttrain.drafters import build_drafter

    torch.manual_seed(seed)
    base = {"eagle": {"draft_depth": 4}, "medusa": {"num_heads": 3}}[name]
    return build_drafter(name, {**base, **config}, target).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _reference(target, prompts, stops, n=NEW):
    out = []
    for p in prompts:
        cont = target.generate_greedy([p], n, stop_token_id=-1, return_features=False)[0]["tokens"][len(p) :]
        cut = next((i for i, t in enumerate(cont) if t in stops), None)
        out.append(cont if cut is None else cont[: cut + 1])
    return out


def _stops(target, prompts):
    """Stop ids that end two prompts early, at different steps."""
    a = target.generate_greedy([prompts[0]], NEW, stop_token_id=-1, return_features=False)[0]["tokens"][len(prompts[0]) :]
    b = target.generate_greedy([prompts[3]], NEW, stop_token_id=-1, return_features=False)[0]["tokens"][len(prompts[3]) :]
    return sorted({a[5], b[12]})


def _proposers(target):
    eagle = _drafter("eagle", target)
    medusa = _drafter("medusa", target)
    return {
        "medusa-chain": lambda: proposer_for(medusa),
        "medusa-tree": lambda: proposer_for(medusa, choices=MEDUSA_DEFAULT_CHOICES),
        "eagle-chain": lambda: proposer_for(eagle),
        "eagle-tree": lambda: proposer_for(eagle, choices=EAGLE_DEFAULT_CHOICES),
        "eagle-widths": lambda: proposer_for(eagle, widths=[3, 2, 1], budget=7),
    }


@pytest.mark.parametrize("which", ["tiny", "varied"])
@pytest.mark.parametrize("mode, pack", ENGINES)
def test_greedy_equals_plain(tiny_target, varied_target, prompts, which, mode, pack):
    target = tiny_target if which == "tiny" else varied_target
    stops = _stops(target, prompts)
    ref = _reference(target, prompts, stops)
    taus = {}
    for name, make in _proposers(target).items():
        run = SpecEngine(target, make(), batch_size=3, max_new_tokens=NEW, mode=mode, stop_token_ids=stops,
                         pack_inputs=pack).run(prompts)  # fmt: skip
        assert [r.tokens for r in run.results] == ref, name
        taus[name] = run.stats.tau
    if which == "tiny":  # drafts are really accepted (keys/values of accepted tree nodes move)
        assert taus["eagle-chain"] > 1.5 and taus["eagle-tree"] >= taus["eagle-chain"] - 1e-9


def test_proposer_for_picks_depth_and_class(tiny_target):
    eagle, medusa = _drafter("eagle", tiny_target), _drafter("medusa", tiny_target)
    pe, pm = proposer_for(eagle), proposer_for(medusa)
    assert isinstance(pe, EagleProposer) and pe.template.n == 4 and pe.name == "eagle"
    assert isinstance(pm, ParallelSpecProposer) and pm.widths == [1, 1, 1] and pm.name == "medusa"
    pm = proposer_for(medusa, choices=MEDUSA_DEFAULT_CHOICES)
    assert pm.widths == [10, 10, 10] and pm.budget == len(MEDUSA_DEFAULT_CHOICES)  # depth capped at 3 heads
    pe = proposer_for(eagle, widths=[3, 2], budget=7)
    assert pe.template.n == 7 and [len(r) for r in pe.template.ranks] == [1, 1, 1, 2, 2, 2, 2]


def test_eagle_chain_matches_single_sequence_reference(tiny_target, prompts):
    """The engine with EAGLE's chain takes exactly the steps of speculative_greedy (the drafter's propose)."""
    drafter = _drafter("eagle", tiny_target)
    for p in prompts[:3]:
        ref = speculative_greedy(tiny_target, drafter, p, NEW, stop=-1)
        run = SpecEngine(tiny_target, EagleProposer(drafter), batch_size=1, max_new_tokens=NEW,
                         stop_token_ids=[-1]).run([p])  # fmt: skip
        assert run.results[0].tokens == ref.tokens
        assert run.results[0].accept_lengths == ref.accept_lengths[: len(run.results[0].accept_lengths)]
        assert max(ref.accept_lengths) > 0


def _fresh_path_probs(drafter, items_ids, items_feats, path_tokens, sampling):
    """The drafter's distribution after the committed items and then the path's tokens fed one by one
    (EAGLE's chain drafting with forced tokens), from an empty cache: [v] processed probabilities."""
    from transformers import DynamicCache

    from drafttrain import layout as L
    from drafttrain.verify.acceptance import process_logits

    cache = DynamicCache()
    n = items_ids.numel()
    pos, mask = L.inference_layout(n, 0, dtype=torch.float32)
    logits, f = drafter.draft_step(items_ids[None], items_feats[None], pos, mask, cache)
    lg, f = logits[:, -1], f[:, -1:]
    for tok in path_tokens:
        pos, mask = L.inference_layout(1, 0, dtype=torch.float32, past=cache.get_seq_length())
        logits, f = drafter.draft_step(torch.tensor([[tok]]), f, pos, mask, cache)
        lg = logits[:, -1]
    full = drafter.full_vocab_logits(lg)[0]
    return torch.softmax(full.float(), -1) if sampling.greedy else process_logits(full, sampling)


@pytest.mark.parametrize("sampling, dynamic", [(SamplingParams(), False), (SamplingParams(temperature=0.9), False),
                                               (SamplingParams(), True)], ids=["greedy", "T0.9", "dynamic"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-seq"])
def test_eagle_tree_children_come_from_their_own_path(varied_target, prompts, sampling, dynamic, batched):
    target = varied_target
    drafter = _drafter("eagle", target, seed=3)
    if dynamic:  # EAGLE-2: 5 depths, 3 nodes expanded per depth, 3/2/2/2/2 children, the 12 best kept
        prop = EagleProposer(drafter, widths=[3, 2, 2, 2, 2], expand=3, budget=12, batched=batched)
    else:
        prop = EagleProposer(drafter, choices=EAGLE_DEFAULT_CHOICES, batched=batched)
    p = prompts[1]
    full = target.generate_greedy([p], 6, stop_token_id=-1, return_features=False)[0]["tokens"]
    feats = target.features(torch.tensor([full]))[0]  # f_0 .. f_{len-1}
    # start with the prompt, then commit two accepted tokens + bonus: 3 items more
    prop.start(0, p, feats[: len(p)], full[len(p)])
    g = torch.Generator().manual_seed(0)
    prop.draft([0], sampling, g)
    prop.commit(0, full[len(p) + 1 : len(p) + 4], feats[len(p) : len(p) + 3])
    tree = prop.draft([0], sampling, g)[0]
    committed = len(p) + 3
    assert prop.committed_length(0) == committed  # speculative items never committed
    assert tree.n == (12 if dynamic else len(EAGLE_DEFAULT_CHOICES))
    assert tree.max_depth == 5 or dynamic
    items_ids = torch.tensor(full[1 : committed + 1])
    items_feats = feats[:committed]
    kids = tree.children()
    tokens = tree.tokens.tolist()
    for node in [-1] + list(range(tree.n)):
        children = kids[node + 1]
        if not children:
            continue
        path = [tokens[i] for i in tree.path_to(node)] if node >= 0 else []
        probs = _fresh_path_probs(drafter, items_ids, items_feats, path, sampling)
        if sampling.greedy:  # (dynamic: the kept children are the most confident ones, a top-m prefix)
            top = torch.topk(probs, len(children)).indices.tolist()
            assert [tokens[c] for c in children] == top, f"node {node}"
        else:
            row = tree.draft_probs[tree.dist_index[children[0]]]
            torch.testing.assert_close(row, probs, atol=2e-5, rtol=1e-4)
            assert all(row[tokens[c]] > 0 for c in children)
            assert len({tokens[c] for c in children}) == len(children)  # without replacement
    if dynamic:  # the kept nodes are the 12 most confident: every kept node beats every dropped child
        values = {}
        for i in range(tree.n):
            path = [tokens[j] for j in tree.path_to(i)]
            par = tree.parents[i].item()
            pr = _fresh_path_probs(drafter, items_ids, items_feats, path[:-1], sampling)[path[-1]].item()
            values[i] = pr * (values[par] if par >= 0 else 1.0)
        # the tree carries them as its scores (path confidences: what the planner prices nodes by)
        torch.testing.assert_close(tree.scores, torch.tensor([values[i] for i in range(tree.n)]), atol=2e-5, rtol=1e-4)
        widths = [3, 2, 2, 2, 2]
        checked = 0
        for i in range(tree.n):  # an expanded node (it kept a child) whose next child was dropped by reranking
            m, dep = len(kids[i + 1]), int(tree.depth()[i])
            if 0 < m < widths[dep] if dep < 5 else False:
                path = [tokens[j] for j in tree.path_to(i)]
                probs = _fresh_path_probs(drafter, items_ids, items_feats, path, sampling)
                dropped = torch.topk(probs, m + 1).values[-1].item() * values[i]
                assert dropped <= min(values.values()) + 1e-6
                checked += 1
        first = [c for c in kids[0]]
        if len(first) < 3:  # a dropped depth-1 candidate is worth less than every kept node too
            p0 = _fresh_path_probs(drafter, items_ids, items_feats, [], sampling)
            assert torch.topk(p0, len(first) + 1).values[-1].item() <= min(values.values()) + 1e-6
    if not sampling.greedy:  # children of different depth-1 nodes use different rows (context-dependent)
        rows = {int(tree.dist_index[c]) for c in range(tree.n) if tree.depth()[c] == 2}
        assert len(rows) == 4


def test_eagle_sampling_through_engine_is_reproducible(varied_target, prompts):
    drafter = _drafter("eagle", varied_target, seed=5)
    outs = []
    for mode in MODES:
        run = SpecEngine(varied_target, EagleProposer(drafter, choices=EAGLE_DEFAULT_CHOICES), batch_size=3,
                         max_new_tokens=8, mode=mode, sampling=SamplingParams(temperature=0.8), seed=3).run(prompts)
        outs.append([r.tokens for r in run.results])
    assert outs[0] == outs[1] == outs[2]
    plain = SpecEngine(varied_target, PlainProposer(), batch_size=3, max_new_tokens=8, mode="unpadded",
                       sampling=SamplingParams(temperature=0.8), seed=3).run(prompts)  # fmt: skip
    assert all(len(r.tokens) == 8 for r in plain.results)


def test_batched_spec_eval_uses_the_drafters_depth(tiny_target, prompts):
    """drafter_eval with a Medusa or EAGLE drafter drafts its full chain (not depth 1)."""
    from drafttrain.eval.in_training import drafter_eval

    for name in ("medusa", "eagle"):
        drafter = _drafter(name, tiny_target)
        r = drafter_eval(tiny_target, drafter, prompts[:3], 16, batch_size=3, progress=False)
        assert r["greedy_equal"]
        assert max(int(k) for k in r["accept_hist"]) > 1, name  # more than one draft accepted in some step


def test_mtad_eagle_beams_use_the_drafters_joint_likelihood(varied_target, prompts):
    """MTAD on an EAGLE drafter: each draft token's log q is the drafter's conditional given the beam's own
    earlier tokens (recomputed from scratch), one beam reproduces EAGLE's greedy chain, the drafter cache
    is back to the committed items, and through the engine τ >= 1 accepts nothing (plain greedy output)."""
    from transformers import DynamicCache

    from drafttrain.verify.methods.mtad import MTADEagleProposer

    target = varied_target
    drafter = _drafter("eagle", target, seed=2)
    p = prompts[2]
    full = target.generate_greedy([p], 2, stop_token_id=-1, return_features=False)[0]["tokens"]
    feats = target.features(torch.tensor([full]))[0]
    items_ids, items_feats = torch.tensor(full[1 : len(p) + 1]), feats[: len(p)]
    for beams in (1, 3):
        prop = MTADEagleProposer(drafter, num_beams=beams, num_steps=4)
        prop.start(0, p, feats[: len(p)], full[len(p)])
        tree = prop.draft([0])[0]
        assert prop._state[0]["cache"].get_seq_length() == len(p)
        toks = tree.tokens.tolist()
        lp = prop._draft_lp[0]
        for i in range(4):
            probs = _fresh_path_probs(drafter, items_ids, items_feats, toks[:i], SamplingParams())
            torch.testing.assert_close(lp[i], probs[toks[i]].log(), atol=1e-4, rtol=1e-4)
        if beams == 1:
            chain = drafter.propose(items_ids[None], items_feats[None], DynamicCache())[0].argmax(-1).tolist()
            assert toks == chain
    stops = _stops(target, prompts)
    run = SpecEngine(target, MTADEagleProposer(drafter, num_beams=2, threshold=1.0), batch_size=3,
                     max_new_tokens=NEW, stop_token_ids=stops).run(prompts)  # fmt: skip
    assert [r.tokens for r in run.results] == _reference(target, prompts, stops)
    assert run.stats.tau == 1.0


@pytest.mark.parametrize("name, tree", [("eagle", ["tree.choices=eagle_default"]), ("eagle", ["tree.widths=[3,2,2]", "tree.budget=6"]),
                                        ("medusa", ["tree.choices=medusa_default"])], ids=["eagle-static", "eagle-dynamic", "medusa"])
def test_harness_evaluates_eagle_and_medusa_checkpoints(tiny_target, tmp_path, name, tree):
    """scripts.evaluate on an EAGLE / Medusa checkpoint: the drafter's own proposer and tree, labelled with its
    name, greedy-equal to plain decoding; an EAGLE checkpoint also runs MTAD with its joint likelihoods, a
    Medusa one MCSD (over its K heads) and MTAD."""
    import json

    from helpers import compose_dict

    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    run = tmp_path / "run"
    _drafter(name, tiny_target).save_pretrained(run / "drafter")
    (run / "config.json").write_text(json.dumps({"target": {"name": "tiny"}}))
    # Medusa's per-depth heads also drive MCSD and MTAD (their depth is K heads, not K + 1 mask slots)
    methods = "[parallelspec,mtad]" if name == "eagle" else "[drafter,mcsd,mtad]"
    res = evaluate(compose_dict("evaluate", [
        f"checkpoint={run}", "target=tiny", "num_prompts=3", "max_new_tokens=10", "batch_sizes=[2]", "modes=[unpadded]",
        f"methods={methods}", *tree, "tree.plan=false", "mcsd.ks=[2,1,1]", "mcsd.target_roots=[1]", f"output_dir={tmp_path / 'eval'}", "progress=false", "plots=false", "warmup=false",
    ]))  # fmt: skip
    spec = {r["method"]: r for r in res["runs"] if r["method"] != "plain"}
    assert set(spec) == ({"eagle", "mtad"} if name == "eagle" else {"medusa", "mcsd_w1", "mtad"})
    if name == "medusa":
        assert spec["mcsd_w1"]["greedy_equal"] and spec["mcsd_w1"]["mean_tree_nodes"] > 2
    assert spec[name]["greedy_equal"] and spec[name]["tau"] > 1.2  # the tiny target's drafter accepts drafts
    assert res["drafter"]["name"] == name and res["drafter"]["draft_depth"] == (4 if name == "eagle" else 3)
    assert f"{name}, draft depth" in (tmp_path / "eval" / "report.md").read_text()


def test_bench_trees_script_runs_and_resumes(tiny_target, tmp_path, monkeypatch):
    """scripts.bench_trees on tiny EAGLE and Medusa runs: one row per (recipe, tree), outputs equal to plain,
    JSON + markdown written; a second invocation reuses the finished runs instead of decoding again."""
    import json

    from scripts import bench_trees

    torch.set_num_threads(1)
    runs = tmp_path / "runs"
    for name in ("eagle", "medusa"):
        _drafter(name, tiny_target).save_pretrained(runs / name / "drafter")
        (runs / name / "config.json").write_text(json.dumps({"target": {"name": "tiny"}}))
    args = [f"runs={runs}", "recipes=[eagle,medusa]", "prompt_sets=[mt_bench]", "batch_sizes=[2]", "num_prompts=2",
            "max_new_tokens=6", "threads=1", "target=tiny", f"out={tmp_path / 'trees'}", f"work_dir={tmp_path / 'work'}"]
    bench_trees.main(args)
    data = json.loads((tmp_path / "trees.json").read_text())
    labels = [(r["recipe"], r["tree"]) for r in data["rows"]]
    assert labels == [("eagle", t) for t, _ in bench_trees.TREES["eagle"]] + [("medusa", t) for t, _ in bench_trees.TREES["medusa"]]
    assert all(r["greedy_equal"] and r["batch_size"] == 2 and r["tau"] >= 1.0 for r in data["rows"])
    md = (tmp_path / "trees.md").read_text()
    assert "| eagle | EAGLE's default tree (25 nodes) | mt_bench | 2 |" in md
    monkeypatch.setattr(bench_trees, "run_eval", lambda overrides: pytest.fail("finished runs must be reused"))
    bench_trees.main(args)
    assert json.loads((tmp_path / "trees.json").read_text())["rows"] == data["rows"]


@pytest.mark.parametrize("kind", ["tree-T0.8", "dynamic-greedy", "chain-greedy"])
def test_eagle_batched_drafting_equals_per_sequence(varied_target, prompts, kind):
    """The batched EAGLE proposer (one drafter forward per depth for the whole batch, one ragged cache)
    drafts the same trees as drafting each sequence alone with its own DynamicCache: same tokens, same
    accepted lengths at every step, same outputs under sampling with the same seed, for prompts of
    different lengths that finish at different steps (slots are refilled: continuous batching)."""
    drafter = _drafter("eagle", varied_target, seed=4)
    sampling = SamplingParams(temperature=0.8) if kind.startswith("tree") else SamplingParams()
    make = {
        "tree-T0.8": lambda b: EagleProposer(drafter, choices=EAGLE_DEFAULT_CHOICES, batched=b),
        "dynamic-greedy": lambda b: EagleProposer(drafter, widths=[3, 2, 2, 1], expand=2, budget=9, batched=b),
        "chain-greedy": lambda b: EagleProposer(drafter, batched=b),
    }[kind]
    stops = _stops(varied_target, prompts)
    runs = {}
    for batched in (True, False):
        prop = make(batched)
        runs[batched] = SpecEngine(varied_target, prop, batch_size=3, max_new_tokens=NEW, stop_token_ids=stops,
                                   sampling=sampling, seed=11).run(prompts)  # fmt: skip
        assert prop.batched is batched
    a, b = runs[True].results, runs[False].results
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.accept_lengths for r in a] == [r.accept_lengths for r in b]
    if sampling.greedy:  # the stop ids come from greedy outputs: sequences finished at different steps
        assert len({len(r.tokens) for r in a}) > 1


def test_eagle_batched_trees_match_per_sequence_trees(varied_target, prompts):
    """Direct check of one batched draft call: per slot, the tree's tokens, parents and draft rows equal
    the per-sequence proposer's, and the drafter cache holds exactly the committed items afterwards."""
    drafter = _drafter("eagle", varied_target, seed=6)
    sampling = SamplingParams(temperature=0.7, top_p=0.9)
    props = {b: EagleProposer(drafter, choices=EAGLE_DEFAULT_CHOICES, batched=b) for b in (True, False)}
    trees = {}
    for b, prop in props.items():
        for slot, p in enumerate(prompts[:4]):
            full = varied_target.generate_greedy([p], 4, stop_token_id=-1, return_features=False)[0]["tokens"]
            feats = varied_target.features(torch.tensor([full]))[0]
            prop.start(slot, p, feats[: len(p)], full[len(p)])
        g = torch.Generator().manual_seed(2)
        prop.draft(range(4), sampling, g)
        for slot, p in enumerate(prompts[:4]):  # commit 1..3 items per slot (different lengths)
            full = varied_target.generate_greedy([p], 4, stop_token_id=-1, return_features=False)[0]["tokens"]
            feats = varied_target.features(torch.tensor([full]))[0]
            m = 1 + slot % 3
            prop.commit(slot, full[len(p) + 1 : len(p) + 1 + m], feats[len(p) : len(p) + m])
        trees[b] = prop.draft([3, 0, 2, 1], sampling, g)
        assert [prop.committed_length(s) for s in range(4)] == [len(p) + 1 + s % 3 for s, p in enumerate(prompts[:4])]
    for tb, tu in zip(trees[True], trees[False]):
        assert tb.tokens.tolist() == tu.tokens.tolist() and tb.parents.tolist() == tu.parents.tolist()
        assert tb.dist_index.tolist() == tu.dist_index.tolist()
        torch.testing.assert_close(tb.draft_probs, tu.draft_probs, atol=2e-5, rtol=1e-4)


def test_bench_drafting_script_runs_and_resumes(tiny_target, tmp_path, monkeypatch):
    """scripts.bench_drafting on a tiny EAGLE run: a batched and a per-sequence row per batch size, same τ,
    outputs equal to plain, the ratio recorded; a second invocation reuses the finished runs."""
    import json

    from scripts import bench_drafting

    torch.set_num_threads(1)
    runs = tmp_path / "runs"
    _drafter("eagle", tiny_target).save_pretrained(runs / "eagle" / "drafter")
    (runs / "eagle" / "config.json").write_text(json.dumps({"target": {"name": "tiny"}}))
    args = [f"runs={runs}", "recipes=[eagle]", "batch_sizes=[1,3]", "num_prompts=3", "max_new_tokens=6", "threads=1",
            "target=tiny", f"out={tmp_path / 'drafting'}", f"work_dir={tmp_path / 'work'}"]
    bench_drafting.main(args)
    rows = json.loads((tmp_path / "drafting.json").read_text())["rows"]
    assert [(r["batch_size"], r["drafting"]) for r in rows] == [(1, "batched"), (1, "per-sequence"), (3, "batched"),
                                                                (3, "per-sequence")]  # fmt: skip
    assert all(r["greedy_equal"] for r in rows)
    assert rows[0]["same_tau"] and rows[2]["same_tau"] and rows[2]["ratio"] > 0
    assert "| eagle | EAGLE-2 dynamic [4,2,2,1,1], 8 nodes | 3 | batched |" in (tmp_path / "drafting.md").read_text()
    monkeypatch.setattr(bench_drafting, "run_eval", lambda overrides: pytest.fail("finished runs must be reused"))
    bench_drafting.main(args)
    assert json.loads((tmp_path / "drafting.json").read_text())["rows"] == rows
