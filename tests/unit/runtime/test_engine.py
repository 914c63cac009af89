"""The engine: one object with the graph's backends, agents and tools; episodes started one at a time."""

from __future__ import annotations

import asyncio

from masgraph.backends.scripted import ScriptedBackend
from masgraph.events import ListSink
from masgraph.graph import GraphBuilder, Topology
from masgraph.runtime.engine import Engine


def graph():
    return (GraphBuilder("two").add_policy("p", backend="scripted")
            .add_node("draft", role="generator", policy="p")
            .add_node("answer", role="generator", policy="p")
            .add_edge("draft", "answer").compile())


def test_episodes_start_one_at_a_time_with_unique_ids(run):
    engine = Engine(graph(), backends={"scripted": ScriptedBackend(default="Answer: 7", delay_s=0.01)})
    sink = ListSink()

    async def many():
        return await asyncio.gather(*(engine.episode(f"q{i}", sinks=[sink]) for i in range(20)))

    traces = run(many())
    assert len({t.episode_id for t in traces}) == 20 and all(t.status == "ok" and t.answer == "7" for t in traces)
    assert [t.query for t in traces] == [f"q{i}" for i in range(20)]
    started = {e.episode_id for e in sink.events if e.kind == "episode_started"}
    assert started == {t.episode_id for t in traces}
    # the backend is built once and shared by every episode and policy
    assert len(engine.backends) == 1 and len(engine.policies) == 1


def test_an_engine_episode_takes_a_topology(run):
    g = (GraphBuilder("skip").add_policy("p", backend="scripted")
         .add_node("draft", role="generator", policy="p")
         .add_node("check", role="generator", policy="p")
         .add_node("answer", role="generator", policy="p")
         .add_edge("draft", "check").add_edge("check", "answer").add_edge("draft", "answer")
         .set(nodes={"draft": {"role": "generator", "policy": "p"}, "check": {"role": "generator", "policy": "p"},
                     "answer": {"role": "generator", "policy": "p", "merge": "concat"}}).compile())
    engine = Engine(g, backends={"scripted": ScriptedBackend(default="Answer: 1")})
    full = run(engine.episode("q"))
    short = run(engine.episode("q", topology=Topology(edges_off=frozenset({0}))))  # draft -> check off
    assert [s.node for s in full.steps] == ["draft", "check", "answer"]
    assert [s.node for s in short.steps] == ["draft", "answer"]
