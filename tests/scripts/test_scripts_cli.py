"""Every script under scripts/ has the one CLI style (docs/design.md "One command-line style"): Hydra-style
key=value overrides validated into a dataclass by ``drafttrain.cliconfig.parse_cli``, a typo'd key fails
before any work, ``--help`` lists the keys; no script or test imports another script's private name; the
reproduce commands in README.md and docs/ carry no absolute paths of ours and no lock files.

Why: three CLI styles (argparse, Hydra, hand-parsed key=value) had grown in scripts/, benchmark scripts
imported each other's private helpers, and docs carried one machine's /work and /tmp paths and flock."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from drafttrain.cliconfig import ConfigError, parse_cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem not in ("__init__", "common"))


def test_there_are_scripts():
    assert {"evaluate", "generate_data", "bench_trees", "bench_sssd_datastore", "report_run"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_has_the_one_cli(name, capsys):
    src = (ROOT / "scripts" / f"{name}.py").read_text()
    assert "argparse" not in src and "sys.argv" not in src and "@hydra.main" not in src, name
    assert "run_cli(main)" in src, f"scripts/{name}.py must end with run_cli(main)"
    mod = importlib.import_module(f"scripts.{name}")
    with pytest.raises(ConfigError, match="nosuchkey"):  # before any model or data loads
        mod.main(["nosuchkey=1"])
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "key=value" in capsys.readouterr().out


def test_parse_cli_names_the_closest_key_and_moved_keys():
    from scripts.bench_trees import BenchTreesConfig

    with pytest.raises(ConfigError, match="'batch_sizs'.*did you mean 'batch_sizes'"):
        parse_cli(BenchTreesConfig, ["batch_sizs=[1]"])
    with pytest.raises(ConfigError, match="'old.key' moved to 'num_prompts'"):
        parse_cli(BenchTreesConfig, ["old.key=3"], moved={"old.key": "num_prompts"})
    with pytest.raises(ConfigError, match="quote every list element"):
        parse_cli(BenchTreesConfig, ["recipes=[a=b]"])
    c = parse_cli(BenchTreesConfig, ["target=tiny", 'recipes=["eagle"]'])  # `target` is a conf/ group name too
    assert c.target == "tiny" and c.recipes == ["eagle"]


def _private_script_imports(path: Path) -> list[str]:
    """``from scripts.x import _y`` / ``scripts.x._y`` / ``x._y`` on an imported script module."""
    tree = ast.parse(path.read_text())
    modules, bad = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "scripts":
            for a in node.names:
                if node.module == "scripts":
                    modules.add(a.asname or a.name)
                elif a.name.startswith("_"):
                    bad.append(f"{path.name}: from {node.module} import {a.name}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in modules:
                bad.append(f"{path.name}: {node.value.id}.{node.attr}")
    return bad


def test_no_script_private_name_is_imported():
    files = [*(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").rglob("*.py")]
    assert [b for f in files for b in _private_script_imports(f)] == []


def test_docs_commands_run_from_the_repo_root():
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").rglob("*.json"), *(ROOT / "conf").rglob("*.yaml")]
    bad = re.compile(r"/work/|/tmp/|\bflock\b|/home/|/Users/")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in docs for i, line in enumerate(p.read_text().splitlines(), 1)
            if bad.search(line)]  # fmt: skip
    assert hits == []


def test_report_run_records_no_path_of_the_measuring_machine(tmp_path):
    """A run measured in a clean clone elsewhere is recorded relative to that clone (the docs test above
    refuses machine paths in docs/benchmarks/*.json)."""
    from scripts.report_run import portable_run_dir

    clone = tmp_path / "clone"
    (clone / ".git").mkdir(parents=True)
    assert portable_run_dir(clone / "outputs" / "run") == "outputs/run"
    assert portable_run_dir(Path("outputs/run")) == "outputs/run"
    assert portable_run_dir(tmp_path / "elsewhere" / "outputs" / "run") == "outputs/run"


def _finished_run(tmp_path, final: dict):
    """A run folder as report_run reads it: config.json, final_metrics.json (``final``), metrics.jsonl."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({
        "target": {"name": "t"}, "data": {"source": "s", "max_conversations": 1, "self_distill": True, "max_new_tokens": 8},
        "drafter": {"name": "parallelspec", "num_mask_tokens": 2}, "optim": {"lr": 1e-3},
        "trainer": {"micro_batch_size": 2, "mixed_precision": "no"}}))  # fmt: skip
    (run / "final_metrics.json").write_text(json.dumps(final))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0, "train/tokens_per_s": 5.0}) + "\n")
    return run


def test_report_run_names_the_runs_host(tmp_path):
    """The main-job page says on what CPU and with which linear backend its speed figures were measured
    (the run's own launch.json), since the same code measures differently on AVX2 and AVX-512 hosts."""
    import json

    from scripts.report_run import markdown, summarize

    run = _finished_run(tmp_path, {"step": 3, "train_seconds": 1.0, "trainable_params": 10})
    assert "host (the run's own)" not in markdown("x", summarize(run), None, None)
    (run / "launch.json").write_text(json.dumps({"world_size": 1, "host": {
        "cpu_capability": "AVX512", "cpu_threads": 2, "target_linears": "kernel (avx512 build)"}}))
    md = markdown("x", summarize(run), None, None)
    assert "| host (the run's own) | CPU capability AVX512, 2 torch threads, target linears on kernel (avx512 build) |" in md
    (run / "launch.json").write_text(json.dumps({"world_size": 1, "host": {
        "cpu_capability": "AVX2", "cpu_threads": 2, "target_linears": "onednn", "decode_attention": "kernel"}}))
    assert ("| host (the run's own) | CPU capability AVX2, 2 torch threads, target linears on onednn, decode attention "
            "on kernel |") in markdown("x", summarize(run), None, None)


def test_pages_name_the_host_by_drafttrain_host_describe(tmp_path):
    """Benchmark pages and the run page print drafttrain.host.describe's line (CPU model, ISA, native bf16);
    a record made before it says "host not recorded", never just the machine type."""
    import json

    from drafttrain.host import describe
    from scripts.common import machine, machine_line
    from scripts.report_run import markdown, summarize

    m = machine()
    assert m["cpu_model"] == describe()["cpu_model"] and "loadavg_1min" in m
    assert machine_line(m).startswith(f"{m['cpu_model']} ({m['isa']}, native bf16: ")
    assert machine_line({"device": "cpu", "host": m}) == machine_line(m)  # a harness results.json's host
    assert machine_line({"processor": "x86_64", "torch_threads": 2, "torch": "2.5"}) == (
        "host not recorded, 2 torch threads, torch 2.5")
    run = _finished_run(tmp_path, {"step": 3, "train_seconds": 1.0, "trainable_params": 10})
    (run / "launch.json").write_text(json.dumps({"world_size": 1, "host": {**describe(), "cpu_capability": "AVX2",
                                                 "cpu_threads": 2, "target_linears": "onednn"}}))  # fmt: skip
    assert f"| host (the run's own) | {machine_line(describe())}; CPU capability AVX2" in markdown(
        "x", summarize(run), None, None)


def test_report_run_shows_the_decode_only_speedups(tmp_path):
    """The main-job page gives the decoding steps' speedup (prompt forwards left out) beside the wall-clock
    one, at the eval batch size and at batch 1, and leaves the row out for runs made before the metric."""
    import json

    from scripts.report_run import markdown, summarize

    final = {"step": 3, "train_seconds": 1.0, "trainable_params": 10, "eval/batch_size": 16, "eval/speedup": 0.99}
    run = _finished_run(tmp_path, final)
    assert "decoding steps alone" not in markdown("x", summarize(run), None, None)
    final.update({"eval/speedup_decode_b16": 1.004, "eval/speedup_decode_b1": 1.31})
    (run / "final_metrics.json").write_text(json.dumps(final))
    md = markdown("x", summarize(run), None, None)
    assert "left out): speedup at batch 16 / batch 1 | 1.00 / 1.31 |" in md
    assert "planner at batch" not in md
    counters = {"steps": 10, "drafted_steps": 4, "nodes_verified": 5, "nodes_offered": 9}
    final.update({"eval/planner_b16": counters, "eval/planner_b1": {**counters, "drafted_steps": 9}})
    (run / "final_metrics.json").write_text(json.dumps(final))
    md = markdown("x", summarize(run), None, None)
    assert "| planner at batch 1: drafted steps / steps, nodes verified / offered | 9 / 10, 5 / 9 |" in md
    assert "| planner at batch 16: drafted steps / steps, nodes verified / offered | 4 / 10, 5 / 9 |" in md
