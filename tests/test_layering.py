"""Imports flow moegraph -> passes -> schedules -> runtime, never backwards.

The four stages are the repository's top-level folders, installed as ``moegraph``,
``moegraph.passes``, ``moegraph.schedules`` and ``moegraph.runtime``.

The CLI, its command modules and the public compile API are the front door: they may reach
later stages, but only lazily inside functions, never at module import time.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["moegraph", "passes", "schedules", "runtime"]  # folders, in pipeline order
STAGE_OF_PACKAGE = {"moegraph.passes": 1, "moegraph.schedules": 2, "moegraph.runtime": 3}
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


def stage_of(module: str) -> int | None:
    """The pipeline stage an imported module belongs to (None: not moegraph's)."""
    parts = module.split(".")
    if parts[0] != "moegraph":
        return None
    return STAGE_OF_PACKAGE.get(".".join(parts[:2]), 0)


def test_no_backward_imports():
    violations = []
    for stage, pkg in enumerate(ORDER):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text())
            imports = module_level_imports(tree) if rel in FRONT_DOOR else all_imports(tree)
            for name in imports:
                if name.split(".")[0] in ORDER[1:]:
                    violations.append(f"{rel} imports {name}: the stages install as moegraph.{name}")
                elif (stage_of(name) or 0) > stage:
                    violations.append(f"{rel} imports {name}")
    assert not violations, "\n".join(violations)


def test_the_check_can_fail():
    tree = ast.parse("import moegraph.runtime.executor\nfrom moegraph.ir import Graph\n")
    assert [stage_of(n) for n in all_imports(tree)] == [3, 0]


@pytest.mark.slow
def test_wheel_installs_one_top_level_package(tmp_path):
    """`pip install .` puts exactly one top-level package, moegraph, into site-packages."""
    import shutil
    import subprocess
    import sys
    import zipfile
    src = tmp_path / "src"   # a copy: pip builds in the source tree and would leave build/ in the repo
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name if src.exists() else (src.mkdir() or src / name))
    for pkg in ORDER:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("moegraph-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"moegraph"}
    for stage in ("passes", "schedules", "runtime"):
        assert f"moegraph/{stage}/__init__.py" in names
    assert "moegraph/registry/models.yaml" in names
