"""The `masgraph` command line: one module per subcommand; this face re-exports the names callers import."""

import os as _os
import signal as _signal
import sys as _sys


def _started_as_the_command() -> bool:
    """Whether this process is the `masgraph` command (its console script, or `python -m masgraph[.cli]`), not a
    program that imports masgraph.cli."""
    spec = getattr(_sys.modules.get("__main__"), "__spec__", None)
    return (_os.path.basename(_sys.argv[0]) == "masgraph" or _sys.argv[:1] == ["-m"]  # -m: while it is located
            or getattr(spec, "name", "") in ("masgraph.__main__", "masgraph.cli.__main__"))


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C during the command's imports (seconds on a busy machine): one line and exit 130. A handler, not a
    caught KeyboardInterrupt: one raised inside an extension's initialisation (pydantic-core's) becomes its panic."""
    print("interrupted", file=_sys.stderr)
    _os._exit(130)  # modules half imported: nothing to clean up, and nothing else to run


_default = _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler
if _default and _started_as_the_command():
    _signal.signal(_signal.SIGINT, _interrupted)
try:
    from masgraph.cli.common import load_graph as _load_graph
    from masgraph.cli.common import plural, with_backend, with_device
    from masgraph.cli.flags import item_count, non_negative_int, positive_float, positive_int
    from masgraph.cli.main import build_parser, main
    from masgraph.cli.port import check_port
    from masgraph.cli.progress import ProgressBar, TrainProgress
    from masgraph.cli.run import accuracy_line, run_with_progress
    from masgraph.cli.train import train_graph
finally:  # after them, Ctrl-C is a KeyboardInterrupt again: main and the runs handle it
    if _signal.getsignal(_signal.SIGINT) is _interrupted:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)

__all__ = ["ProgressBar", "TrainProgress", "_load_graph", "accuracy_line", "build_parser", "check_port",
           "item_count", "main", "non_negative_int", "plural", "positive_float", "positive_int",
           "run_with_progress", "train_graph", "with_backend", "with_device"]
