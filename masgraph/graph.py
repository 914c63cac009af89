"""Compile a GraphSpec into a frozen, structurally checked Graph; GraphBuilder is the Python front end."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx
from pydantic import ValidationError

from masgraph.errors import Problem, SpecError
from masgraph.loader import problems_from
from masgraph.spec import EdgeSpec, GraphSpec

# Backends that return the token ids and per-token logprobs an RL trainer needs.
TOKEN_BACKENDS = frozenset({"hf", "scripted"})
EMBEDDED_MODELS = frozenset({"smollm2-135m"})


@dataclass(frozen=True)
class Graph:
    """A validated graph: the spec plus its networkx view and loop structure. Build with `compile_spec`."""

    spec: GraphSpec
    nx: nx.MultiDiGraph = field(repr=False)

    @cached_property
    def cycle_of(self) -> dict[str, int]:
        """Node -> index of its cycle (strongly connected component with a loop); acyclic nodes absent."""
        out = {}
        for i, comp in enumerate(nx.strongly_connected_components(self.nx)):
            if len(comp) > 1 or any(self.nx.has_edge(n, n) for n in comp):
                out.update({n: i for n in comp})
        return out

    def out_edges(self, node: str) -> list[EdgeSpec]:
        return [e for e in self.spec.edges if e.source == node]

    def in_edges(self, node: str) -> list[EdgeSpec]:
        return [e for e in self.spec.edges if e.target == node]

    def leaves_cycle(self, edge: EdgeSpec) -> bool:
        c = self.cycle_of.get(edge.source)
        return c is not None and self.cycle_of.get(edge.target) != c


def compile_spec(spec: GraphSpec, file: str | None = None, check_models: bool = True) -> Graph:
    """Check the structural rules (reachability, bounded cycles, fan-in merges, trainable backends)."""
    g = nx.MultiDiGraph()
    g.add_nodes_from(spec.nodes)
    g.add_edges_from((e.source, e.target, {"when": e.when}) for e in spec.edges)
    graph = Graph(spec, g)
    problems: list[Problem] = []

    reachable = nx.descendants(g, spec.entry) | {spec.entry}
    for name in spec.nodes:
        if name not in reachable:
            problems.append(Problem(f"nodes.{name}", f"node is not reachable from entry {spec.entry!r}",
                                    f"add an edge into {name!r} or remove the node"))
    if spec.exit not in reachable:
        problems.append(Problem("exit", f"exit {spec.exit!r} is not reachable from entry {spec.entry!r}",
                                "add edges that lead from the entry to the exit"))

    cycles: dict[int, set[str]] = {}
    for n, c in graph.cycle_of.items():
        cycles.setdefault(c, set()).add(n)
    for members in cycles.values():
        loop = " -> ".join(sorted(members))
        exits = [e for e in spec.edges if e.source in members and e.target not in members]
        if not any(e.when is not None for e in exits):
            problems.append(Problem("edges", f"cycle [{loop}] has no conditional exit edge",
                                    "add an edge leaving the cycle with `when:` (e.g. verifier -> generator when: stop)"))
        if spec.limits.max_turns is None:
            problems.append(Problem("limits.max_turns", f"cycle [{loop}] is unbounded",
                                    "set `limits: {max_turns: N}` (AgentFlow trains with 3)"))

    for name, node in spec.nodes.items():
        sources = {e.source for e in graph.in_edges(name) if e.when is None and e.source != name}
        if len(sources) > 1 and node.merge is None:
            problems.append(Problem(f"nodes.{name}.merge",
                                    f"fan-in node has parallel inputs from {sorted(sources)} but no merge rule",
                                    "add `merge: concat` (or vote / first)"))

    for pname, pol in spec.policies.items():
        if pol.trainable and pol.backend not in TOKEN_BACKENDS:
            problems.append(Problem(f"policies.{pname}.backend",
                                    f"trainable policy uses backend {pol.backend!r}, which returns no token ids/logprobs",
                                    f"use one of {sorted(TOKEN_BACKENDS)} or set trainable: false"))
        if check_models and pol.backend == "hf" and pol.model not in EMBEDDED_MODELS and not Path(pol.model).is_dir():
            problems.append(Problem(f"policies.{pname}.model", f"model {pol.model!r} is not installed",
                                    f"use {sorted(EMBEDDED_MODELS)[0]!r} (embedded) or a local HF model directory"))

    if spec.train is not None:
        trainable = {n: p for n, p in spec.policies.items() if p.trainable}
        if not trainable:
            problems.append(Problem("train", "the graph has a `train:` section but no trainable policy",
                                    "set `trainable: true` (and an `adapter:`) on the policies to train"))
        adapters: dict[str, str] = {}
        for pname, pol in trainable.items():
            if pol.backend != "hf" or pol.adapter is None:
                problems.append(Problem(f"policies.{pname}", "a trained policy needs `backend: hf` and an `adapter:`",
                                        "give it its own adapter name, e.g. `adapter: " + pname + "`"))
            elif adapters.setdefault(pol.adapter, pname) != pname:
                problems.append(Problem(f"policies.{pname}.adapter", f"adapter {pol.adapter!r} is also trained by "
                                        f"policy {adapters[pol.adapter]!r}", "give each trainable policy its own adapter"))
    problems += _registry_problems(spec)
    if problems:
        raise SpecError(problems, file)
    return graph


def _registry_problems(spec: GraphSpec) -> list[Problem]:
    """Agents and tool kinds must be registered (built-ins, or user code imported before compile)."""
    from masgraph.agents.registry import AGENTS, known_routes, load_builtin_agents
    from masgraph.agents.tools.registry import TOOL_KINDS, load_builtin_tools

    load_builtin_agents()
    load_builtin_tools()
    out = []
    for name, node in spec.nodes.items():
        key = node.agent or node.role
        if key not in AGENTS:
            out.append(Problem(f"nodes.{name}.agent", f"agent {key!r} is not registered",
                               f"use one of {sorted(AGENTS)} or register it with register_agent({key!r})"))
    for i, e in enumerate(spec.edges):
        routes = known_routes(spec, e.source) if e.when is not None else None
        if routes is not None and e.when not in routes:
            out.append(Problem(f"edges[{i}].when", f"{e.source!r} never emits route {e.when!r}",
                               f"use one of {sorted(routes)}" if routes else f"drop `when:` ({e.source!r} emits none)"))
    for name, tool in spec.tools.items():
        if tool.kind not in TOOL_KINDS:
            out.append(Problem(f"tools.{name}.kind", f"tool kind {tool.kind!r} is not registered",
                               f"use one of {sorted(TOOL_KINDS)} or register a function with register_tool"))
    return out


class GraphBuilder:
    """Build the same GraphSpec as a YAML file, from Python.

    Example:
        >>> graph = (GraphBuilder("direct")
        ...          .add_policy("main", backend="scripted")
        ...          .add_node("answer", role="generator", policy="main")
        ...          .compile())
        >>> graph.spec.entry
        'answer'
    """

    def __init__(self, name: str, description: str = ""):
        self._doc: dict[str, Any] = {"name": name, "description": description, "policies": {}, "tools": {},
                                     "nodes": {}, "edges": []}

    def add_policy(self, name: str, **fields: Any) -> GraphBuilder:
        self._doc["policies"][name] = fields
        return self

    def add_tool(self, name: str, kind: str, **fields: Any) -> GraphBuilder:
        self._doc["tools"][name] = {"kind": kind, **fields}
        return self

    def add_node(self, name: str, role: str, **fields: Any) -> GraphBuilder:
        """Add a node; the first node added is the entry and the last the exit unless set otherwise."""
        self._doc["nodes"][name] = {"role": role, **fields}
        self._doc.setdefault("entry", name)
        return self

    def add_edge(self, source: str, target: str, when: str | None = None) -> GraphBuilder:
        self._doc["edges"].append({"source": source, "target": target, **({"when": when} if when else {})})
        return self

    def set(self, **sections: Any) -> GraphBuilder:
        """Set top-level sections: entry, exit, memory, limits."""
        self._doc.update(sections)
        return self

    def spec(self) -> GraphSpec:
        doc = dict(self._doc)
        if self._doc["nodes"]:
            doc.setdefault("exit", list(self._doc["nodes"])[-1])
        try:
            return GraphSpec.model_validate(doc)
        except ValidationError as exc:
            raise SpecError(problems_from(exc), f"GraphBuilder({doc['name']!r})") from None

    def compile(self, check_models: bool = True) -> Graph:
        return compile_spec(self.spec(), f"GraphBuilder({self._doc['name']!r})", check_models)
