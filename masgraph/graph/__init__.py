"""Graphs: `GraphBuilder` (Python) or a GraphSpec (YAML) compiles into a frozen, checked `Graph`.

`structure` is the compiled graph and its pure algorithms, `space` the topology decisions a graph offers,
`compile` the checks that turn a spec into a Graph, `builder` the Python front end.
"""

from masgraph.graph.builder import GraphBuilder
from masgraph.graph.compile import WEIGHT_FILES, compile_spec, model_dir_problem
from masgraph.graph.structure import (
    Graph,
    GraphView,
    Topology,
    back_edges,
    check_structure,
    cycle_index,
    cycle_path,
    live_branch_sources,
    reachable,
)

__all__ = [
    "WEIGHT_FILES", "Graph", "GraphBuilder", "GraphView", "Topology", "back_edges", "check_structure", "compile_spec",
    "cycle_index", "cycle_path", "live_branch_sources", "model_dir_problem", "reachable",
]
