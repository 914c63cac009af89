"""One conformance suite for every engine a Runner takes: the local `Engine` and the Ray `RayEngine` both declare
`EngineLike`, offer each of its members with its signature, and say whether their episodes run in this process.
The Ray engine's episodes themselves run in tests/integration/test_ray_real.py (they need Ray workers)."""

from __future__ import annotations

import inspect

import pytest

from masgraph.backends.scripted import ScriptedBackend
from masgraph.errors import MasgraphError
from masgraph.graph import GraphBuilder
from masgraph.runtime.engine import Engine, EngineLike
from masgraph.runtime.ray_engine import RayEngine
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.runtime.scheduler import EpisodeInput

ENGINES = [Engine, RayEngine]
METHODS = ("scheduler", "load_checkpoint", "load_adapters", "aclose")


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda c: c.__name__)
def test_an_engine_declares_the_protocol_and_matches_each_member(engine):
    assert EngineLike in engine.__mro__  # declared, not duck-typed
    for name in METHODS:
        assert _params(getattr(engine, name)) == _params(getattr(EngineLike, name)), name
        assert inspect.iscoroutinefunction(getattr(engine, name)) == inspect.iscoroutinefunction(
            getattr(EngineLike, name)), name
    assert isinstance(engine.in_process, bool)


def test_the_members_check_sees_a_missing_parameter():
    class Short(EngineLike):
        in_process = True

        def scheduler(self, sinks=(), score=None, concurrency=16, seed=0):  # no memo_greedy
            ...

    assert _params(Short.scheduler) != _params(EngineLike.scheduler)


def _graph():
    return (GraphBuilder("two").add_policy("p", backend="scripted")
            .add_node("draft", role="generator", policy="p")
            .add_node("answer", role="generator", policy="p")
            .add_edge("draft", "answer").compile())


def test_the_local_engine_runs_episodes_through_the_protocol(run):
    engine: EngineLike = Engine(_graph(), backends={"scripted": ScriptedBackend(default="Answer: 7")})
    assert isinstance(engine, EngineLike) and engine.in_process
    sched = engine.scheduler(concurrency=4, seed=1, memo_greedy=True)
    traces = run(sched.run([EpisodeInput(f"i{k}", f"q{k}") for k in range(3)]))
    assert [t.status for t in traces] == ["ok"] * 3 and [t.answer for t in traces] == ["7"] * 3
    run(engine.aclose())


def test_a_runner_asks_the_engine_where_episodes_run_not_what_it_has(tmp_path):
    class Elsewhere(Engine):
        in_process = False  # as a RayEngine says: a judge cannot be served from this process

    graph = _graph()
    runner = Runner(graph, RunConfig(runs_dir=str(tmp_path)),
                    engine=Elsewhere(graph, backends={"scripted": ScriptedBackend(default="Answer: 7")}))
    with pytest.raises(MasgraphError, match="needs the driver's engine"):
        runner.require_driver("an LLM judge", "fix: run without Ray")
    Runner(graph, RunConfig(runs_dir=str(tmp_path)), engine=Engine(
        graph, backends={"scripted": ScriptedBackend(default="x")})).require_driver("an LLM judge", "fix")
