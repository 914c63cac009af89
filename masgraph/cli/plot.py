"""`masgraph plot`: PNGs of a training run's reward, held-out accuracy and topology probabilities per step."""

from __future__ import annotations

import argparse
from pathlib import Path

from masgraph.errors import MasgraphError
from masgraph.rundir.layout import METRICS

HELP = "PNG of reward and held-out accuracy per step of a training run"


def add_arguments(pl: argparse.ArgumentParser) -> None:
    pl.add_argument("run", help="training run directory")
    pl.add_argument("--out", help="output PNG (default RUN/learning_curve.png)")
    pl.set_defaults(fn=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from masgraph.rundir.plot import plot_run, plot_topology

    if not (Path(args.run) / METRICS).exists():
        raise MasgraphError(f"{args.run} has no metrics.jsonl (is it a `masgraph train` run directory?)")
    print(plot_run(args.run, args.out))
    topology = plot_topology(args.run)  # topology-training runs: decision probabilities per step
    if topology is not None:
        print(topology)
    return 0
