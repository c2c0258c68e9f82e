"""The package's import graph: configuration at the bottom, no circle, data generation that does not reach
into the verifier or the exporters.

Why: ``drafttrain.config`` once imported the drafter and method registries (lazily) while every drafter
and method imported the config: one circle through 23 modules, so no part could be read, tested or
replaced alone. Every import statement counts here, the lazy ones inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "drafttrain"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the drafttrain modules it imports anywhere (module level or inside a function)."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("drafttrain")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("drafttrain"):
                for a in node.names:  # `from drafttrain import families` names a module, `from x import f` a name
                    full = f"{node.module}.{a.name}"
                    deps.add(owner(full) if full in mods else owner(node.module))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_is_at_the_bottom():
    """The schemas import nothing of drafttrain's but the CLI helpers."""
    assert import_graph()["drafttrain.config"] <= {"drafttrain.cliconfig"}
    assert import_graph()["drafttrain.cliconfig"] == set()


def test_data_does_not_reach_into_the_verifier_or_the_exporters():
    bad = {m: sorted(d for d in deps if d.startswith(("drafttrain.verify", "drafttrain.export")))
           for m, deps in import_graph().items() if m.startswith("drafttrain.data")}  # fmt: skip
    assert {m: d for m, d in bad.items() if d} == {}


#: The layer of every top-level part, highest first: a module may import its own layer and the layers below it,
#: never one above (scripts -> train -> eval -> export / data -> generation -> verify / drafters -> target -> config).
#: The training strategies sit under validation, which reads their declarations (their config sections, their needs).
#: validation is the composition root under the jobs, compose (build_run) what they load their models through;
#: the pure helpers sit beside or under the target.
LAYERS = {
    "train": 8,
    "eval": 7,
    "export": 6, "data": 6,
    "validation": 5, "compose": 5, "preflight": 5, "sweep": 5.5,
    "strategies": 4.5,
    "generation": 4,
    "verify": 3, "drafters": 3,
    "fingerprint": 2.5,
    "target": 2, "layout": 2, "losses": 2, "metrics": 2, "attention": 2,
    "sampling": 1.5, "assets": 1.5, "host": 1.5, "memory": 1.5,
    "config": 1,
    "atomic": 0.5,
    "cliconfig": 0,
}  # fmt: skip


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run up the layer order, or between verify and drafters (same layer, kept apart)."""
    bad = []
    for m, deps in graph.items():
        for d in deps:
            a, b = _part(m), _part(d)
            if a == b or a not in LAYERS or b not in LAYERS:
                continue
            if LAYERS[a] < LAYERS[b] or {a, b} == {"verify", "drafters"}:
                bad.append(f"{m} -> {d}")
    return sorted(bad)


def test_every_part_has_a_layer():
    parts = {_part(m) for m in import_graph() if m.count(".")} - {"__init__"}
    assert parts <= set(LAYERS), f"place these in LAYERS: {sorted(parts - set(LAYERS))}"


def test_imports_follow_the_layer_order():
    assert layer_violations(import_graph()) == []


def test_the_layer_check_finds_an_import_that_runs_up():
    assert layer_violations({"drafttrain.eval.preset": {"drafttrain.train.loop"},
                             "drafttrain.drafters.x": {"drafttrain.verify.cache"},
                             "drafttrain.train.loop": {"drafttrain.eval.in_training"}}) == [
        "drafttrain.drafters.x -> drafttrain.verify.cache", "drafttrain.eval.preset -> drafttrain.train.loop"]  # fmt: skip


def script_problems(sources: dict[str, str]) -> list[str]:
    """Scripts that load a target their own way (a ``load_target(`` call, not :func:`drafttrain.compose.build_run`),
    build an engine by hand (a ``SpecEngine(`` call, not :meth:`drafttrain.compose.Run.engine`) or import a private
    name of the package (``from drafttrain... import _x``). ``sources``: name -> source text."""
    bad = []
    for name, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if called == "load_target":
                    bad.append(f"{name}:{node.lineno}: load_target( (build the target with drafttrain.compose.build_run)")
                elif called == "SpecEngine":
                    bad.append(f"{name}:{node.lineno}: SpecEngine( (build engines with drafttrain.compose.Run.engine)")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("drafttrain"):
                bad += [f"{name}:{node.lineno}: imports private {node.module}.{a.name}"
                        for a in node.names if a.name.startswith("_")]  # fmt: skip
    return bad


def test_scripts_build_through_compose_and_import_no_private_name():
    """One way to build a run's target (same dtype, device, fast_linear everywhere) and its engines; scripts use
    public names only. The package's parts from compose's layer up (eval, export, train, the pre-flight check, the
    sweep) build their engines through compose too."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "scripts").rglob("*.py"))}
    assert sources and script_problems(sources) == []
    above = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PKG.rglob("*.py"))
             if LAYERS.get(_part(".".join(p.relative_to(ROOT).with_suffix("").parts)), 0) >= LAYERS["compose"]
             and p.name != "compose.py"}  # fmt: skip
    assert above and [x for x in script_problems(above) if "SpecEngine(" in x] == []


def test_the_script_check_finds_a_private_import_and_a_load_target_call():
    assert script_problems({"s.py": "from drafttrain.eval.harness import _git_sha, evaluate\n"
                                    "from drafttrain import target\nt = target.load_target(cfg)\n"
                                    "e = SpecEngine(t, p, batch_size=2)\n"}) == [
        "s.py:1: imports private drafttrain.eval.harness._git_sha",
        "s.py:3: load_target( (build the target with drafttrain.compose.build_run)",
        "s.py:4: SpecEngine( (build engines with drafttrain.compose.Run.engine)"]  # fmt: skip


def test_every_rename_goes_through_atomic():
    """Durable writes go through drafttrain/atomic.py (fsync, rename, the disk-full guard): no other module renames
    a file into place by hand (``os.replace(``, ``Path.rename(``, ``os.rename(``) or makes its own temporary."""
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "atomic.py" and p.parent == PKG:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called in ("replace", "rename", "mkstemp") and (
                        called != "replace" or (isinstance(f, ast.Attribute) and getattr(f.value, "id", None) == "os")):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: {called}(")
    assert bad == []
