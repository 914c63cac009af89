"""One registry per concept — agents, tools, backends, embedded models, training algorithms — passed to
whatever compiles, runs or trains a graph.

The core registers its own backends and models; everything else arrives through plugins: the
`masgraph.plugins` entry points (`masgraph.agents` registers the built-in role agents and tools,
`masgraph.trainers` the algorithms) and the modules a graph names in `plugins:`. The core never imports
`masgraph.agents` or `masgraph.trainers` itself (tests/unit/core/test_layering.py checks it).

Example:
    >>> reg = Registry()                                  # empty: for tests
    >>> reg.agents["echo"] = lambda ctx: NodeOutput(text=ctx.query)
    >>> default_registry().backends["hf"].returns_tokens
    True
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from masgraph.errors import MasgraphError, Problem, shorten
from masgraph.tools import ToolKind

if TYPE_CHECKING:
    from masgraph.backends.base import Backend
    from masgraph.node import Agent
    from masgraph.spec import GraphSpec, PolicySpec

PLUGIN_GROUP = "masgraph.plugins"
"""Entry-point group: each entry is a `register(registry)` function."""


@dataclass(frozen=True)
class BackendKind:
    """A registered backend and what it can do (read by the compile checks)."""

    name: str
    factory: Callable[..., Backend]
    """(policy spec, **options) -> a backend instance; options are the run's batching/determinism settings."""
    returns_tokens: bool
    """Returns prompt/completion token ids and per-token logprobs (needed by trainable policies)."""
    local_models: bool = False
    """Its `model:` must be installed on this machine (checked at compile unless told not to)."""
    options: tuple[str, ...] = ()
    """Which run options (deterministic, max_batch_size, batch_wait_ms, seed) its factory takes."""
    for_learner: Callable[..., Backend] | None = None
    """(policy spec or None, learner, deterministic=, seed=, log_dir=, max_lora_rank=, max_batch_size=, replica=,
    weights=) -> a backend serving the learner's adapters to training rollouts (`masgraph.serving`); a factory takes
    the keywords it needs and `**kwargs` for the rest; None: this kind cannot serve a learner."""


@dataclass(frozen=True)
class Algorithm:
    """A registered training algorithm: its `train:` section model, its compile checks and its trainer."""

    name: str
    config: type[BaseModel]
    """The `train:` section model (with `algorithm: Literal[name]`)."""
    check: Callable[[GraphSpec, Registry], list[Problem]]
    """Extra compile checks of a graph trained with it (trainable policies, adapters, ...)."""
    trainer: Callable[[], Any]
    """Returns the training loop class (imported lazily: validating a graph must not import torch); it is called
    as `trainer(graph, task, run_dir, dtype=..., sinks=..., ray=...)` and builds the algorithm below."""
    implementation: Callable[[], Any] | None = None
    """Returns the algorithm class the loop drives (lazily, as `trainer`): for masgraph's own loop, a
    `masgraph.trainers.algorithm.TrainAlgorithm`."""


@dataclass
class Registry:
    """Everything a graph may name, by name. Build an empty one for tests, or use `default_registry()`."""

    agents: dict[str, Agent] = field(default_factory=dict)
    """Node bodies: a role's built-in agent under the role name, custom agents under theirs."""
    tools: dict[str, ToolKind] = field(default_factory=dict)
    backends: dict[str, BackendKind] = field(default_factory=dict)
    prompts: set[str] = field(default_factory=set)
    """Names of the prompt templates a node's `prompt:` may name."""
    judge_prompts: dict[str, Callable[[str, list[str], str], list[dict[str, str]]]] = field(default_factory=dict)
    """Judge prompt name (a judge's `prompt:`) -> (question, reference answers, response) -> chat messages."""
    models: dict[str, str] = field(default_factory=dict)
    """Embedded model names -> a one-line description (resolved by masgraph.model)."""
    algorithms: dict[str, Algorithm] = field(default_factory=dict)
    default_algorithm: str | None = None
    """The algorithm of a `train:` section that names none."""
    _plugins: set[str] = field(default_factory=set)

    def load_plugins(self, names: Sequence[str], base: str | Path | None = None) -> list[Problem]:
        """Import the modules a graph's `plugins:` names (once each); a module with `register(registry)` gets
        it called. Returns one located problem per plugin that cannot be imported."""
        problems = []
        for i, name in enumerate(names):
            try:
                self._load_plugin(name, Path(base) if base is not None else Path.cwd())
            except Exception as exc:  # anything a user module raises on import
                problems.append(Problem(f"plugins[{i}]", f"cannot load plugin {shorten(name)!r}: "
                                        f"{type(exc).__name__}: {shorten(str(exc), 200)}",
                                        "give a dotted module name importable here, or a .py file relative to "
                                        "the graph file"))
        return problems

    def _load_plugin(self, name: str, base: Path) -> None:
        if name.endswith(".py"):
            path = (base / name).resolve()
            key = plugin_module_name(path)
            if key in self._plugins:
                return
            with loading(self):
                module = sys.modules.get(key) or _exec_file(key, path)
        else:
            key = name
            if key in self._plugins:
                return
            with loading(self):
                module = importlib.import_module(name)
        for table, entry, obj in _RECORDED.get(module.__name__, ()):  # also when imported before, elsewhere
            getattr(self, table)[entry] = obj
        if callable(getattr(module, "register", None)):
            module.register(self)
        self._plugins.add(key)

    def algorithm(self, name: str) -> Algorithm:
        try:
            return self.algorithms[name]
        except KeyError:
            raise MasgraphError(f"training algorithm {name!r} is not registered; use one of "
                                f"{sorted(self.algorithms)}") from None

    def backend(self, policy: PolicySpec, options: dict[str, Any]) -> Backend:
        """A backend instance for a policy, given the run options its kind takes."""
        kind = self.backends.get(policy.backend)
        if kind is None:
            raise MasgraphError(f"backend {policy.backend!r} is not registered; use one of {sorted(self.backends)}")
        return kind.factory(policy, **{k: v for k, v in options.items() if k in kind.options})

    def agent_for(self, spec: GraphSpec, node: str) -> Agent:
        n = spec.nodes[node]
        try:
            return self.agents[n.agent or n.role]
        except KeyError:
            raise MasgraphError(f"nodes.{node}: agent {n.agent or n.role!r} is not in this registry; compile the "
                                "graph with the registry it is run with") from None

    def routes(self, spec: GraphSpec, node: str) -> set[str] | None:
        """Route labels a node can emit: its role's, unless a custom agent replaces the role's built-in one."""
        n = spec.nodes[node]
        if n.agent is not None and n.agent != n.role:
            return getattr(self.agents.get(n.agent), "routes", None)
        return n.routes(spec)


def register_core(registry: Registry) -> None:
    """The core's own entries: the embedded models (backends register through the `masgraph.plugins` entry
    point `backends`, masgraph.backends.kinds)."""
    from masgraph.model import EMBEDDED

    registry.models.update({name: f"embedded ({pip})" for name, (_, _, pip) in EMBEDDED.items()})


_DEFAULT: Registry | None = None
_LOADING: ContextVar[Registry | None] = ContextVar("masgraph_loading_registry", default=None)
_RECORDED: dict[str, list[tuple[str, str, Any]]] = {}
"""Module name -> what its decorators registered, replayed into every registry that loads it as a plugin."""


def default_registry() -> Registry:
    """The process-wide registry: the core's entries plus every installed `masgraph.plugins` entry point
    (built on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = registry = Registry()  # set first: an entry point's decorators may ask for it
        register_core(registry)
        with loading(registry):
            for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
                ep.load()(registry)
    return _DEFAULT


def current_registry() -> Registry:
    """Where decorators register: the registry loading a plugin right now, else the process-wide one."""
    return _LOADING.get() or default_registry()


@contextmanager
def loading(registry: Registry) -> Iterator[None]:
    token = _LOADING.set(registry)
    try:
        yield
    finally:
        _LOADING.reset(token)


def record(module: str, table: str, name: str, obj: Any) -> None:
    """Register `obj` under `name` in `table` ("agents" or "tools") of the current registry, and remember it for
    any other registry that later loads `module` as a plugin (a module runs once per process)."""
    getattr(current_registry(), table)[name] = obj
    _RECORDED.setdefault(module, []).append((table, name, obj))


def plugin_module_name(path: Path) -> str:
    """A stable module name for a plugin file (the same in every process, so its functions pickle)."""
    return f"masgraph_plugin_{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"


def _exec_file(key: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def reset_default_registry() -> None:
    """Forget the process-wide registry (tests: each starts from the installed plugins alone)."""
    global _DEFAULT
    _DEFAULT = None
