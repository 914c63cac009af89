"""Layering runs one way: the core (masgraph/) imports nothing from masgraph.agents or masgraph.trainers; it finds
them through the registry's `masgraph.plugins` entry points."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = ("masgraph.agents", "masgraph.trainers")


def imports_in(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in one file (also inside functions and TYPE_CHECKING blocks, and
    importlib.import_module / __import__ calls with a literal name)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def core_imports(root: Path = ROOT / "masgraph") -> list[tuple[str, int, str]]:
    """(file, line, module) of every import in a package."""
    return [(str(path.relative_to(root.parent)), line, module)
            for path in sorted(root.rglob("*.py")) for line, module in imports_in(path)]


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
        "import masgraph.rundir.store, masgraph.cli\n"
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


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of this code base it imports (lazy and TYPE_CHECKING imports included); agents/ and
    trainers/ under the names they install as. A package's own face is not an arrow from inside it."""
    files = {}
    for base in ("masgraph", "agents", "trainers"):
        for path in sorted((root / base).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            parts = (["masgraph"] + parts if parts[0] != "masgraph" else parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for _, name in imports_in(path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in graph.items() for b in bs])
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_the_module_import_graph_has_no_cycle():
    graph = module_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk sees the code base
    assert cycles(graph) == []


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "masgraph").mkdir()
    (tmp_path / "masgraph" / "a.py").write_text("from masgraph.b import f\n")
    (tmp_path / "masgraph" / "b.py").write_text("def f():\n    from masgraph import a\n")
    (tmp_path / "masgraph" / "c.py").write_text("import masgraph.a\n")
    assert cycles(module_graph(tmp_path)) == [["masgraph.a", "masgraph.b"]]


CORE = ("registry", "spec", "loader", "node", "tools", "trace", "events", "errors", "graph", "tasks", "runtime",
        "memory", "streaming")
"""What says what a graph is and runs it: none of it may name a concrete backend (they register through the
`masgraph.plugins` entry point `backends`)."""
BACKEND_CONTRACT = ("masgraph.backends", "masgraph.backends.base")


def layer_breaks(root: Path = ROOT) -> list[str]:
    out = []
    for module, deps in module_graph(root).items():
        part = module.split(".")[1] if module.count(".") else ""
        for dep in deps:
            if part in CORE and dep.startswith("masgraph.backends") and dep not in BACKEND_CONTRACT:
                out.append(f"{module} -> {dep} (the core names a concrete backend)")
            if part == "watch" and dep.split(".")[1] in ("runtime", "learn", "trainers", "tasks", "backends", "serve"):
                out.append(f"{module} -> {dep} (the TUI reads the run dir, nothing that runs or trains)")
    return sorted(out)


def test_the_core_names_no_concrete_backend_and_the_tui_reads_only_the_run_dir():
    assert layer_breaks() == []


def test_the_layer_check_sees_each_break(tmp_path):
    (tmp_path / "masgraph" / "backends" / "hf").mkdir(parents=True)
    (tmp_path / "masgraph" / "watch").mkdir()
    (tmp_path / "masgraph" / "tasks").mkdir()
    (tmp_path / "masgraph" / "backends" / "base.py").write_text("")
    (tmp_path / "masgraph" / "backends" / "hf" / "backend.py").write_text("")
    (tmp_path / "masgraph" / "tasks" / "base.py").write_text("")
    (tmp_path / "masgraph" / "registry.py").write_text(
        "from masgraph.backends.base import x\ndef f():\n    from masgraph.backends.hf.backend import HFBackend\n")
    (tmp_path / "masgraph" / "watch" / "index.py").write_text("from masgraph.tasks.base import full_reward\n")
    assert layer_breaks(tmp_path) == [
        "masgraph.registry -> masgraph.backends.hf.backend (the core names a concrete backend)",
        "masgraph.watch.index -> masgraph.tasks.base (the TUI reads the run dir, nothing that runs or trains)"]
