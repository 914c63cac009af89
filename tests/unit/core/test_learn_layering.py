"""The runtime imports nothing of learning: branching and counterfactual scoring live in `masgraph.learn`, which
the trainers call through the runner's one extension point; the old module paths still import (one release)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUNTIME = ("runner", "engine", "scheduler", "eager", "gc_scope", "ray_rollouts")
LEARN = ("masgraph.learn", "masgraph.learner", "masgraph.serving", "masgraph.counterfactual", "masgraph.branching")


def runtime_files(root: Path) -> list[Path]:
    pkg = root / "masgraph"
    files = [pkg / f"{m}.py" for m in RUNTIME if (pkg / f"{m}.py").exists()]
    return files + sorted((pkg / "runtime").rglob("*.py"))  # where the runtime moves next


def learning_imports(files: list[Path]) -> list[str]:
    """`file:line: module` of every import of learning in `files` (also inside functions and TYPE_CHECKING)."""
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            out += [f"{path.name}:{node.lineno}: {n}" for n in names if n.startswith(LEARN)]
    return out


def test_the_runtime_imports_nothing_from_learn():
    files = runtime_files(ROOT)
    assert len(files) >= 5
    assert learning_imports(files) == []


def test_the_check_sees_a_learning_import(tmp_path):
    (tmp_path / "masgraph").mkdir()
    (tmp_path / "masgraph" / "runner.py").write_text("def f():\n    from masgraph.learn.branching import siblings\n")
    (tmp_path / "masgraph" / "engine.py").write_text("from masgraph.learn import counterfactual\n")
    assert sorted({b.split(":")[0] for b in learning_imports(runtime_files(tmp_path))}) == ["engine.py", "runner.py"]


def test_the_old_paths_re_export_the_moved_modules():
    for name, attrs in {"learner": ("Learner", "WeightSync", "LoraConfigSpec"),
                        "serving": ("serve_learner", "rollout_kind", "local_learner", "Serving"),
                        "counterfactual": ("META", "variants", "sampled"),
                        "branching": ("siblings", "fork_step")}.items():
        old, new = importlib.import_module(f"masgraph.{name}"), importlib.import_module(f"masgraph.learn.{name}")
        assert all(getattr(old, a) is getattr(new, a) for a in attrs), name
