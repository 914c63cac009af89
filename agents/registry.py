"""Registering agents: the built-in role agents, and user agents by name. A graph names the modules that register
its agents under `plugins:` (so loading a graph imports them: validate only graphs you trust)."""

from __future__ import annotations

from collections.abc import Callable

from masgraph.node import Agent
from masgraph.registry import Registry, default_registry, record
from masgraph.spec import GraphSpec

BUILTIN_AGENTS: dict[str, Agent] = {}
"""The role agents (planner, executor, verifier, generator, memory), registered by `masgraph.agents.register`."""


def builtin_agent(role: str) -> Callable[[Agent], Agent]:
    """Mark a function as the built-in agent of a role."""
    def deco(fn: Agent) -> Agent:
        BUILTIN_AGENTS[role] = fn
        return fn
    return deco


def register_agent(name: str, registry: Registry | None = None,
                   routes: set[str] | None = None) -> Callable[[Agent], Agent]:
    """Register a `(NodeContext) -> NodeOutput` function under `name` (used as `agent:` in YAML), in `registry`
    (default: the registry loading this module as a plugin, else the process's). `routes`: the route labels it
    emits, so edges' `when:` can be checked.

    Write it as `async def` and await anything slow. A plain `def` (CPU work, `time.sleep`, blocking I/O) is
    run in a worker thread, so other episodes go on and its node timeout holds; it cannot await
    `ctx.generate` or the tools, and on timeout its thread is abandoned, not stopped. An `async def` that blocks
    inside (`time.sleep`, `requests.get`) stalls every episode and its timeout cannot fire: nothing can
    preempt it, so move such work into `await asyncio.to_thread(...)`.

    A graph that uses it names the module that registers it under `plugins:`, so any process that loads the
    graph (a server, a worker) registers it too.
    """
    def deco(fn: Agent) -> Agent:
        if routes is not None:
            fn.routes = frozenset(routes)  # type: ignore[attr-defined]
        if registry is not None:
            registry.agents[name] = fn
        else:  # the registry loading this module as a plugin (else the process's); replayed for others
            record(fn.__module__, "agents", name, fn)
        return fn
    return deco


def resolve_agents(spec: GraphSpec, registry: Registry | None = None) -> dict[str, Agent]:
    """The body of every node: its `agent:` if set, else its role's built-in agent (checked at compile)."""
    registry = registry or default_registry()
    return {name: registry.agent_for(spec, name) for name in spec.nodes}
