"""`masgraph watch`: the TUI over a run or training directory, live or finished."""

from __future__ import annotations

import argparse

from masgraph.cli.flags import model_flag, positive_float

HELP = ("TUI over a run or training directory, live or finished: graph, episodes, training curves (keys: ? in "
        "the app)")


def add_arguments(w: argparse.ArgumentParser) -> None:
    from masgraph.watch import watch

    w.add_argument("run", help="a run directory (runs/<graph>-<date>-<time>)")
    model_flag(w, "--poll", watch, "poll_s", type=positive_float,
               help="seconds between reads of the run (default %(default)s)")
    w.set_defaults(fn=cmd_watch)


def cmd_watch(args: argparse.Namespace) -> int:
    from masgraph.watch import watch

    return watch(args.run, poll_s=args.poll)
