"""`masgraph validate`: check graph YAML files."""

from __future__ import annotations

import argparse
import sys

from masgraph.cli.common import load_graph, plural
from masgraph.errors import SpecError

HELP = "check graph YAML files"


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("files", nargs="+")
    v.add_argument("--no-model-check", action="store_true", help="do not check that models are installed")
    v.add_argument("--check-tools", action="store_true",
                   help="also start each tool (an MCP server: connected, its tools listed) and print what the "
                        "model is shown for it")
    v.set_defaults(fn=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.files:
        try:
            g = load_graph(path, check_models=not args.no_model_check)
            print(f"ok  {path}  ({plural(len(g.spec.nodes), 'node')}, {plural(len(g.spec.edges), 'edge')})")
        except SpecError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
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
