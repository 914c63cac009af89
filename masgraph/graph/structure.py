"""A compiled graph (`Graph`, frozen) and the pure structure checks and algorithms on its nodes and edges."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

from masgraph.errors import Problem, one_of, shorten
from masgraph.registry import Registry
from masgraph.spec import EdgeSpec, GraphSpec, NodeSpec, node_fix


@dataclass(frozen=True)
class Topology:
    """The part of a graph one episode runs: the graph minus the nodes and edges switched off (edges by their
    index in `spec.edges`; a node switched off takes its edges with it). Hashable, so views are cached."""

    nodes_off: frozenset[str] = frozenset()
    edges_off: frozenset[int] = frozenset()
    prompts: tuple[tuple[str, str], ...] = ()
    """(node, prompt template) pairs: the prompt each slot node runs with in this episode (sorted by node)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nodes_off": sorted(self.nodes_off), "edges_off": sorted(self.edges_off)}
        if self.prompts:
            out["prompts"] = dict(self.prompts)
        return out


@dataclass(frozen=True)
class GraphView:
    """What the scheduler reads of a graph or sub-graph, computed once per topology."""

    out_edges: dict[str, list[EdgeSpec]]
    """Active edges leaving each active node, in spec order."""
    cycle_of: dict[str, int]
    """Active node -> index of its cycle (only nodes on a cycle of the sub-graph)."""
    waits_for: dict[str, frozenset[str]]
    """Fan-in node -> the nodes that can still feed it in the same pass (see `live_branch_sources`)."""
    problems: list[Problem]
    """Structural problems of the sub-graph (empty for the compiled graph itself)."""

    def leaves_cycle(self, edge: EdgeSpec) -> bool:
        """Whether the edge goes from a node on a cycle to a node off that cycle."""
        c = self.cycle_of.get(edge.source)
        return c is not None and self.cycle_of.get(edge.target) != c


@dataclass(frozen=True)
class Graph:
    """A validated graph: the spec plus its edge indexes and loop structure. Build with `compile_spec`."""

    spec: GraphSpec
    registry: Registry | None = field(default=None, compare=False, repr=False)
    """The registry it was compiled against (what an Engine runs it with unless given another)."""

    def view(self, topology: Topology | None = None) -> GraphView:
        """The graph as one episode runs it: whole (`None`), or the sub-graph of a topology — the nodes still
        reachable from the entry over the edges left on — checked by the same pure rules as at compile time
        (exit reachable, cycles bounded, fan-ins merged; microseconds on the shipped graphs; cached)."""
        views = self._views
        found = views.get(topology)
        if found is None:
            found = views[topology] = self._make_view(topology)
        return found

    def problems_of(self, topology: Topology) -> list[Problem]:
        """Why a topology is not a valid sub-graph ([] when it is); not cached (enumerating a decision space
        checks thousands of them once)."""
        found = self._views.get(topology)
        return (found or self._make_view(topology)).problems

    @cached_property
    def _views(self) -> dict[Topology | None, GraphView]:
        return {}

    def _make_view(self, topology: Topology | None) -> GraphView:
        spec = self.spec
        if topology is None:
            nodes, edges, problems = spec.nodes, spec.edges, []
        else:
            off = topology.nodes_off
            bad = [Problem("topology", f"edge index {i} is not an edge of the graph", "") for i in
                   sorted(topology.edges_off) if not 0 <= i < len(spec.edges)]
            bad += [Problem("topology", f"node {shorten(n)!r} is not a node of the graph", "") for n in sorted(off)
                    if n not in spec.nodes]
            edges = [e for i, e in enumerate(spec.edges)
                     if i not in topology.edges_off and e.source not in off and e.target not in off]
            live = reachable(spec.entry, edges) if spec.entry not in off else set()
            nodes = {n: s for n, s in spec.nodes.items() if n in live}  # a node nothing leads to is off too
            edges = [e for e in edges if e.source in live]
            if not bad and spec.exit not in live:
                bad.append(Problem("topology", f"exit {shorten(spec.exit)!r} is not reachable from entry "
                                   f"{shorten(spec.entry)!r}", ""))
            bad += _dead_routes(spec.edges, nodes, edges, spec.exit)
            if bad:
                return GraphView({}, {}, {}, bad)
            problems = check_structure(nodes, edges, spec.entry, spec.exit, spec.limits.max_turns,
                                       spec.limits.max_steps)
            if problems:
                return GraphView({}, {}, {}, problems)
        return GraphView(_index(nodes, edges, "source"), cycle_index(nodes, edges),
                         live_branch_sources(nodes, edges, spec.entry), problems)

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


def _dead_routes(all_edges: Sequence[EdgeSpec], nodes: Mapping[str, Any], edges: Sequence[EdgeSpec],
                 exit: str) -> list[Problem]:
    """Route labels a sub-graph's node can emit (it has an edge for them in the whole graph) but no longer has an
    edge for, while no unconditional edge leaves it either: an episode routed there would stop dead."""
    labels: dict[str, set[str]] = {}
    for e in all_edges:
        if e.when is not None and e.source in nodes and e.source != exit:
            labels.setdefault(e.source, set()).add(e.when)
    kept: dict[str, set[str | None]] = {}
    for e in edges:
        kept.setdefault(e.source, set()).add(e.when)
    return [Problem("topology", f"node {shorten(n)!r} can route {label!r} but its edge for it is off", "")
            for n, ls in labels.items() if None not in kept.get(n, ()) for label in sorted(ls - kept.get(n, set()))]


def reachable(entry: str, edges: Sequence[EdgeSpec]) -> set[str]:
    """The nodes the entry reaches over `edges` (itself included)."""
    succ: dict[str, list[str]] = {}
    for e in edges:
        succ.setdefault(e.source, []).append(e.target)
    seen, stack = {entry}, [entry]
    while stack:
        for nxt in succ.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


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


def cycle_path(component: Sequence[str], edges: Sequence[EdgeSpec]) -> list[str]:
    """One cycle of a strongly connected component as the path it takes, first node repeated at the end
    (`a -> b -> a`): the shortest cycle through the component's first node (in `component`'s order)."""
    members = set(component)
    succ: dict[str, list[str]] = {n: [] for n in component}
    for e in edges:
        if e.source in members and e.target in members:
            succ[e.source].append(e.target)
    start = component[0]
    if start in succ[start]:
        return [start, start]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:  # breadth-first from start, back to start
        node = queue.popleft()
        for nxt in succ[node]:
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent and nxt != start:
                parent[nxt] = node
                queue.append(nxt)
    return [*component, component[0]]  # not a cycle (never for a component cycle_index returns)


def live_branch_sources(nodes: Mapping[str, Any], edges: Sequence[EdgeSpec], entry: str) -> dict[str, frozenset[str]]:
    """Fan-in node -> the nodes that can still feed it in the same pass: its ancestors once each loop's back edge
    is cut, so a join inside a loop never waits for its own next turn. Linear in nodes + edges per fan-in."""
    sources: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target:
            sources.setdefault(e.target, set()).add(e.source)
    fan_in = [n for n, srcs in sources.items() if len(srcs) > 1]
    if not fan_in:
        return {}
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    back = back_edges(entry, succ)
    pred: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        if (e.source, e.target) not in back:
            pred[e.target].append(e.source)
    out = {}
    for n in fan_in:
        seen: set[str] = set()
        stack = list(pred[n])
        while stack:
            m = stack.pop()
            if m not in seen:
                seen.add(m)
                stack.extend(pred[m])
        out[n] = frozenset(seen)
    return out


def back_edges(entry: str, succ: Mapping[str, Sequence[str]]) -> set[tuple[str, str]]:
    """Edges into a node still on the depth-first stack from the entry (in edge order): the loops' back edges."""
    on_stack, done, back = {entry}, set(), set()
    stack = [(entry, iter(succ[entry]))]
    while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            on_stack.discard(node)
            done.add(node)
        elif nxt in on_stack:
            back.add((node, nxt))
        elif nxt not in done:
            on_stack.add(nxt)
            stack.append((nxt, iter(succ[nxt])))
    return back


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
    return [Problem(path, f"{shorten(name)!r} is not a node", node_fix(name, nodes))
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
    for n in nodes:  # in the file's order, so a cycle's path starts at its first node there
        if n in cycle_of:
            members.setdefault(cycle_of[n], []).append(n)
    exits_when = {c: False for c in members}
    for e in edges:
        c = cycle_of.get(e.source)
        if c is not None and cycle_of.get(e.target) != c:
            exits_when[c] |= e.when is not None
    problems = []
    for c, names in members.items():
        path = cycle_path(names, edges)
        loop = " -> ".join(shorten(n) for n in path[:10])
        loop += " ..." if len(path) > 10 else ""
        more = len(names) - len(set(path))
        loop += f"] (and {more} more node{'s' * (more != 1)} looping with it)" if more else "]"
        if not exits_when[c]:
            problems.append(Problem("edges", f"cycle [{loop} has no conditional exit edge",
                                    "add an edge leaving the cycle with `when:` (e.g. verifier -> generator "
                                    "when: stop)"))
        if max_turns is None:
            problems.append(Problem("limits.max_turns", f"cycle [{loop} is unbounded",
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
