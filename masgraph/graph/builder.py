"""GraphBuilder: the Python front end of a graph, producing the same GraphSpec a YAML file does."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from masgraph.errors import SpecError
from masgraph.graph.compile import compile_spec
from masgraph.graph.structure import Graph
from masgraph.loader import problems_from
from masgraph.registry import Registry
from masgraph.spec import GraphSpec


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
        """Set top-level sections: entry, exit, memory, limits, plugins, topology, train."""
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

    def compile(self, check_models: bool = True, registry: Registry | None = None) -> Graph:
        return compile_spec(self.spec(), f"GraphBuilder({self._doc['name']!r})", check_models, registry)
