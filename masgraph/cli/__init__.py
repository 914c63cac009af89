"""The `masgraph` command line: one module per subcommand; this face re-exports the names callers import."""

from masgraph.cli.common import load_graph as _load_graph
from masgraph.cli.common import plural, with_backend, with_device
from masgraph.cli.flags import item_count, non_negative_int, positive_float, positive_int
from masgraph.cli.main import build_parser, main
from masgraph.cli.port import check_port
from masgraph.cli.progress import ProgressBar, TrainProgress
from masgraph.cli.run import accuracy_line, run_with_progress
from masgraph.cli.train import train_graph

__all__ = ["ProgressBar", "TrainProgress", "_load_graph", "accuracy_line", "build_parser", "check_port",
           "item_count", "main", "non_negative_int", "plural", "positive_float", "positive_int",
           "run_with_progress", "train_graph", "with_backend", "with_device"]
