"""Helpers the subcommands share: loading graphs and tasks, command-line graph overrides, run-dir set-up and
warning lines."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from masgraph.errors import MasgraphError

if TYPE_CHECKING:
    from masgraph.graph import Graph
    from masgraph.tasks import Task


def plural(n: int, word: str) -> str:
    """'1 edge', '0 edges', '2 edges'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def load_graph(path: str, check_models: bool = True) -> Graph:
    """The graph file at `path`, compiled."""
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec

    return compile_spec(load_spec(path), path, check_models=check_models)


def load_task(name: str) -> Task:
    """A built-in task by name, or FILE.py:ClassName, or data:FILE.yaml."""
    from masgraph.tasks import resolve_task

    return resolve_task(name)


def check_splits(task: Task, seed: int) -> None:
    """Training needs train items and held-out ones: checked before a model loads, each missing split one `error:`
    line (a data task says what it holds out and what to do)."""
    if not task.items("train", 1, seed):
        raise MasgraphError(f"task {task.name!r} gave no train items (seed {seed}); check its generate()")
    if not task.items("test", 1, seed):
        raise MasgraphError(f"task {task.name!r} has no held-out (test) items that differ from its train questions "
                            f"(seed {seed}); held-out evaluation needs some: make generate('test', ...) ask other "
                            "questions")


def with_device(graph: Graph, device: str | None, file: str) -> Graph:
    """The graph with every local-model policy (hf; vllm, whose weights a learner trains) on `device`
    (`--device cuda:1`); checked first, so a GPU that is not there is an error line before anything loads."""
    if device is None:
        return graph
    from masgraph.device import resolve_device
    from masgraph.graph import compile_spec

    resolve_device(device)
    spec = graph.spec
    policies = {n: p.model_copy(update={"device": device}) if p.backend in ("hf", "vllm") else p
                for n, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies}), file)


def with_backend(graph: Graph, kind: str | None, api_base: str | None, file: str) -> Graph:
    """The graph with every hf policy served by backend `kind` (`--backend vllm`), attached to `api_base` if given."""
    if kind is None:
        if api_base:
            raise MasgraphError("--api-base needs --backend (e.g. --backend vllm --api-base http://host:8000/v1)")
        return graph
    from masgraph.graph import compile_spec
    from masgraph.registry import default_registry

    if kind not in default_registry().backends:
        raise MasgraphError(f"--backend {kind}: not a registered backend; use one of "
                            f"{sorted(default_registry().backends)}")
    spec = graph.spec
    policies = {n: p.model_copy(update={"backend": kind, "api_base": api_base}) if p.backend == "hf" else p
                for n, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies}), file)


@contextmanager
def removed_if_left_empty(run_dir: Path) -> Iterator[None]:
    """Set-up of a run in a run dir just made: if it fails with nothing written there, the dir goes too (a failed
    start leaves no empty run dirs behind; one holding a server's log, which the error names, stays)."""
    try:
        yield
    except BaseException:
        try:
            run_dir.rmdir()  # only ever removes an empty directory
        except OSError:
            pass
        raise


def require_terminal_if(watch: bool) -> None:
    """With --watch: stdout must be a terminal, checked before the model loads."""
    if watch:
        from masgraph.watch import require_terminal

        require_terminal()


def print_topology(policy: Any, mode: str) -> None:
    """Which topology a run or a server follows, and how (stderr)."""
    print(f"topology: {'learned v' + str(policy.version) if policy.version else 'untrained prior'}, {mode}",
          file=sys.stderr)


def warn_sink_errors(n: int) -> None:
    """A warning line when sinks failed to write events (the run's files may be incomplete)."""
    if n:
        print(f"warning: {n} events could not be written by a sink (run store, metrics.jsonl or progress); "
              "check the disk: the run's files may be incomplete", file=sys.stderr)


def warnings_as_lines() -> None:
    """masgraph's own warnings (a task whose test items were left out, ...) print as one `warning:` line on stderr,
    not Python's 'file:line: Category: ...' with the source line; other warnings are shown as Python shows them."""
    import warnings

    from masgraph.tasks import TaskSplitWarning

    # transformers >= 5.24 warns that `past_key_values` (which masgraph's hf backend passes) goes in 5.40, inside the
    # progress bar; pyproject keeps transformers below 5.40, so the warning says nothing a user can act on
    warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
    shown = warnings.showwarning
    if getattr(shown, "masgraph", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (warnings' signature)
        if issubclass(category, TaskSplitWarning):
            print(f"warning: {message}", file=file or sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show.masgraph = True  # type: ignore[attr-defined]
    warnings.showwarning = show
