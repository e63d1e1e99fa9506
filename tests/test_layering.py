"""Imports flow moegraph -> passes -> schedules -> runtime, never backwards.

The CLI, its command modules and the public compile API are the front door: they may reach
later stages, but only lazily inside functions, never at module import time.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["moegraph", "passes", "schedules", "runtime"]
FRONT_DOOR = {"moegraph/cli.py", "moegraph/commands.py", "moegraph/api.py", "moegraph/__init__.py"}


def module_level_imports(tree):
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def all_imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_no_backward_imports():
    violations = []
    for stage, pkg in enumerate(ORDER):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text())
            imports = module_level_imports(tree) if rel in FRONT_DOOR else all_imports(tree)
            for name in imports:
                top = name.split(".")[0]
                if top in ORDER and ORDER.index(top) > stage:
                    violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)


def test_the_check_can_fail(tmp_path):
    tree = ast.parse("import runtime.executor\n")
    assert [n for n in all_imports(tree) if n.split(".")[0] == "runtime"]
