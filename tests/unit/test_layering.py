"""Layering runs one way: the core (masgraph/) imports nothing from masgraph.agents or masgraph.trainers; it finds
them through the registry's `masgraph.plugins` entry points."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("masgraph.agents", "masgraph.trainers")


def core_imports(root: Path = ROOT / "masgraph") -> list[tuple[str, int, str]]:
    """(file, line, module) of every import in a package (also inside functions and TYPE_CHECKING blocks, and
    importlib.import_module / __import__ calls with a literal name)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        name = str(path.relative_to(root.parent))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(name, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((name, node.lineno, node.module))
                out += [(name, node.lineno, f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                out.append((name, node.lineno, str(node.args[0].value)))
    return out


def forbidden(imports: list[tuple[str, int, str]]) -> list[str]:
    return [f"{f}:{line}: {m}" for f, line, m in imports if m.startswith(FORBIDDEN) or m in ("agents", "trainers")]


@pytest.mark.slow
def test_core_imports_nothing_from_agents_or_trainers():
    imports = core_imports()
    assert len(imports) > 100  # the walk sees the code base
    assert forbidden(imports) == []


def test_the_walk_would_see_a_forbidden_import(tmp_path):
    """The check is not vacuous: imports hidden in a function, a TYPE_CHECKING block or import_module are found."""
    pkg = tmp_path / "masgraph"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from masgraph.agents.registry import register_agent\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    import masgraph.trainers.loop\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('masgraph.trainers')\n")
    (pkg / "d.py").write_text("from masgraph import trainers\n")
    assert sorted({b.split(":")[0] for b in forbidden(core_imports(pkg))}) == ["masgraph/a.py", "masgraph/b.py",
                                                                              "masgraph/c.py", "masgraph/d.py"]


def test_core_modules_load_without_agents_and_trainers():
    """Importing (and using) the core loads neither package: compiling a graph with an empty registry works and
    names the missing agent."""
    code = (
        "import sys\n"
        "from masgraph.registry import Registry, register_core\n"
        "from masgraph.graph import GraphBuilder, compile_spec\n"
        "from masgraph.errors import SpecError\n"
        "import masgraph.runtime.engine, masgraph.runtime.runner, masgraph.runtime.scheduler\n"
        "import masgraph.store, masgraph.cli\n"
        "from masgraph.backends.kinds import register\n"
        "reg = Registry(); register_core(reg); register(reg)\n"
        "g = GraphBuilder('g').add_policy('p', backend='scripted').add_node('a', role='generator', policy='p')\n"

        "try:\n"
        "    g.compile(registry=reg)\n"
        "except SpecError as e:\n"
        "    assert \"agent 'generator' is not registered\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('compiled without any agent')\n"
        "loaded = [m for m in sys.modules if m.startswith(('masgraph.agents', 'masgraph.trainers'))]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_plugins_are_found_through_entry_points():
    from masgraph.registry import default_registry

    reg = default_registry()
    assert {"planner", "executor", "verifier", "generator", "memory"} <= set(reg.agents)
    assert {"calculator", "python", "search"} <= set(reg.tools) and "flow_grpo" in reg.algorithms
