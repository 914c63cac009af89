"""What a topology policy has learned: its decision probabilities as text, and the graph drawn with each edge's
width = the probability that an episode runs it (`masgraph topology RUN`)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

from masgraph.graph.space import node_places
from masgraph.topology.policy import TopologyPolicy


def edge_probabilities(policy: TopologyPolicy, queries: Sequence[str], samples: int = 400) -> list[float]:
    """Per edge of the graph (in `spec.edges` order): the fraction of sampled topologies that keep it and can
    reach it, over `samples` samples spread across `queries`."""
    spec = policy.space.graph.spec
    kept = [0] * len(spec.edges)
    queries = list(queries) or [""]
    for k in range(samples):
        q = queries[k % len(queries)]
        view = policy.space.graph.view(policy.sample(q, seed=zlib.crc32(f"{k}|{q}".encode())).topology)
        active = {id(e) for edges in view.out_edges.values() for e in edges}
        for i, e in enumerate(spec.edges):
            kept[i] += id(e) in active
    return [c / samples for c in kept]


def describe(policy: TopologyPolicy, queries: Sequence[str] = (), source: str = "") -> str:
    """Each decision's option probabilities and the greedy topology, each block labelled with what it is: the
    policy at no query (its prior; the policy itself when unconditioned) or at each held-out query given.
    `source` says where the policy came from (`checkpoint step-N`)."""
    kind = "query-conditioned" if policy.conditioned else "unconditioned"
    lines = [f"topology policy v{policy.version} ({kind}){' from ' + source if source else ''}; "
             f"{policy.space.valid_count} of {policy.space.total} combinations are valid graphs"]
    prior = "prior (no query)" if policy.conditioned else "probabilities (the same for every query)"
    rows = [(prior, None)] if not policy.conditioned else [(f"held-out query {q!r}", q) for q in queries] or [
        (prior, None)]
    for label, q in rows:
        lines.append(f"{label}:")
        for d, opts in policy.probabilities(q).items():
            lines.append(f"  {d:<28} " + "  ".join(f"{o} {p:.2f}" for o, p in opts.items()))
        if q is not None:
            greedy = policy.sample(q, greedy=True).choice
            lines.append("  greedy: " + ", ".join(f"{d}={o}" for d, o in greedy.decisions.items()
                                                   if d in greedy.logprobs))
    if policy.conditioned:
        lines.append("(`masgraph watch` shows another number: the mean over a training step's queries)")
    return "\n".join(lines)


def draw(policy: TopologyPolicy, out: str | Path, queries: Sequence[str] = ()) -> Path:
    """PNG of the graph, each edge as wide as its probability of running (labels give the number)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    graph = policy.space.graph
    probs = edge_probabilities(policy, queries)
    g = nx.DiGraph()
    g.add_nodes_from(graph.spec.nodes)
    widths: dict[tuple[str, str], float] = {}
    for e, p in zip(graph.spec.edges, probs):
        widths[(e.source, e.target)] = max(widths.get((e.source, e.target), 0.0), p)
    g.add_edges_from(widths)
    for n, layer in node_places(graph.spec).items():
        g.nodes[n]["layer"] = layer
    pos = nx.multipartite_layout(g, subset_key="layer")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color="#dde8f5", node_size=1400)
    nx.draw_networkx_labels(g, pos, ax=ax, font_size=9)
    edges = list(widths)
    nx.draw_networkx_edges(g, pos, ax=ax, edgelist=edges, width=[0.3 + 6 * widths[e] for e in edges],
                           connectionstyle="arc3,rad=0.08", arrowsize=14, node_size=1400)
    nx.draw_networkx_edge_labels(g, pos, ax=ax, edge_labels={e: f"{widths[e]:.2f}" for e in edges}, font_size=7)
    ax.set_title(f"{graph.spec.name}: probability each edge runs (topology policy v{policy.version})")
    ax.axis("off")
    out = Path(out)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out

