"""The `masgraph` command: its parser (one module per subcommand) and the entry point that turns user errors into
one `error:` line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from masgraph.cli import export, init, interrupt, plot, run, schema, serve, topology, train, validate, watch
from masgraph.cli.common import warnings_as_lines
from masgraph.errors import MasgraphError

COMMANDS = {"run": run, "train": train, "watch": watch, "plot": plot, "topology": topology, "export": export,
            "serve": serve, "validate": validate, "schema": schema, "init": init}
"""Subcommand -> its module (HELP, add_arguments(parser), which sets `fn`), in the order `--help` lists them."""


def build_parser(only: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or, with `only`, of those alone (the others are listed without their flags,
    so a command does not import the config models of the others)."""
    from masgraph._version import __version__

    p = argparse.ArgumentParser(prog="masgraph", description="Multi-agent LLM graphs: run, validate, train.")
    p.add_argument("--version", action="version", version=f"masgraph {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        parser = sub.add_parser(name, help=module.HELP)
        if only is None or name in only:
            module.add_arguments(parser)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `masgraph` command. User errors print one `error:` message (exit 2) and Ctrl-C exits 130, never with a
    traceback; a traceback means a bug in masgraph."""
    words = sys.argv[1:] if argv is None else argv
    try:  # building the parser imports the command's modules: seconds on a busy machine
        args = build_parser(only=words[:1]).parse_args(argv)
    except KeyboardInterrupt:
        return _interrupted(argv)
    warnings_as_lines()
    code = _command(args, argv)
    if argv is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a learner rank torchrun started, its results saved and its gloo group destroyed: exit without the
        # interpreter's teardown. The group's object outlives `destroy_process_group` (13-16 references left, from the
        # device mesh, FSDP's state, the learner's), so its C++ side was freed during teardown, where a rank aborted
        # 1 run in 40-90 under load (SIGABRT, "terminate called without an active exception", after its last line)
        interrupt.exit_now(code)
    return code


def _command(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run the parsed command; a user error is one `error:` line (exit 2)."""
    try:
        code = args.fn(args)
        if interrupt.interrupted and argv is None:  # the `masgraph` command (not a call from Python): exit now
            interrupt.exit_now(code)
        return code
    except MasgraphError as exc:  # user errors: a located message, no traceback
        print(f"error: {exc}", file=sys.stderr)
    except BrokenPipeError:  # the reader went away (`masgraph ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except OSError as exc:
        if exc.filename is None:  # not about a path the user gave
            raise
        print(f"error: {exc.strerror or exc}: {exc.filename}", file=sys.stderr)
    except KeyboardInterrupt:  # before or after a run (during one, the run handles it and reports)
        return _interrupted(argv)
    return 2


def _interrupted(argv: list[str] | None) -> int:
    """Ctrl-C outside a run: one line, exit 130 (the `masgraph` command exits at once: a model loading on its
    threads is not waited for)."""
    print("interrupted", file=sys.stderr)
    if argv is None:
        interrupt.exit_now(130)
    return 130
