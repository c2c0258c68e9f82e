"""The speed benchmark scripts run end to end on the tiny target (no timing is asserted)."""

from __future__ import annotations

import json


def test_bench_forward_cost_writes_page(tmp_path, tiny_target):
    from scripts.bench_forward_cost import main

    out = tmp_path / "fc"
    res = main(["target.random_init=true", "tokens=[1,3]", "batch_sizes=[1,2]", "batch_tokens=[1,2]", "repeats=1",
                "bandwidth_mb=8", "threads=1", f"out={out}"])  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 2)]
    assert all(r["plain_ms"] > 0 and r["packed_ms"] > 0 and r["roofline_ms"] > 0 for r in rows)
    assert res["linear_layers"] == 2 * 7 + 1  # 2 layers x (q, k, v, o, gate, up, down) + LM head
    md = out.with_suffix(".md").read_text()
    assert "python -m scripts.bench_forward_cost" in md and "| 2 | 2 |" in md


def test_bench_compile_writes_page(tmp_path, tiny_target):
    """Every variant on the tiny target at 1 and 2 tokens: timed, each compiled one's first call (its compile) kept,
    numerics against eager F.linear recorded, a variant that fails to compile reported, not raised; the page
    names each variant."""
    from scripts.bench_compile import main

    out = tmp_path / "compile"
    res = main(["target.random_init=true", "tokens=[1,2]", "context=8", "repeats=2", "threads=1", f"out={out}"])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 2]
    assert res["variants"] == ["eager_plain", "eager_packed", "compiled_freezing", "compiled_dynamic", "compiled_packed",
                               "engine_packed", "engine_compiled"]
    assert res["warm_up_s"]["engine_compiled"] > 0  # the engine's graphs compiled before timing, the time kept
    for r in rows:  # the engine's forward (ragged cache, tree mask; compiled or not) gives the target's own logits
        for name in ("eager_plain", "eager_packed", "compiled_freezing", "compiled_dynamic", "engine_packed",
                     "engine_compiled"):
            assert r[name]["ms"] > 0 and r[name]["argmax_equal"], (name, r[name])
            assert r[name]["max_abs_logit_diff"] < 1e-3
        assert r["eager_plain"]["max_abs_logit_diff"] == 0.0
        assert all(r[n]["first_call_s"] > 0 for n in ("compiled_freezing", "compiled_dynamic"))  # compile time kept
        assert "ms" in r["compiled_packed"] or r["compiled_packed"]["error"]  # timed, or its compile error kept
    md = out.with_suffix(".md").read_text()
    assert "python -m scripts.bench_compile" in md and "| 2 |" in md and "compiled_freezing ms" in md


def test_bench_compile_rejects_unknown_variant(tmp_path):
    import pytest

    from scripts.bench_compile import main

    with pytest.raises(ValueError, match="variants"):
        main(["target.random_init=true", "variants=[eager_plain,compiled_max]", f"out={tmp_path / 'c'}"])
    with pytest.raises(ValueError, match="batch"):  # compile_target is batch 1 only
        main(["target.random_init=true", "batch=4", "variants=[eager_plain,engine_compiled]", f"out={tmp_path / 'c'}"])


def test_bench_compile_batched_rows(tmp_path, tiny_target):
    """batch=3: every row's logits of the compiled (dynamic, freezing) forward agree with eager's; the page says the
    batch."""
    from scripts.bench_compile import main

    out = tmp_path / "cb"
    res = main(["target.random_init=true", "batch=3", "variants=[eager_plain,eager_packed,compiled_dynamic]",
                "tokens=[1,2]", "context=8", "repeats=2", "threads=1", f"out={out}"])  # fmt: skip
    for r in res["rows"]:
        for name in ("eager_packed", "compiled_dynamic"):
            assert r[name]["argmax_equal"] and r[name]["max_abs_logit_diff"] < 1e-3, (name, r[name])
    assert "batch 3" in out.with_suffix(".md").read_text()


def test_bench_draft_cost_writes_page(tmp_path, tiny_target):
    from scripts.bench_draft_cost import main

    out = tmp_path / "dc"
    res = main(["target.random_init=true", "batch_sizes=[1,3]", "steps=2", "threads=1", "tree_widths=[2,1]",
                "tree_budget=3", f"out={out}"])  # fmt: skip
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    assert all(r["same_state"] and r["before_ms"] > 0 and r["after_ms"] > 0 and r["packed_ms"] > 0 for r in res["rows"])
    md = out.with_suffix(".md").read_text()
    assert "python -m scripts.bench_draft_cost" in md and "| packed (ms/step) |" in md


def test_bench_peers_writes_page(tmp_path, tiny_target):
    from scripts.bench_peers import main

    out = tmp_path / "peers"
    res = main(["target.random_init=true", "num_prompts=2", "max_new_tokens=6", "threads=1", f"out={out}"])
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["hf_generate", "hf_prompt_lookup", "hf_generate_packed", "engine_plain", "engine_spec",
                          "engine_hybrid", "hf_generate_compiled", "engine_plain_compiled", "engine_spec_compiled", "engine_hybrid_compiled"]
    assert all(r["equal_outputs"] == 2 for r in rows.values())  # every method reproduces HF generate
    assert "hf_generate_compiled" in res["compile_seconds"]  # transformers' own compile, before timing
    assert res["compile_seconds"] and all(v > 0 for v in res["compile_seconds"].values())  # compiled before timing
    assert "python -m scripts.bench_peers" in out.with_suffix(".md").read_text()


def test_bench_sampling_rows_and_resume(tmp_path, checkpoint, monkeypatch):
    """scripts.bench_sampling on the tiny target: greedy and sampled rows per recipe, MTAD with top-k + top-p and
    MCSD under sampling, perplexity beside plain's, and a second call that reads every run back (no harness run)."""
    import scripts.common
    from scripts.bench_sampling import main

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "parallelspec").symlink_to(checkpoint)
    argv = [f"runs={runs}", "recipes=[parallelspec,eagle]", "main_run=null", "num_prompts=2", "prompt_stride=3",
            "max_new_tokens=6", "threads=1", "noise_seeds=[1]",
            "overrides=" + json.dumps(["target=tiny", "mcsd.ks=[2,1]", "mtad.num_beams=2"]),
            f"cache_dir={tmp_path / 'cache'}", f"out={tmp_path / 'sampling'}"]  # fmt: skip
    res = main(argv)
    got = [(r["method"], r["decoding"], r["lossless"]) for r in res["rows"]]
    assert got == [("parallelspec", "greedy", True), ("parallelspec", "sampled", True),  # eagle: no run, skipped
                   ("mtad", "greedy", False), ("mcsd_w1", "greedy", True), ("mcsd_w2", "greedy", False),
                   ("mtad", "mtad_warp", False), ("mcsd_w1", "mcsd_T", True), ("mcsd_w2", "mcsd_T", False)]  # fmt: skip
    for r in res["rows"]:
        assert r["perplexity"] > 1 and r["plain_perplexity"] > 1
        if r["decoding"] != "greedy":
            assert r["greedy_equal"] is None  # sampled: no token-for-token reference
        elif r["lossless"]:
            assert r["greedy_equal"] is True
    warped = json.loads((tmp_path / "cache" / "mtad-warped.json").read_text())["command_config"]
    assert (warped["temperature"], warped["top_p"], warped["top_k"]) == (0.7, 0.9, 20)  # MTAD App. F reached the harness
    assert json.loads((tmp_path / "cache" / "mcsd-sampled.json").read_text())["command_config"]["top_p"] == 1.0
    assert [(r["seed"], r["decoding"]) for r in res["noise"]] == [(0, "sampled"), (1, "sampled")]  # seed noise, own table
    assert res["noise"][0]["perplexity"] == res["rows"][1]["perplexity"]
    md = (tmp_path / "sampling.md").read_text()
    assert "| mean ± sd |" in md
    assert "| mtad (parallelspec drafter) | T 0.7, top-k 20, top-p 0.9 | **no** |" in md
    assert "python -m scripts.bench_sampling" in md

    def no_run(_):
        raise AssertionError("a cached run was run again")

    monkeypatch.setattr(scripts.common, "run_eval", no_run)
    assert main(argv)["rows"] == res["rows"]  # resumed: every run read back


def test_bench_decode_attention_writes_page(tmp_path, tiny_target):
    """Both backends per call (one query and a verification step's few) and per forward on the tiny target; the
    kernel's outputs agree with sdpa's and the forwards' argmax is equal. Skipped cleanly where the kernel does
    not build (the script refuses with the reason)."""
    import pytest

    from drafttrain.target import fastattention
    from drafttrain.cliconfig import ConfigError
    from scripts.bench_decode_attention import main

    out = tmp_path / "da"
    argv = ["target.random_init=true", "batch_sizes=[1,3]", "contexts=[9]", "tree_points=[[2,2],[1,4]]",
            "forward_batch_sizes=[2]", "forward_tokens=[1,2]", "forward_context=7", "repeats=1", "forward_repeats=1",
            "threads=1", f"out={out}"]  # fmt: skip
    if not fastattention.available():
        with pytest.raises(ConfigError, match="unavailable"):
            main(argv)
        return
    res = main(argv)
    calls = res["per_call"]
    assert [(r["batch"], r["context"], r["queries"]) for r in calls] == [(1, 9, 1), (3, 9, 1), (2, 7, 2), (1, 7, 4)]
    assert all(r["sdpa_ms"] > 0 and r["kernel_ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in calls)
    fwd = res["per_forward"]
    assert [(r["batch"], r["tokens"]) for r in fwd] == [(2, 1), (2, 2)]
    assert all(r["argmax_equal"] and r["logits_max_abs_diff"] < 1e-3 for r in fwd)
    md = out.with_suffix(".md").read_text()
    assert "python -m scripts.bench_decode_attention" in md and "| 2 | 7 | 2 |" in md
    with pytest.raises(ConfigError, match="MAX_QUERIES"):
        main(argv[:3] + ["tree_points=[[2,9]]"] + argv[4:])
