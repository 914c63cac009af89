"""Finding a task by reference: a registered name, `FILE.py:ClassName`, or `data:PATH`."""

from __future__ import annotations

import sys
from pathlib import Path

from masgraph.errors import MasgraphError
from masgraph.tasks import builtin as _builtin  # noqa: F401  (registers the built-in tasks)
from masgraph.tasks.base import TASKS, Task
from masgraph.tasks.data import load_data_task


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise MasgraphError(f"unknown task {name!r}; built-in: {', '.join(sorted(TASKS))} (or FILE.py:ClassName, or "
                            "data:FILE.jsonl / data:TASK.yaml)")
    return TASKS[name]()


def resolve_task(ref: str) -> Task:
    """The task a `--task` / `train.task` value names: `data:PATH` (a data or task file, masgraph/datatask.py),
    `FILE.py:ClassName`, or a registered name."""
    if ref.startswith("data:"):
        task: Task = load_data_task(ref.removeprefix("data:"))
        task.ref = f"data:{Path(ref.removeprefix('data:')).resolve()}"  # loadable again from another directory
        return task
    if ":" not in ref:
        return get_task(ref)
    task = load_task_file(ref)
    path, _, cls_name = ref.rpartition(":")
    task.ref = f"{Path(path).resolve()}:{cls_name}"
    return task


def load_task_file(ref: str) -> Task:
    """A user Task subclass from `path/to/file.py:ClassName`; every way it can fail is a MasgraphError."""
    import importlib.util

    path, _, cls_name = ref.rpartition(":")
    if not path or not cls_name:
        raise MasgraphError(f"task {ref!r}: expected FILE.py:ClassName, e.g. mytasks.py:MyTask")
    if not Path(path).is_file():
        raise MasgraphError(f"task file {path!r} not found; pass an existing FILE.py:ClassName")
    spec = importlib.util.spec_from_file_location(f"masgraph_user_task_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise MasgraphError(f"task file {path!r} is not a Python module; pass a .py file as FILE.py:ClassName")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look a class's module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report where it failed, not our traceback
        del sys.modules[spec.name]
        raise MasgraphError(f"task file {path!r} failed to import: {type(exc).__name__}: {exc}{_where(exc, path)}; "
                            f"fix the file (run `python {path}` to see the full traceback)") from exc
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        what = ("it is not defined there" if cls is None else "it is not a class" if not isinstance(cls, type)
                else "the class does not subclass Task")
        found = [k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Task) and v is not Task]
        fix = f"name one of: {', '.join(found)}" if found else "subclass Task and implement generate() and score()"
        raise MasgraphError(f"{ref}: {cls_name!r} is not a masgraph.tasks.Task subclass in {path} ({what}); {fix}")
    try:
        return cls()
    except Exception as exc:
        raise MasgraphError(f"{ref}: {cls_name}() failed: {type(exc).__name__}: {exc}") from exc


def _where(exc: BaseException, path: str) -> str:
    """' (line N)' of the innermost traceback frame in the user's file, if any."""
    tb, line = exc.__traceback__, None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == Path(path).resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None and isinstance(exc, SyntaxError) and exc.lineno:
        line = exc.lineno
    return f" (line {line})" if line else ""
