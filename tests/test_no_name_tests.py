"""No code switches on a recipe's or a strategy's name outside its own module.

Why: the exporters used to test ``drafter.name == "parallelspec_eagle3"`` and key their formats by recipe, and
validation named strategies, so a new drafter variant (EAGLE-3.1) or a new strategy meant editing modules that
were not its own. Drafters declare what they are (``spec``, ``serving_formats``, ``serving_flags``), strategies
declare what they need (``requires``, ``config_section``); the code reads the declarations. This test walks
every module of the package and flags a comparison (``==``, ``!=``, ``in``, ``not in``) between a registered
drafter or strategy name and an expression that holds a name (a ``.name`` / ``.strategy`` attribute or a
variable called name, recipe, drafter or strategy), outside the drafter's or strategy's own module and the
registries. Format names and engine model types that happen to equal a drafter's name (``dflash``, ``medusa``)
are not comparisons with a name and pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME_HOLDERS = {"name", "recipe", "drafter", "strategy", "drafter_name", "strategy_name"}


def _holds_a_name(node: ast.AST) -> bool:
    for x in ast.walk(node):
        if isinstance(x, ast.Attribute) and x.attr in ("name", "strategy"):
            return True
        if isinstance(x, ast.Name) and x.id in NAME_HOLDERS:
            return True
    return False


def name_tests(sources: dict[str, str], names: set[str], own: dict[str, set[str]]) -> list[str]:
    """``file:line: name`` for every comparison of a name-holding expression with one of ``names`` in ``sources``
    (path -> text), except a file comparing with the names it owns (``own``: path -> names)."""
    bad = []
    for path, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and c.value in names}
            consts -= own.get(path, set())
            if consts and any(_holds_a_name(s) for s in sides):
                bad += [f"{path}:{node.lineno}: {c}" for c in sorted(consts)]
    return bad


def test_no_code_switches_on_a_recipe_or_strategy_name():
    from drafttrain.drafters import DRAFTERS
    from drafttrain.strategies import STRATEGIES

    names = set(DRAFTERS) | set(STRATEGIES)
    own = {"drafttrain/drafters/__init__.py": names, "drafttrain/strategies/__init__.py": names}
    for n, cls in DRAFTERS.items():
        own.setdefault(f"drafttrain/{cls.__module__.removeprefix('drafttrain.').replace('.', '/')}.py", set()).add(n)
    for n, cls in STRATEGIES.items():
        own.setdefault(f"drafttrain/{cls.__module__.removeprefix('drafttrain.').replace('.', '/')}.py", set()).add(n)
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "drafttrain").rglob("*.py"))}
    assert len(names) >= 10 and len(sources) > 50
    assert name_tests(sources, names, own) == []


def test_the_name_check_finds_a_name_test():
    src = ('def f(drafter, c):\n    if drafter.name == "eagle3":\n        pass\n'
           '    if c.trainer.strategy in ("on_policy", "mixed"):\n        pass\n'
           '    if cfg.get("model_type") != "medusa":\n        pass\n')  # the last: an engine's model type
    assert name_tests({"x.py": src}, {"eagle3", "on_policy", "mixed", "medusa"}, {}) == [
        "x.py:2: eagle3", "x.py:4: mixed", "x.py:4: on_policy"]
    assert name_tests({"x.py": src}, {"eagle3"}, {"x.py": {"eagle3"}}) == []
