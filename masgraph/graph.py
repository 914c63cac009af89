"""Compile a GraphSpec into a frozen, structurally checked Graph; GraphBuilder is the Python front end."""

from __future__ import annotations

import difflib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib.resources import files
from pathlib import Path
from typing import Any

import networkx as nx
from pydantic import ValidationError

from masgraph.errors import Problem, SpecError, one_of, shorten
from masgraph.loader import locate, problems_from
from masgraph.spec import EdgeSpec, GraphSpec, NodeSpec

# Backends that return the token ids and per-token logprobs an RL trainer needs.
TOKEN_BACKENDS = frozenset({"hf", "scripted"})
EMBEDDED_MODELS = frozenset({"smollm2-135m"})


@dataclass(frozen=True)
class Graph:
    """A validated graph: the spec plus its edge indexes and loop structure. Build with `compile_spec`."""

    spec: GraphSpec

    @cached_property
    def nx(self) -> nx.MultiDiGraph:
        """A networkx view of the graph (built on first use; edges carry their `when`)."""
        g = nx.MultiDiGraph()
        g.add_nodes_from(self.spec.nodes)
        g.add_edges_from((e.source, e.target, {"when": e.when}) for e in self.spec.edges)
        return g

    @cached_property
    def cycle_of(self) -> dict[str, int]:
        """Node -> index of its cycle (strongly connected component with a loop); acyclic nodes absent."""
        return cycle_index(self.spec.nodes, self.spec.edges)

    @cached_property
    def _edges_from(self) -> dict[str, list[EdgeSpec]]:
        return _index(self.spec.nodes, self.spec.edges, "source")

    @cached_property
    def _edges_into(self) -> dict[str, list[EdgeSpec]]:
        return _index(self.spec.nodes, self.spec.edges, "target")

    def out_edges(self, node: str) -> list[EdgeSpec]:
        """Edges leaving `node`, in spec order."""
        return self._edges_from[node]

    def in_edges(self, node: str) -> list[EdgeSpec]:
        """Edges entering `node`, in spec order."""
        return self._edges_into[node]

    def leaves_cycle(self, edge: EdgeSpec) -> bool:
        """Whether the edge goes from a node on a cycle to a node off that cycle."""
        c = self.cycle_of.get(edge.source)
        return c is not None and self.cycle_of.get(edge.target) != c


def _index(nodes: Mapping[str, Any], edges: Sequence[EdgeSpec], end: str) -> dict[str, list[EdgeSpec]]:
    out: dict[str, list[EdgeSpec]] = {n: [] for n in nodes}
    for e in edges:
        out[getattr(e, end)].append(e)
    return out


def cycle_index(nodes: Mapping[str, Any], edges: Sequence[EdgeSpec]) -> dict[str, int]:
    """Node -> index of its cycle: strongly connected components with a loop (Tarjan, iterative, linear).

    Every edge end must be one of `nodes` (`check_structure` reports those that are not).
    """
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    order: dict[str, int] = {}  # visit order
    low: dict[str, int] = {}  # lowest visit order reachable through the node's subtree
    stack: list[str] = []
    on_stack: set[str] = set()
    work: list[tuple[str, Any]] = []  # the depth-first path: (node, iterator over its successors)
    out: dict[str, int] = {}
    cycles = 0

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(succ[node])))

    for start in nodes:
        if start not in order:
            visit(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in order:
                    visit(nxt)
                elif nxt in on_stack:
                    low[node] = min(low[node], order[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:  # node roots a component: pop it off the stack
                comp = [stack.pop()]
                while comp[-1] != node:
                    comp.append(stack.pop())
                on_stack.difference_update(comp)
                if len(comp) > 1 or node in succ[node]:
                    out.update((m, cycles) for m in comp)
                    cycles += 1
    return out


def check_structure(nodes: Mapping[str, NodeSpec], edges: Sequence[EdgeSpec], entry: str, exit: str,
                    max_turns: int | None = None, max_steps: int | None = None) -> list[Problem]:
    """Structural rules of a graph, or of any sub-graph of it (a set of its nodes and edges).

    Pure and linear in nodes + edges: every edge end is a node, every node is reachable from the entry and the
    exit within `max_steps` steps, every cycle has a conditional exit and a `max_turns` bound, and every fan-in
    node has a merge rule. `compile_spec` runs it on the whole spec.

    Example:
        >>> spec = load_spec("graphs/agentflow.yaml")
        >>> active = [e for e in spec.edges if e.when != "continue"]  # the same graph without its loop
        >>> check_structure(spec.nodes, active, spec.entry, spec.exit, spec.limits.max_turns)
        []
    """
    problems = _dangling(nodes, edges, entry, exit)
    if problems:
        return problems
    return (_reach_problems(nodes, edges, entry, exit, max_steps) + _cycle_problems(nodes, edges, max_turns)
            + _merge_problems(nodes, edges))


def _dangling(nodes: Mapping[str, NodeSpec], edges: Sequence[EdgeSpec], entry: str, exit: str) -> list[Problem]:
    ends = [("entry", entry), ("exit", exit)]
    ends += [(f"edges[{i}].{end}", getattr(e, end)) for i, e in enumerate(edges) for end in ("source", "target")]
    return [Problem(path, f"{shorten(name)!r} is not a node", f"use one of {one_of(nodes)}")
            for path, name in ends if name not in nodes]


def _reach_problems(nodes: Mapping[str, NodeSpec], edges: Sequence[EdgeSpec], entry: str, exit: str,
                    max_steps: int | None) -> list[Problem]:
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    dist, queue = {entry: 0}, deque([entry])
    while queue:  # breadth-first: dist = fewest edges from the entry
        node = queue.popleft()
        for nxt in succ[node]:
            if nxt not in dist:
                dist[nxt] = dist[node] + 1
                queue.append(nxt)
    problems = [Problem(f"nodes.{name}", f"node is not reachable from entry {shorten(entry)!r}",
                        f"add an edge into {shorten(name)!r} or remove the node") for name in nodes if name not in dist]
    if exit not in dist:
        problems.append(Problem("exit", f"exit {shorten(exit)!r} is not reachable from entry {shorten(entry)!r}",
                                "add edges that lead from the entry to the exit"))
    elif max_steps is not None and dist[exit] + 1 > max_steps:
        steps = dist[exit] + 1
        problems.append(Problem("limits.max_steps", f"the shortest path from entry {shorten(entry)!r} to exit "
                                f"{shorten(exit)!r} takes {steps} steps, more than max_steps={max_steps}",
                                f"set `limits: {{max_steps: {steps}}}` or more, or shorten the path"))
    return problems


def _cycle_problems(nodes: Mapping[str, NodeSpec], edges: Sequence[EdgeSpec], max_turns: int | None) -> list[Problem]:
    cycle_of = cycle_index(nodes, edges)
    members: dict[int, list[str]] = {}
    for n, c in cycle_of.items():
        members.setdefault(c, []).append(n)
    exits_when = {c: False for c in members}
    for e in edges:
        c = cycle_of.get(e.source)
        if c is not None and cycle_of.get(e.target) != c:
            exits_when[c] |= e.when is not None
    problems = []
    for c, names in members.items():
        loop = " -> ".join(shorten(n) for n in sorted(names)[:10])
        loop += f" ... ({len(names)} in all)" if len(names) > 10 else ""
        if not exits_when[c]:
            problems.append(Problem("edges", f"cycle [{loop}] has no conditional exit edge",
                                    "add an edge leaving the cycle with `when:` (e.g. verifier -> generator "
                                    "when: stop)"))
        if max_turns is None:
            problems.append(Problem("limits.max_turns", f"cycle [{loop}] is unbounded",
                                    "set `limits: {max_turns: N}` (AgentFlow trains with 3)"))
    return problems


def _merge_problems(nodes: Mapping[str, NodeSpec], edges: Sequence[EdgeSpec]) -> list[Problem]:
    sources: dict[str, set[str]] = {}
    for e in edges:
        if e.when is None and e.source != e.target:
            sources.setdefault(e.target, set()).add(e.source)
    return [Problem(f"nodes.{name}.merge", f"fan-in node has parallel inputs from {one_of(srcs)} but no merge rule",
                    "add `merge: concat` (or vote / first)")
            for name, srcs in sources.items() if len(srcs) > 1 and nodes[name].merge is None]


def compile_spec(spec: GraphSpec, file: str | None = None, check_models: bool = True) -> Graph:
    """Check the structural rules (reachability, bounded cycles, fan-in merges, trainable backends)."""
    problems = check_structure(spec.nodes, spec.edges, spec.entry, spec.exit, spec.limits.max_turns,
                               spec.limits.max_steps)
    problems += _policy_problems(spec, check_models) + _train_problems(spec) + _registry_problems(spec)
    if problems:
        raise SpecError(locate(problems, spec), file)
    return Graph(spec)


def _policy_problems(spec: GraphSpec, check_models: bool) -> list[Problem]:
    problems = []
    for pname, pol in spec.policies.items():
        if pol.trainable and pol.backend not in TOKEN_BACKENDS:
            problems.append(Problem(f"policies.{pname}.backend",
                                    f"trainable policy uses backend {pol.backend!r}, which returns no token "
                                    "ids/logprobs",
                                    f"use one of {sorted(TOKEN_BACKENDS)} or set trainable: false"))
        if check_models and pol.backend == "hf" and pol.model not in EMBEDDED_MODELS and not _is_dir(pol.model):
            problems.append(Problem(f"policies.{pname}.model", f"model {shorten(pol.model)!r} is not installed",
                                    f"use {min(EMBEDDED_MODELS)!r} (embedded) or a local HF model directory"))
    return problems


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):  # a name too long for the file system, or one holding a NUL byte
        return False


def _train_problems(spec: GraphSpec) -> list[Problem]:
    if spec.train is None:
        return []
    trainable = {n: p for n, p in spec.policies.items() if p.trainable}
    if not trainable:
        return [Problem("train", "the graph has a `train:` section but no trainable policy",
                        "set `trainable: true` (and an `adapter:`) on the policies to train")]
    problems = []
    adapters: dict[str, str] = {}
    for pname, pol in trainable.items():
        if pol.backend != "hf" or pol.adapter is None:
            problems.append(Problem(f"policies.{pname}", "a trained policy needs `backend: hf` and an `adapter:`",
                                    "give it its own adapter name, e.g. `adapter: " + pname + "`"))
        elif adapters.setdefault(pol.adapter, pname) != pname:
            problems.append(Problem(f"policies.{pname}.adapter", f"adapter {shorten(pol.adapter)!r} is also trained "
                                    f"by policy {shorten(adapters[pol.adapter])!r}",
                                    "give each trainable policy its own adapter"))
    return problems


def _registry_problems(spec: GraphSpec) -> list[Problem]:
    """Agents, routes, tool kinds (with their options) and prompt templates must exist."""
    from masgraph.agents.registry import AGENTS, known_routes, load_builtin_agents

    load_builtin_agents()
    out = []
    for name, node in spec.nodes.items():
        key = node.agent or node.role
        if key not in AGENTS:
            out.append(Problem(f"nodes.{name}.agent", f"agent {shorten(key)!r} is not registered",
                               f"use one of {sorted(AGENTS)} or register it with register_agent({shorten(key)!r})"))
    for i, e in enumerate(spec.edges):
        routes = known_routes(spec, e.source) if e.when is not None else None
        if routes is not None and e.when not in routes:
            fix = f"use one of {one_of(routes)}" if routes else f"drop `when:` ({shorten(e.source)!r} emits none)"
            out.append(Problem(f"edges[{i}].when", f"{shorten(e.source)!r} never emits route {shorten(e.when)!r}", fix))
    return out + _tool_problems(spec) + _prompt_problems(spec)


def _tool_problems(spec: GraphSpec) -> list[Problem]:
    """Each tool's kind is registered and its `options` validate against that kind's ToolOptions model."""
    from masgraph.agents.tools.registry import TOOL_KINDS, load_builtin_tools

    load_builtin_tools()
    out = []
    for name, tool in spec.tools.items():
        kind = TOOL_KINDS.get(tool.kind)
        if kind is None:
            out.append(Problem(f"tools.{name}.kind", f"tool kind {shorten(tool.kind)!r} is not registered",
                               f"use one of {sorted(TOOL_KINDS)} or register a function with register_tool"))
            continue
        try:
            kind.options.model_validate(tool.options)
        except ValidationError as exc:
            out += problems_from(exc, prefix=("tools", name, "options"), model=kind.options)
    return out


def _prompt_problems(spec: GraphSpec) -> list[Problem]:
    """A node's `prompt:` names a template file under masgraph/agents/prompts/ (the only place prompts load from)."""
    named = {n: node.prompt for n, node in spec.nodes.items() if node.prompt is not None}
    if not named:
        return []
    folder = files("masgraph.agents").joinpath("prompts")
    available = sorted(p.name.removesuffix(".txt") for p in folder.iterdir() if p.name.endswith(".txt"))
    out = []
    for name, prompt in named.items():
        if prompt not in available:
            close = difflib.get_close_matches(prompt[:100], available, n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"use one of {one_of(available)} or drop `prompt:`"
            out.append(Problem(f"nodes.{name}.prompt",
                               f"prompt {shorten(prompt)!r} is not a template under masgraph/agents/prompts/", fix))
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
            return GraphSpec.model_validate(doc, strict=True)
        except ValidationError as exc:
            raise SpecError(problems_from(exc), f"GraphBuilder({doc['name']!r})") from None

    def compile(self, check_models: bool = True) -> Graph:
        return compile_spec(self.spec(), f"GraphBuilder({self._doc['name']!r})", check_models)
