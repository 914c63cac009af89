"""Agents by registered name, resolved in one place (the graph's YAML never holds import strings)."""

from __future__ import annotations

from collections.abc import Callable

from masgraph.node import Agent
from masgraph.spec import GraphSpec

AGENTS: dict[str, Agent] = {}


def register_agent(name: str) -> Callable[[Agent], Agent]:
    """Register a `(NodeContext) -> NodeOutput` function under `name` (used as `agent:` in YAML).

    Write it as `async def` and await anything slow. A plain `def` (CPU work, `time.sleep`, blocking I/O) is
    run in a worker thread, so other episodes go on and its node timeout holds; it cannot await
    `ctx.generate` or the tools, and on timeout its thread is abandoned, not stopped. An `async def` that blocks
    inside (`time.sleep`, `requests.get`) stalls every episode and its timeout cannot fire: nothing can
    preempt it, so move such work into `await asyncio.to_thread(...)`.
    """
    def deco(fn: Agent) -> Agent:
        AGENTS[name] = fn
        return fn
    return deco


def load_builtin_agents() -> None:
    from masgraph.agents import executor, generator, memory, planner, verifier  # noqa: F401 (they register)


def resolve_agents(spec: GraphSpec) -> dict[str, Agent]:
    """The body of every node: its `agent:` if set, else its role's built-in agent (checked at compile)."""
    load_builtin_agents()
    return {name: AGENTS[node.agent or node.role] for name, node in spec.nodes.items()}


def known_routes(spec: GraphSpec, node: str) -> set[str] | None:
    """The route labels a built-in node can emit (for checking edges' `when`); None when unknown (custom)."""
    n = spec.nodes[node]
    if n.agent is not None and n.agent != n.role:
        return None
    return {
        "planner": set(n.tools or spec.tools) | {"answer"} if n.role == "planner" else set(),
        "executor": {"ok", "error"},
        "verifier": {"stop", "continue"},
        "generator": {"answer"},
        "memory": set(),
    }.get(n.role)
