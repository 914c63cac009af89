"""The engine: a compiled graph made runnable — its backends, agents and tools built once and shared by
`masgraph run`, training rollouts, evaluation and (next) serving. Episodes start one at a time with unique ids
(`episode`), or many at once through a scheduler (`scheduler(...).run`)."""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from masgraph.backends.base import Backend, serves_adapters
from masgraph.events import Sink
from masgraph.graph import Graph, Topology
from masgraph.memory.conversations import ConversationStores
from masgraph.registry import Registry, default_registry
from masgraph.runtime.scheduler import EpisodeInput, Policy, Scheduler
from masgraph.spec import PolicySpec
from masgraph.streaming import CURRENT, AnswerStream
from masgraph.tools import build_tools, tool_descriptions
from masgraph.trace import TopologyChoice, Trace


@dataclass(frozen=True)
class BackendOptions:
    """How backends that batch (hf) serve: passed to the factories of the kinds that take them."""

    deterministic: bool = False
    """Bit-exact results whatever the concurrency: each row decodes alone, per-request seeds."""
    max_batch_size: int = 32
    """Most requests decoded together."""
    batch_wait_ms: float = 3.0
    """How long the batcher waits for more requests."""
    seed: int = 0
    """Seeds the backend's own sampling generator (requests from the scheduler carry their own seeds)."""
    log_dir: str | None = None
    """Where a backend that starts a server (vllm) keeps its log: the run dir."""


@runtime_checkable
class EngineLike(Protocol):
    """What a `Runner` needs of an engine: the local `Engine` and the Ray `RayEngine` both declare it, and one
    conformance suite (tests/unit/runtime/test_engine_conformance.py) runs against both.

    Example:
        >>> engine: EngineLike = Engine(graph)          # or RayEngine(graph, RayConfig(workers=2), options)
        >>> traces = asyncio.run(engine.scheduler(concurrency=8).run(episodes))
    """

    graph: Graph
    backends: dict[tuple, Any]
    """What serves the graph's policies, keyed by (backend, model, api_base, device) or by the worker pool."""
    policies: dict[str, Any]
    """The graph's policies bound to their backends in this process (none when episodes run elsewhere)."""
    in_process: bool
    """True when episodes run in this process, so its policies can serve other models' calls (a task's judge)."""

    def scheduler(self, sinks: Sequence[Sink] = (), score: Callable[[EpisodeInput, Trace], float] | None = None,
                  concurrency: int = 16, seed: int = 0, memo_greedy: bool = False) -> Any:
        """A scheduler for one run: `await scheduler.run(episodes)` -> traces, in order."""
        ...

    def load_checkpoint(self, path: str | Path) -> Path:
        """Serve the trained adapters of a checkpoint (a run dir -> its latest); the checkpoint's path."""
        ...

    def load_adapters(self, adapters: dict[str, Path]) -> None:
        """Serve these trained adapters (name -> PEFT directory)."""
        ...

    async def aclose(self) -> None: ...


class Engine(EngineLike):
    """Graph + backends + agents + tools (+ a checkpoint's adapters), built once.

    Backends are shared per (backend, model, api_base, device): every policy on the same model shares one instance
    (and, for hf, one set of weights with an adapter per trainable policy). `backends` passes instances in by
    kind name (e.g. a training run's backend, or a ScriptedBackend in tests).

    Example:
        >>> engine = Engine(compile_spec(load_spec("graphs/agentflow.yaml")))
        >>> trace = asyncio.run(engine.episode("What is 12 * 7 + 3?"))
        >>> trace.answer
    """

    in_process = True

    def __init__(self, graph: Graph, registry: Registry | None = None, backends: dict[str, Backend] | None = None,
                 options: BackendOptions | None = None):
        self.graph, self.registry = graph, registry or graph.registry or default_registry()
        self.options = options or BackendOptions()
        spec = graph.spec
        self.agents = {name: self.registry.agent_for(spec, name) for name in spec.nodes}
        self.tools = build_tools(self.registry.tools, spec.tools)
        self.tool_descriptions = tool_descriptions(self.registry.tools, spec.tools)
        self.backends: dict[tuple, Backend] = {}
        self.policies: dict[str, Policy] = {}
        self.conversations = ConversationStores()
        """Fact stores kept across the episodes of a conversation (in memory; `masgraph serve --conversations DIR`
        keeps them on disk)."""
        self._started = 0
        self._given = backends or {}
        for name, pol in spec.policies.items():
            self.policies[name] = self.policy(name, pol)
        if self.options.deterministic:  # bit-exact runs on a GPU need its repeatable kernels too
            from masgraph.device import deterministic_kernels

            for backend in self.backends.values():
                if getattr(backend, "device", None) is not None:
                    deterministic_kernels(backend.device)

    def policy(self, name: str, pol: PolicySpec) -> Policy:
        """`pol` bound to its backend: the one already serving its (backend, model, api_base, device, dtype), else a
        new one kept with the others (closed by `aclose`). The graph's policies are made so; so is a policy outside
        the graph, such as a task's judge (`masgraph.tasks.judge`), which then shares the graph's model when it names
        the same one."""
        key = (pol.backend, pol.model, pol.api_base, pol.device, pol.dtype)
        if key not in self.backends:
            self.backends[key] = self._given.get(pol.backend) or self.registry.backend(pol, vars(self.options))
        backend = self.backends[key]
        if pol.adapter and serves_adapters(backend) and not backend.has_adapter(pol.adapter):
            backend.add_adapter(pol.adapter)
        return Policy(name, pol, backend)

    def load_checkpoint(self, path: str | Path) -> Path:
        """Serve the trained adapters of a checkpoint (a run dir -> its latest, or RUN/checkpoints/step-N)."""
        from masgraph.rundir.checkpoint import checkpoint_adapters, resolve_checkpoint

        checkpoint = resolve_checkpoint(path)
        self.load_adapters(checkpoint_adapters(checkpoint, self.graph.spec))
        return checkpoint

    def load_adapters(self, adapters: dict[str, Path]) -> None:
        """Serve these trained adapters (name -> PEFT directory) in every backend that serves adapters."""
        for name, adapter_dir in adapters.items():
            for backend in self.backends.values():
                if serves_adapters(backend):
                    backend.load_adapter(name, str(adapter_dir))

    def scheduler(self, sinks: Sequence[Sink] = (), score: Callable[[EpisodeInput, Trace], float] | None = None,
                  concurrency: int = 16, seed: int = 0, memo_greedy: bool = False) -> Scheduler:
        """A scheduler over this engine's parts (cheap: build one per run, with that run's sinks)."""
        return Scheduler(self.graph, self.agents, self.policies, self.tools, sinks, concurrency=concurrency,
                         seed=seed, score=score, tool_descriptions=self.tool_descriptions,
                         conversations=self.conversations, memo_greedy=memo_greedy)

    async def episode(self, query: str, *, item_id: str | None = None, topology: Topology | None = None,
                      choice: TopologyChoice | None = None, sinks: Sequence[Sink] = (), seed: int = 0,
                      meta: dict[str, Any] | None = None, stream: AnswerStream | None = None,
                      sample: int | None = None, sampling: dict[str, dict[str, Any]] | None = None) -> Trace:
        """Run one episode now (concurrent calls batch their LLM calls together); its id is unique. `topology`
        is the sub-graph to run, `choice` the topology policy's decisions behind it (kept in the trace).
        `stream` receives the answer node's text as it decodes (see masgraph/streaming.py); it is closed when
        the episode ends. The calls' seeds derive from `seed`, `item_id` and `sample` (default: a fresh index,
        so repeated queries sample afresh); `sampling` replaces some nodes' sampling settings (EpisodeInput)."""
        episode_id = uuid.uuid4().hex[:16]
        self._started += 1
        ep = EpisodeInput(item_id or episode_id, query, sample=self._started if sample is None else sample,
                          meta=meta or {}, topology=topology, choice=choice, episode_id=episode_id, sampling=sampling)
        run = self.scheduler(sinks, seed=seed).run_episode(ep)
        if stream is None:
            return await run
        context = contextvars.copy_context()  # the episode's own: its backends' calls find the stream there
        context.run(CURRENT.set, stream)
        try:  # awaiting the task: cancelling this call cancels the episode
            return await asyncio.get_running_loop().create_task(run, context=context)
        finally:
            stream.close()

    async def aclose(self) -> None:
        for b in self.backends.values():
            await b.aclose()
