"""The decision space of a graph's `topology:` section: its decisions, and which combinations are valid graphs.

A configuration picks one option per decision (node gates, edge gates, routing choices, prompt slots); it maps
to a `Topology` (the nodes and edges left out, the slots' prompts). At construction every configuration is
checked with the compile rules (`Graph.problems_of`: exit reachable, cycles bounded, fan-ins merged, no route
left without its edge), so sampling can mask, at each decision, the options that no valid completion of the
decisions made so far allows: every sample is valid by construction.

Decisions are made upstream first (ordered by their node's place in the graph once loops' back edges are cut:
its longest distance from the entry; gates, choices, slots at equal places), so a decision comes after every
decision that can cut its node off. A decision about a node the decisions made so far have cut off (switched
off, or no longer reachable from the entry) changes nothing: it is *skipped* (forced to its first allowed
option, no log-probability), as is one with a single allowed option.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from masgraph.errors import MasgraphError, Problem
from masgraph.graph.structure import Graph, Topology, back_edges, reachable
from masgraph.spec import EdgeRef, edge_indexes

MAX_CONFIGURATIONS = 1 << 14
"""Most combinations a space enumerates (checking one takes ~20-60 µs: 16,384 take about a second)."""


@dataclass(frozen=True)
class Decision:
    """One learnable decision: its options and what each option leaves out of the graph."""

    name: str
    """`node:<n>`, `edge:<source>-><target>[:<when>]`, `choice:<n>` or `slot:<n>`."""
    kind: Literal["node", "edge", "choice", "slot"]
    options: tuple[str, ...]
    """`("on", "off")` for gates; the successor names for a choice; the prompt names for a slot."""
    nodes_off: tuple[frozenset[str], ...]
    """Per option, the nodes it leaves out."""
    edges_off: tuple[frozenset[int], ...]
    """Per option, the edge indexes (in `spec.edges`) it leaves out."""
    prompts: tuple[tuple[tuple[str, str], ...], ...]
    """Per option, the (node, prompt) it sets (slots only)."""
    brings: tuple[frozenset[str], ...]
    """Per option, the nodes it brings into the episode (the gated node or edge's target when on; the chosen
    successor): whose cost the trainer charges to this decision."""
    path: str
    """Where it is declared (`topology.nodes[0]`, `topology.choices.planner`, ...), for located errors."""
    at: str
    """The node it acts at (the gated node, the edge's source, the choosing node): skipped once the decisions
    before it have cut that node off."""


def decisions_of(graph: Graph) -> list[Decision]:
    """The decisions a graph's `topology:` section declares, in sampling order ([] when it has none)."""
    spec, topo = graph.spec, graph.spec.topology
    if topo is None:
        return []
    none: tuple[tuple[str, str], ...] = ()
    out = [Decision(f"node:{n}", "node", ("on", "off"), (frozenset(), frozenset({n})), (frozenset(), frozenset()),
                    (none, none), (frozenset({n}), frozenset()), f"topology.nodes[{k}]", n)
           for k, n in enumerate(topo.nodes)]
    for k, ref in enumerate(topo.edges):
        [i] = edge_indexes(spec, ref)
        name = f"edge:{ref.source}->{ref.target}" + (f":{ref.when}" if ref.when else "")
        out.append(Decision(name, "edge", ("on", "off"), (frozenset(), frozenset()), (frozenset(), frozenset({i})),
                            (none, none), (frozenset({ref.target}), frozenset()), f"topology.edges[{k}]",
                            ref.source))
    for node, targets in topo.choices.items():
        per_target = {t: frozenset(edge_indexes(spec, EdgeRef(source=node, target=t))) for t in targets}
        every = frozenset().union(*per_target.values())
        out.append(Decision(f"choice:{node}", "choice", tuple(targets), tuple(frozenset() for _ in targets),
                            tuple(every - per_target[t] for t in targets), tuple(none for _ in targets),
                            tuple(frozenset({t}) for t in targets), f"topology.choices.{node}", node))
    for node, prompts in topo.slots.items():
        out.append(Decision(f"slot:{node}", "slot", tuple(prompts), tuple(frozenset() for _ in prompts),
                            tuple(frozenset() for _ in prompts), tuple(((node, p),) for p in prompts),
                            tuple(frozenset() for _ in prompts), f"topology.slots.{node}", node))
    names = [d.name for d in out]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"two decisions share the name {clash[0]!r} (node names containing '->' or ':' make edge "
                         "names ambiguous); rename those nodes")
    place = node_places(spec)
    return sorted(out, key=lambda d: place[d.at])  # stable: gates, choices, slots at equal places


class DecisionSpace:
    """The decisions of a graph and its valid configurations (a configuration = one option index per decision).

    Example:
        >>> space = DecisionSpace(compile_spec(load_spec("graphs/router.yaml")))
        >>> [d.name for d in space.decisions], space.valid_count, space.total
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.decisions = decisions_of(graph)
        self.total = 1
        for d in self.decisions:
            self.total *= len(d.options)
        if self.total > MAX_CONFIGURATIONS:
            raise ValueError(f"the topology has {self.total:,} combinations of decisions, more than the "
                             f"{MAX_CONFIGURATIONS:,} that can be checked; gate fewer nodes or edges")
        self._next: dict[tuple[int, ...], set[int]] = {}
        """Prefix of option indexes -> the options of the next decision that some valid configuration continues."""
        self._skipped: dict[tuple[int, ...], bool] = {}
        self._valid: list[tuple[int, ...]] = []
        self.valid_count = 0
        first_problems: list[Problem] = []
        for config in itertools.product(*(range(len(d.options)) for d in self.decisions)):
            problems = graph.problems_of(self.topology(config))
            if problems:
                first_problems = first_problems or problems
                continue
            self.valid_count += 1
            self._valid.append(config)
            for k in range(len(config)):
                self._next.setdefault(config[:k], set()).add(config[k])
        self.problems = [] if self.valid_count else first_problems
        """Why no configuration is valid (empty when some is)."""

    def topology(self, config: tuple[int, ...]) -> Topology:
        """The sub-graph a configuration (or a prefix of one) leaves: its nodes and edges switched off."""
        nodes_off: set[str] = set()
        edges_off: set[int] = set()
        prompts: list[tuple[str, str]] = []
        for d, o in zip(self.decisions, config):
            nodes_off |= d.nodes_off[o]
            edges_off |= d.edges_off[o]
            prompts += d.prompts[o]
        return Topology(frozenset(nodes_off), frozenset(edges_off), tuple(sorted(prompts)))

    def allowed(self, prefix: tuple[int, ...]) -> list[bool]:
        """Per option of decision `len(prefix)`: whether a valid configuration starts with prefix + that option."""
        ok = self._next.get(prefix, set())
        return [o in ok for o in range(len(self.decisions[len(prefix)].options))]

    def skipped(self, prefix: tuple[int, ...]) -> bool:
        """Whether decision `len(prefix)` changes nothing after `prefix`: the node it acts at is cut off by the
        decisions made (the undecided ones counted as keeping everything), or only one option is allowed."""
        found = self._skipped.get(prefix)
        if found is None:
            top = self.topology(prefix)
            spec = self.graph.spec
            edges = [e for i, e in enumerate(spec.edges) if i not in top.edges_off
                     and e.source not in top.nodes_off and e.target not in top.nodes_off]
            cut = self.decisions[len(prefix)].at not in reachable(spec.entry, edges)
            found = self._skipped[prefix] = cut or sum(self.allowed(prefix)) == 1
        return found

    def config_of(self, names: dict[str, str]) -> tuple[int, ...]:
        """The configuration of decisions given by name -> option name (every decision, no other names)."""
        known = {d.name: d for d in self.decisions}
        missing = [n for n in known if n not in names]
        unknown = [n for n in names if n not in known]
        bad = [f"{n}={names[n]!r}" for n in known if n in names and names[n] not in known[n].options]
        if missing or unknown or bad:
            raise MasgraphError(f"these topology decisions do not fit graph {self.graph.spec.name!r}: "
                                + "; ".join(x for x in (f"missing {missing}" if missing else "",
                                                        f"unknown {unknown}" if unknown else "",
                                                        f"no such option {bad}" if bad else "") if x))
        return tuple(known[d.name].options.index(names[d.name]) for d in self.decisions)

    def forced(self) -> list[tuple[Decision, str]]:
        """Decisions that every valid configuration takes the same way (so there is nothing to learn in them)."""
        out = []
        for k, d in enumerate(self.decisions):
            seen = {c[k] for c in self._valid}
            if len(seen) == 1:
                out.append((d, d.options[next(iter(seen))]))
        return out

    def path_of(self, decision: Decision) -> str:
        return decision.path


def node_places(spec) -> dict[str, int]:
    """Node -> its longest distance from the entry once loops' back edges are cut (a topological order)."""
    succ: dict[str, list[str]] = {n: [] for n in spec.nodes}
    for e in spec.edges:
        succ[e.source].append(e.target)
    back = back_edges(spec.entry, succ)
    place = {n: 0 for n in spec.nodes}
    for _ in range(len(spec.nodes)):  # relax longest paths on the DAG (bounded by the node count)
        changed = False
        for e in spec.edges:
            if (e.source, e.target) not in back and e.source != e.target and place[e.target] < place[e.source] + 1:
                place[e.target], changed = place[e.source] + 1, True
        if not changed:
            break
    return place
