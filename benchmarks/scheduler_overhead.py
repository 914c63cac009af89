"""Scheduler overhead per node step vs LangGraph, same graph shapes, same no-op node bodies.

Ours goes through the `masgraph run` code path (Runner -> Scheduler, with the run-directory store and the
progress bar as sinks). The peer is LangGraph's compiled StateGraph (the faster of invoke / ainvoke).
Prints µs per node step for both and the ratio ours / LangGraph (target <= 0.2), and appends a row to
benchmarks/results/scheduler_overhead.md.

    .venv/bin/python benchmarks/scheduler_overhead.py [--episodes 200]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import operator
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TypedDict

from results_file import results_file

from masgraph.agents.registry import register_agent
from masgraph.backends.scripted import ScriptedBackend
from masgraph.cli import ProgressBar
from masgraph.graph import Graph, GraphBuilder
from masgraph.node import NodeOutput
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import Item, Task

HERE = Path(__file__).resolve().parent


@register_agent("noop")
async def noop(ctx) -> NodeOutput:
    return NodeOutput(route="continue")


class Nothing(Task):
    name = "nothing"

    def generate(self, split, n, seed):
        return [Item(f"q{i}", "q", "") for i in range(n)]

    def score(self, item, answer):
        return 0.0


def ours(shape: str) -> tuple[Graph, int]:
    """The graph and its node steps per episode."""
    b = GraphBuilder(shape).add_policy("p", backend="scripted")
    if shape == "linear10":
        for i in range(10):
            b.add_node(f"n{i}", role="custom", agent="noop")
            if i:
                b.add_edge(f"n{i - 1}", f"n{i}")
        return b.compile(), 10
    if shape == "loop100":
        b.add_node("step", role="custom", agent="noop").add_node("end", role="custom", agent="noop")
        b.add_edge("step", "step", when="continue").add_edge("step", "end", when="stop")
        return b.set(limits={"max_turns": 100}).compile(), 101
    b.add_node("src", role="custom", agent="noop")
    for i in range(32):
        b.add_node(f"b{i}", role="custom", agent="noop").add_edge("src", f"b{i}")
    b.add_node("join", role="custom", agent="noop", merge="concat")
    for i in range(32):
        b.add_edge(f"b{i}", "join")
    return b.compile(), 34


def langgraph(shape: str):
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        n: Annotated[int, operator.add]

    def node(state: State) -> dict:
        return {}

    def count(state: State) -> dict:
        return {"n": 1}

    g = StateGraph(State)
    if shape == "linear10":
        for i in range(10):
            g.add_node(f"n{i}", node)
            g.add_edge(START if i == 0 else f"n{i - 1}", f"n{i}")
        g.add_edge("n9", END)
    elif shape == "loop100":
        g.add_node("step", count)
        g.add_node("end", node)
        g.add_edge(START, "step")
        g.add_conditional_edges("step", lambda s: "step" if s["n"] < 100 else "end", ["step", "end"])
        g.add_edge("end", END)
    else:
        g.add_node("src", node)
        g.add_edge(START, "src")
        for i in range(32):
            g.add_node(f"b{i}", node)
            g.add_edge("src", f"b{i}")
        g.add_node("join", node)
        g.add_edge([f"b{i}" for i in range(32)], "join")
        g.add_edge("join", END)
    return g.compile()


def time_ours(graph: Graph, episodes: int, concurrency: int) -> float:
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(graph, RunConfig(n=episodes, split="train", concurrency=concurrency, runs_dir=runs),
                        backends={"scripted": ScriptedBackend()})
        task = Nothing()
        items = task.items("train", episodes)
        bar = ProgressBar(episodes, stream=io.StringIO())
        t0 = time.perf_counter()
        result = asyncio.run(runner.run_items(task, items, sinks=[bar]))
        dt = time.perf_counter() - t0
        assert all(t.status == "ok" for t in result.traces), result.traces[0].error
        return dt


def time_langgraph(app, episodes: int) -> float:
    cfg = {"recursion_limit": 1000}
    t0 = time.perf_counter()
    for _ in range(episodes):
        app.invoke({"n": 0}, cfg)
    sync = time.perf_counter() - t0

    async def many():
        for _ in range(episodes):
            await app.ainvoke({"n": 0}, cfg)
    t0 = time.perf_counter()
    asyncio.run(many())
    return min(sync, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for shape in ("linear10", "loop100", "fanout32"):
        graph, steps = ours(shape)
        app = langgraph(shape)
        n = args.episodes if shape != "loop100" else max(args.episodes // 10, 10)
        time_ours(graph, 5, 1), time_langgraph(app, 5)  # warm-up
        ours_us = time_ours(graph, n, 1) / (n * steps) * 1e6
        ours16_us = time_ours(graph, n, 16) / (n * steps) * 1e6
        lg_us = time_langgraph(app, n) / (n * steps) * 1e6
        rows.append((shape, ours_us, ours16_us, lg_us))
        print(f"{shape:9s} masgraph {ours_us:7.1f} µs/step (c=16: {ours16_us:6.1f})  "
              f"langgraph {lg_us:7.1f} µs/step  ratio {ours_us / lg_us:.3f}", flush=True)
    from importlib.metadata import version

    lines = [f"\n### Scheduler overhead vs LangGraph {version('langgraph')} ({time.strftime('%Y-%m-%d %H:%M')})\n",
             f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — {args.episodes} episodes per shape "
             "(loop: /10), concurrency 1 unless noted, store + progress sinks on.\n\n",
             "| shape | masgraph µs/step | masgraph c=16 | LangGraph µs/step | ratio (target ≤ 0.2) |\n",
             "|---|---|---|---|---|\n"]
    lines += [f"| {s} | {o:.1f} | {o16:.1f} | {lg:.1f} | **{o / lg:.3f}** |\n" for s, o, o16, lg in rows]
    with open(results_file("scheduler_overhead"), "a") as f:
        f.writelines(lines)


if __name__ == "__main__":
    main()
