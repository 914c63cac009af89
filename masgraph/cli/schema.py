"""`masgraph schema`: print the JSON Schema of graph files (or of data task files)."""

from __future__ import annotations

import argparse
import json

HELP = "print the JSON Schema of graph files (for editors)"


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--task-file", action="store_true",
                   help="the schema of a data task file (`--task data:FILE.yaml`) instead")
    s.set_defaults(fn=cmd_schema)


def cmd_schema(args: argparse.Namespace) -> int:
    from masgraph.registry import default_registry
    from masgraph.schema import graph_json_schema

    if args.task_file:
        from masgraph.tasks.data import DataTaskSpec

        print(json.dumps(DataTaskSpec.model_json_schema(), indent=2))
        return 0
    reg = default_registry()
    print(json.dumps(graph_json_schema([a.config for a in reg.algorithms.values()], list(reg.backends)), indent=2))
    return 0
