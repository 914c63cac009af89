"""masgraph: multi-agent LLM systems as declarative graphs, run concurrently and trained with RL."""

import os as _os
from os import PathLike as _PathLike
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Literal as _Literal

from masgraph._version import __version__ as __version__
from masgraph.threads import configure_wait as _configure_wait

# Some VMs advertise AMX but trap on its instructions (SIGILL inside oneDNN bf16 matmuls, seen on
# this project's machines); capping oneDNN at AVX512-BF16 keeps bf16 working everywhere.
_os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
# cuBLAS gives repeatable results only with a fixed workspace, which must be chosen before CUDA starts; the
# deterministic mode on a GPU needs it (masgraph.device.deterministic_kernels). No effect without a GPU.
_os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# How torch's CPU threads wait (a short spin, or the user's choice) is read once, when libgomp loads: this must come
# before torch is imported (masgraph/threads.py; the thread count then follows the machine's load).
_configure_wait()

if _TYPE_CHECKING:
    from masgraph.serve.agent import Agent

_PUBLIC = {
    "GraphBuilder": "masgraph.graph", "Graph": "masgraph.graph", "compile_spec": "masgraph.graph",
    "load_spec": "masgraph.loader", "GraphSpec": "masgraph.spec",
    "Engine": "masgraph.runtime.engine", "EngineLike": "masgraph.runtime.engine",
    "Runner": "masgraph.runtime.runner", "RunConfig": "masgraph.runtime.runner",
    "Task": "masgraph.tasks", "Item": "masgraph.tasks", "get_task": "masgraph.tasks", "register_task": "masgraph.tasks",
    "Trace": "masgraph.trace", "Step": "masgraph.trace",
}
"""The public face: `from masgraph import Runner, RunConfig, Engine, GraphBuilder, ...`, each imported on first use
(importing masgraph loads neither torch nor a task library)."""

__all__ = [*_PUBLIC, "load_agent", "__version__"]


def __getattr__(name: str):  # noqa: ANN202
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'masgraph' has no attribute {name!r}")


def load_agent(source: str | _PathLike[str], checkpoint: str | _PathLike[str] | None = None,
               topology: _Literal["greedy", "sample"] | None = None, deterministic: bool = False) -> "Agent":
    """A deployable agent from a bundle (`masgraph export`) or a graph YAML file (and a training run's checkpoint):
    `agent.ask(question)` → answer and trace; `await agent.aask(question)` from async code. See
    `masgraph.serve.agent.load_agent`."""
    from masgraph.serve.agent import load_agent as _load

    return _load(source, checkpoint, topology, deterministic)
