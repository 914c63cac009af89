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
    return 1 if bad else 0
