"""`masgraph topology`: print a training run's learned topology distribution and draw it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from masgraph.cli.common import load_graph, load_task
from masgraph.cli.flags import positive_int
from masgraph.errors import MasgraphError
from masgraph.rundir.layout import CONFIG, SPEC
from masgraph.rundir.read import parse_json

if TYPE_CHECKING:
    from masgraph.tasks import Task

HELP = "print a training run's learned topology distribution and draw it (PNG)"

QUERIES = 4
"""Held-out queries shown for a query-conditioned policy by default (no config model holds it)."""


def add_arguments(tp: argparse.ArgumentParser) -> None:
    tp.add_argument("run", help="training run directory (algorithm hrpo or joint)")
    tp.add_argument("--queries", type=positive_int, default=QUERIES,
                    help="query-conditioned policies: held-out queries of the run's task to show (default %(default)s)")
    tp.add_argument("--out", help="output PNG (default RUN/topology.png)")
    tp.set_defaults(fn=cmd_topology)


def cmd_topology(args: argparse.Namespace) -> int:
    from masgraph.rundir.checkpoint import has_learned_topology, resolve_checkpoint
    from masgraph.topology.policy import load_policy
    from masgraph.topology.report import describe, draw

    run = Path(args.run)
    checkpoint = resolve_checkpoint(run)
    if not has_learned_topology(checkpoint):
        raise MasgraphError(f"{checkpoint} holds no topology policy; train with `algorithm: hrpo` or `joint` "
                            "on a graph with a `topology:` section")
    graph = load_graph(str(run / SPEC)) if (run / SPEC).is_file() else None
    if graph is None:
        raise MasgraphError(f"{run} has no spec.yaml; pass the training run directory (RUN, not a checkpoint)")
    policy = load_policy(graph, checkpoint)
    if policy is None:
        raise MasgraphError(f"{run}/spec.yaml has no `topology:` section, so {checkpoint} cannot hold its topology "
                            "policy; pass the run directory the topology was trained in")
    queries = []
    if policy.conditioned:
        task = run_task(run)
        queries = [it.question for it in task.items("test", args.queries, 0)] if task else []
    print(describe(policy, queries, source=f"checkpoint {checkpoint.name}"))
    print(f"wrote {draw(policy, args.out or run / 'topology.png', queries)}")
    return 0


def run_task(run: Path) -> Task | None:
    """The task a training run trained on (from its config.json), if it can be loaded; else None, with a `note:`
    line saying why (the policy is then shown at no query only)."""
    name = None
    try:
        name = parse_json((run / CONFIG).read_bytes())["config"].get("task")
        if name:
            return load_task(name)
        why = "its config.json names no task"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, MasgraphError) as exc:
        why = f"its task {name!r} cannot be loaded here ({exc})" if name else f"its config.json is unreadable ({exc})"
    print(f"note: {run}: {why}; showing the policy at no query only (no per-query rows)", file=sys.stderr)
    return None
