"""The scheduler on the scripted backend: routing, bounded loops, fan-out/fan-in, failures, determinism."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from masgraph.agents.registry import register_agent, resolve_agents
from masgraph.agents.tools.registry import register_tool
from masgraph.backends.base import BackendError
from masgraph.events import EVENT_SCHEMA_VERSION, ListSink
from masgraph.graph import GraphBuilder, compile_spec
from masgraph.loader import load_spec
from masgraph.node import NodeOutput
from masgraph.rundir.store import read_traces
from masgraph.runtime.scheduler import EpisodeInput
from masgraph.tasks import Item, Task
from masgraph.trace import ToolCall


class Sum(Task):
    name = "sum-test"

    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", f"What is 2 + {i + 3}?", str(5 + i)) for i in range(n)]

    def score(self, item, answer):
        return float(answer.strip() == item.answer)


def agentflow(root, **limits):
    spec = load_spec(root / "graphs" / "agentflow.yaml")
    if limits:
        spec = spec.model_copy(update={"limits": spec.limits.model_copy(update=limits)})
    return compile_spec(spec)


def test_agentflow_episode_routes_and_records(root, scripted, runner_for, run):
    backend = scripted()
    runner = runner_for(agentflow(root), backend, n=3)
    result = run(runner.run_task(Sum()))
    [t0, t1, t2] = result.traces
    assert [s.node for s in t0.steps] == ["planner", "executor", "verifier", "generator"]
    assert t0.steps[1].tool.output == "5" and t0.steps[2].route == "stop"
    assert t0.answer == "5" and t0.reward == 1.0 and t1.reward == 0.0  # 2 + 4 != 5
    assert result.summary["accuracy"] == pytest.approx(1 / 3)
    # the store holds the same traces, the spec snapshot, versions and the summary
    stored = list(read_traces(result.run_dir))
    assert sorted(t.episode_id for t in stored) == sorted(t.episode_id for t in result.traces)
    assert (result.run_dir / "spec.yaml").exists()
    cfg = json.loads((result.run_dir / "config.json").read_text())
    assert cfg["versions"]["pydantic"] and cfg["event_schema_version"] == EVENT_SCHEMA_VERSION
    lines = [json.loads(x) for x in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert all(x["v"] == EVENT_SCHEMA_VERSION for x in lines)
    assert {"episode_started", "episode_finished"} <= {x["kind"] for x in lines}


def test_loop_is_bounded_and_exit_forced(root, scripted, runner_for, run):
    backend = scripted({"verifier": "Conclusion: CONTINUE"})
    result = run(runner_for(agentflow(root, max_turns=2), backend, n=1).run_task(Sum()))
    [tr] = result.traces
    assert [s.node for s in tr.steps] == ["planner", "executor", "verifier"] * 2 + ["generator"]
    assert tr.turns == 2 and tr.steps[5].bounded and not tr.steps[2].bounded
    assert tr.status == "ok"


def test_fan_out_runs_in_parallel_and_merges(root, scripted, runner_for, run):
    graph = compile_spec(load_spec(root / "graphs" / "fanout.yaml"))
    backend = scripted({"judge": lambda req: "Answer: 5" if "[executor]\n5" in req.messages[-1]["content"]
                        and "[direct]\nAnswer: 6" in req.messages[-1]["content"] else "Answer: merge-missing"})
    [tr] = run(runner_for(graph, backend, n=1).run_task(Sum())).traces
    assert [s.node for s in tr.steps[:3]] == ["planner", "direct", "executor"]  # plan (edge) order
    assert tr.answer == "5"


def test_concurrency_limit_and_batching_of_requests(root, scripted, runner_for, run):
    in_flight = peak = 0

    class Counting:
        returns_tokens = True

        def __init__(self):
            self.inner = scripted()

        async def complete(self, reqs):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1
            return await self.inner.complete(reqs)

        async def aclose(self):
            pass

    run(runner_for(agentflow(root), Counting(), n=12, concurrency=4).run_task(Sum()))
    assert peak == 4


def test_tool_that_raises_or_hangs_is_recorded_and_run_goes_on(scripted, runner_for, run):
    @register_tool(name="flaky")
    def flaky(text: str) -> str:
        """Raises on purpose."""
        raise RuntimeError("tool exploded")

    @register_tool(name="sleepy")
    async def sleepy(text: str) -> str:
        """Hangs."""
        await asyncio.sleep(60)
        return "never"

    for tool, expect in (("flaky", "RuntimeError: tool exploded"), ("sleepy", "sleepy timed out after 0.2s")):
        graph = (GraphBuilder("t").add_policy("p", backend="scripted")
                 .add_tool(tool, kind=tool, timeout_s=0.2 if tool == "sleepy" else 10)  # a thread may start late
                 .add_node("executor", role="executor", tools=[tool])
                 .add_node("generator", role="generator", policy="p")
                 .add_edge("executor", "generator").compile())
        result = run(runner_for(graph, scripted(), n=2).run_task(Sum()))
        assert [t.status for t in result.traces] == ["ok", "ok"]
        step = result.traces[0].steps[0]
        assert step.tool.error.startswith(expect) and step.tool.output is None and step.text.startswith("Error:")


def test_backend_error_fails_episode_not_run(root, scripted, runner_for, run):
    def boom(req):
        if "2 + 4" in req.messages[-1]["content"]:
            raise BackendError("server down")
        return "Sub-goal: 2 + 3\nTool: calculator"

    result = run(runner_for(agentflow(root), scripted({"planner": boom}), n=3).run_task(Sum()))
    assert [t.status for t in result.traces] == ["ok", "error", "ok"]
    assert "server down" in result.traces[1].error and result.traces[1].steps[0].error
    assert len(list(read_traces(result.run_dir))) == 3


def test_unparseable_output_uses_fallback_and_is_recorded(root, scripted, runner_for, run):
    backend = scripted({"planner": "hmm, I am not sure", "verifier": "???", "generator": "5"})
    [tr] = run(runner_for(agentflow(root, max_turns=1), backend, n=1).run_task(Sum())).traces
    planner, _, verifier, generator = tr.steps
    assert planner.parse_error and verifier.parse_error and generator.parse_error
    assert tr.status == "ok" and tr.answer == "5"


def test_node_timeout_and_retry(scripted, runner_for, run):
    attempts = {"n": 0}

    @register_agent("flaky-once")
    async def flaky_once(ctx):
        attempts["n"] += 1
        if attempts["n"] == 1:
            await asyncio.sleep(5)  # first attempt hangs past the node timeout
        return NodeOutput(text="ok", answer="2")

    graph = (GraphBuilder("retry").add_policy("p", backend="scripted")
             .add_node("solo", role="custom", agent="flaky-once", timeout_s=0.1, retries=1).compile())
    [tr] = run(runner_for(graph, scripted(), n=1).run_task(Sum())).traces
    assert tr.status == "ok" and tr.steps[0].attempts == 2 and tr.answer == "2"

    graph = (GraphBuilder("noretry").add_policy("p", backend="scripted")
             .add_node("solo", role="custom", agent="flaky-once", timeout_s=0.1).compile())
    attempts["n"] = 0
    [tr] = run(runner_for(graph, scripted(), n=1).run_task(Sum())).traces
    assert tr.status == "error" and "timed out" in tr.steps[0].error


def test_episode_timeout(root, scripted, runner_for, run):
    spec = load_spec(root / "graphs" / "agentflow.yaml")
    spec = spec.model_copy(update={"limits": spec.limits.model_copy(update={"episode_timeout_s": 0.05})})
    result = run(runner_for(compile_spec(spec), scripted(delay_s=0.2), n=2).run_task(Sum()))
    assert [t.status for t in result.traces] == ["timeout", "timeout"]


def test_deterministic_under_seed(root, scripted, runner_for, run):
    def sample(req):  # the per-request seed is what a sampling backend would use
        return f"Sub-goal: 2 + {req.seed % 7}\nTool: calculator"

    def once():
        res = run(runner_for(agentflow(root), scripted({"planner": sample, "executor": lambda r: "Input: " +
                                                        r.messages[-1]["content"].rsplit("Sub-goal: ", 1)[1]}),
                             n=6, seed=3).run_task(Sum()))
        return [(t.episode_id, [(s.node, s.text) for s in t.steps]) for t in res.traces]

    first, second = once(), once()
    assert first == second
    assert len({steps[0][1] for _, steps in first}) > 1  # seeds differ per episode


def test_cancel_stores_finished_and_marks_cancelled(root, scripted, runner_for, run, tmp_path):
    runner = runner_for(agentflow(root), scripted(delay_s=0.02), n=8, concurrency=2)
    sink = ListSink()

    async def main():
        task = asyncio.ensure_future(runner.run_task(Sum(), sinks=[sink]))
        def started():
            return sum(e.kind == "episode_started" for e in sink.events)

        while len(sink.traces) < 2 or started() <= len(sink.traces):  # 2 done and more in flight
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    [run_dir] = (tmp_path / "runs").iterdir()
    stored = list(read_traces(run_dir))
    assert sum(t.status == "ok" for t in stored) >= 2
    assert {t.status for t in stored} == {"ok", "cancelled"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True


def test_scheduler_without_runner_emits_events(root, scripted, run):
    from masgraph.agents.registry import resolve_agents
    from masgraph.agents.tools.registry import build_tools
    from masgraph.runtime.scheduler import Policy, Scheduler

    graph = agentflow(root)
    backend = scripted()
    policies = {n: Policy(n, p, backend) for n, p in graph.spec.policies.items()}
    sink = ListSink()
    sched = Scheduler(graph, resolve_agents(graph.spec), policies, build_tools(graph.spec.tools), [sink])
    [tr] = run(sched.run([EpisodeInput("q", "What is 2 + 3?")]))
    kinds = [e.kind for e in sink.events]
    # planner (LLM), executor (LLM + tool), verifier (LLM), generator (LLM): each step is started, then its LLM
    # call and tool call, then finished
    step = {"planner": ["llm_call"], "executor": ["llm_call", "tool_call"], "verifier": ["llm_call"],
            "generator": ["llm_call"]}
    want = [k for node in ("planner", "executor", "verifier", "generator")
            for k in ["step_started", *step[node], "step"]]
    assert kinds == ["episode_started", *want, "episode_finished"] and tr.answer == "5"
    llm = [e for e in sink.events if e.kind == "llm_call"]
    assert [e.node for e in llm] == ["planner", "executor", "verifier", "generator"]
    assert all(e.episode_id == tr.episode_id and e.completion_tokens > 0 for e in llm)
    [tool] = [e for e in sink.events if e.kind == "tool_call"]
    assert tool.tool == "calculator" and tool.ok


# --- fan-in waits for every live branch (uneven lengths, failures, dead branches, loops) ----------------

@register_agent("echo")
async def echo(ctx):
    return NodeOutput(text=ctx.node)


@register_agent("say-x")
async def say_x(ctx):
    return NodeOutput(text="x")


@register_agent("gather")
async def gather(ctx):
    """The fan-in node: which branches it saw, and the merged view."""
    return NodeOutput(text=",".join(src for src, _ in ctx.inputs) + "|" + ctx.merged, answer=ctx.merged)


def fan_in_graph(merge="concat", b2="say-x", extra=(), **limits):
    """src -> a -> join, src -> b1 -> b2 -> join, src -> c -> join (+ extra nodes/edges)."""
    g = GraphBuilder("fanin").add_node("src", role="custom", agent="echo")
    for name, agent in (("a", "echo"), ("b1", "echo"), ("c", "say-x"), ("b2", b2), *[n for n, _ in extra]):
        g = g.add_node(name, role="custom", agent=agent)
    g = g.add_node("join", role="custom", agent="gather", merge=merge)
    for s, t, *when in [("src", "a"), ("src", "b1"), ("src", "c"), ("a", "join"), ("b1", "b2"), ("b2", "join"),
                        ("c", "join"), *[e for _, e in extra]]:
        g = g.add_edge(s, t, *when)
    return g.set(limits=limits or {}).compile()


def run_one(graph, run, scripted=None, query="q"):
    from masgraph.runtime.scheduler import Policy, Scheduler

    policies = {n: Policy(n, p, scripted) for n, p in graph.spec.policies.items()} if scripted else {}
    tools = {}
    if graph.spec.tools:
        from masgraph.agents.tools.registry import build_tools
        tools = build_tools(graph.spec.tools)
    [tr] = run(Scheduler(graph, resolve_agents(graph.spec), policies, tools).run([EpisodeInput("q", query)]))
    return tr


@pytest.mark.parametrize("merge, answer", [("concat", "[a]\na\n\n[c]\nx\n\n[b2]\nx"), ("first", "a"), ("vote", "x")])
def test_fan_in_waits_for_the_longer_branch(merge, answer, run):
    tr = run_one(fan_in_graph(merge), run)
    assert tr.status == "ok" and [s.node for s in tr.steps] == ["src", "a", "b1", "c", "b2", "join"]
    assert tr.steps[-1].text.startswith("a,c,b2|") and tr.answer == answer


def test_fan_in_branch_failure_fails_the_episode_before_the_join(run):
    @register_agent("explodes")
    async def explodes(ctx):
        raise RuntimeError("branch exploded")

    tr = run_one(fan_in_graph(b2="explodes"), run)
    assert tr.status == "error" and "'b2' failed" in tr.error and "branch exploded" in tr.error
    assert [s.node for s in tr.steps] == ["src", "a", "b1", "c", "b2"] and tr.steps[-1].error


def test_fan_in_does_not_wait_for_dead_branches(run):
    @register_agent("route-done")
    async def route_done(ctx):
        return NodeOutput(text="b1", route="done")

    # b1 routes away from the join (b1 -> b2 only `when: more`; `done` leads to a dead end), c is two long
    graph = (GraphBuilder("dead").add_node("src", role="custom", agent="echo")
             .add_node("a", role="custom", agent="echo").add_node("b1", role="custom", agent="route-done")
             .add_node("b2", role="custom", agent="echo").add_node("side", role="custom", agent="echo")
             .add_node("c1", role="custom", agent="echo").add_node("c2", role="custom", agent="echo")
             .add_node("join", role="custom", agent="gather", merge="concat")
             .add_edge("src", "a").add_edge("src", "b1").add_edge("src", "c1").add_edge("a", "join")
             .add_edge("b1", "b2", when="more").add_edge("b1", "side", when="done").add_edge("b2", "join")
             .add_edge("c1", "c2").add_edge("c2", "join").compile())
    tr = run_one(graph, run)
    assert tr.status == "ok" and [s.node for s in tr.steps] == ["src", "a", "b1", "c1", "side", "c2", "join"]
    assert tr.steps[-1].text.startswith("a,c2|")


def test_fan_out_inside_a_loop_joins_once_per_turn(run):
    @register_agent("always-continue")
    async def always_continue(ctx):
        return NodeOutput(text="again", route="continue")

    graph = (GraphBuilder("loop").add_node("planner", role="custom", agent="echo")
             .add_node("a", role="custom", agent="echo").add_node("b1", role="custom", agent="echo")
             .add_node("b2", role="custom", agent="echo")
             .add_node("join", role="custom", agent="gather", merge="concat")
             .add_node("verifier", role="custom", agent="always-continue")
             .add_node("gen", role="custom", agent="echo")
             .add_edge("planner", "a").add_edge("planner", "b1").add_edge("b1", "b2").add_edge("a", "join")
             .add_edge("b2", "join").add_edge("join", "verifier").add_edge("verifier", "planner", when="continue")
             .add_edge("verifier", "gen", when="stop").set(limits={"max_turns": 2}).compile())
    tr = run_one(graph, run)
    assert tr.status == "ok", tr.error
    assert [s.node for s in tr.steps] == ["planner", "a", "b1", "b2", "join", "verifier"] * 2 + ["gen"]
    joins = [s for s in tr.steps if s.node == "join"]
    assert [s.turn for s in joins] == [1, 2] and all(s.text.startswith("a,b2|") for s in joins)
    assert tr.steps[-2].bounded and tr.answer == "gen"


# --- the merged view ranks real results over failed tools, parse errors and empty output ----------------

@register_agent("tool-failed")
async def tool_failed(ctx):
    return NodeOutput(text="Error: boom", tool=ToolCall(tool="t", input="1 +", error="boom"))


@register_agent("parse-failed")
async def parse_failed(ctx):
    return NodeOutput(text="Error: boom", parse_error="no `Input:` line; used the first line")


@register_agent("five")
async def five(ctx):
    return NodeOutput(text="5", answer="5", tool=ToolCall(tool="t", input="2 + 3", output="5"))


@pytest.mark.parametrize("merge, answer", [("first", "5"), ("vote", "5"),
                                           ("concat", "[bad1]\nError: boom\n\n[bad2]\nError: boom\n\n[good]\n5")])
def test_merge_prefers_real_results(merge, answer, run):
    graph = (GraphBuilder("merge").add_node("src", role="custom", agent="echo")
             .add_node("bad1", role="custom", agent="tool-failed").add_node("good", role="custom", agent="five")
             .add_node("bad2", role="custom", agent="parse-failed")
             .add_node("join", role="custom", agent="gather", merge=merge)
             .add_edge("src", "bad1").add_edge("src", "good").add_edge("src", "bad2")
             .add_edge("bad1", "join").add_edge("good", "join").add_edge("bad2", "join").compile())
    assert run_one(graph, run).answer == answer


def test_merge_of_only_non_results_keeps_them():
    from masgraph.runtime.scheduler import _merge

    bad = [("x", NodeOutput(text="Error: a", parse_error="p")), ("y", NodeOutput(text="", no_result=True)),
           ("z", NodeOutput(text="Error: a", tool=ToolCall(tool="t", input="", error="a")))]
    assert _merge("first", bad) == "Error: a" and _merge("vote", bad) == "Error: a"
    assert _merge("concat", bad) == "[x]\nError: a\n\n[y]\n\n\n[z]\nError: a"


NO_OUTPUT = "(no output; print() the result)"  # what the python tool returns when a snippet prints nothing


def test_executor_that_printed_nothing_ranks_below_a_result(scripted, run):
    @register_tool(name="quiet")
    def quiet(code: str) -> str:
        """Prints nothing, like a python snippet without print()."""
        return NO_OUTPUT

    graph = (GraphBuilder("quiet").add_policy("p", backend="scripted").add_tool("calculator", kind="calculator")
             .add_tool("quiet", kind="quiet").add_node("planner", role="planner", policy="p")
             .add_node("calc", role="executor", tools=["calculator"]).add_node("py", role="executor", tools=["quiet"])
             .add_node("judge", role="generator", policy="p", merge="concat")
             .add_edge("planner", "calc").add_edge("planner", "py").add_edge("calc", "judge").add_edge("py", "judge")
             .compile())
    seen = []
    backend = scripted({"judge": lambda req: seen.append(req.messages[-1]["content"]) or "Answer: 5"})
    tr = run_one(graph, run, backend, "What is 2 + 3?")
    assert tr.status == "ok" and tr.steps[2].tool.output == NO_OUTPUT
    assert seen[0].endswith(f"[py]\n{NO_OUTPUT}\n\n[calc]\n5")


def test_executor_reports_tool_error_subclasses_by_message(scripted, runner_for, run):
    from masgraph.agents.tools.registry import ToolError

    class BadInput(ToolError):
        pass

    @register_tool(name="strict")
    def strict(text: str) -> str:
        """Rejects every input."""
        raise BadInput("input rejected: use digits")

    graph = (GraphBuilder("t").add_policy("p", backend="scripted").add_tool("strict", kind="strict")
             .add_node("executor", role="executor", tools=["strict"])
             .add_node("generator", role="generator", policy="p").add_edge("executor", "generator").compile())
    [tr] = run(runner_for(graph, scripted(), n=1).run_task(Sum())).traces
    assert tr.steps[0].tool.error == "input rejected: use digits" and tr.steps[0].route == "error"


# --- a sync agent runs off the event loop -----------------------------------------------------------------

@register_agent("sync-sleeper")
def sync_sleeper(ctx):
    time.sleep(1.0 if ctx.query == "slow" else 0.0)
    return NodeOutput(text="done", answer=f"{ctx.query}@{time.monotonic()}")


@pytest.mark.slow
def test_sync_agent_does_not_block_other_episodes(run):
    from masgraph.runtime.scheduler import Scheduler

    graph = GraphBuilder("sync").add_node("solo", role="custom", agent="sync-sleeper", timeout_s=5).compile()
    sched = Scheduler(graph, resolve_agents(graph.spec), {}, {}, concurrency=2)
    slow, fast = run(sched.run([EpisodeInput("s", "slow"), EpisodeInput("f", "fast")]))
    assert slow.status == fast.status == "ok"
    assert float(fast.answer.split("@")[1]) < float(slow.answer.split("@")[1]) - 0.5  # done while slow slept


@pytest.mark.slow
def test_sync_agent_node_timeout_is_enforced(run):
    graph = GraphBuilder("sync").add_node("solo", role="custom", agent="sync-sleeper", timeout_s=0.1).compile()
    tr = run_one(graph, run, query="slow")
    assert tr.status == "error" and "timed out after 0.1s" in tr.steps[0].error and tr.duration_s < 0.8


# --- topology per episode: the scheduler runs the sub-graph each episode is given ---------------------------

def test_an_edge_switched_off_changes_the_route(run):
    from masgraph.graph import Topology
    from masgraph.runtime.scheduler import Scheduler

    graph = fan_in_graph("concat")  # edges: 0 src->a, 1 src->b1, 2 src->c, 3 a->join, 4 b1->b2, 5 b2->join, 6 c->join
    sched = Scheduler(graph, resolve_agents(graph.spec), {}, {})
    whole, no_b, only_c, broken = run(sched.run([
        EpisodeInput("q", "q"),
        EpisodeInput("q", "q", topology=Topology(edges_off=frozenset({1}))),  # src->b1 off: b1, b2 never run
        EpisodeInput("q", "q", topology=Topology(nodes_off=frozenset({"a", "b1"}))),  # their edges go with them
        EpisodeInput("q", "q", topology=Topology(edges_off=frozenset({3, 5, 6}))),  # nothing reaches the join
    ]))
    assert [s.node for s in whole.steps] == ["src", "a", "b1", "c", "b2", "join"]
    assert [s.node for s in no_b.steps] == ["src", "a", "c", "join"] and no_b.steps[-1].text.startswith("a,c|")
    assert no_b.meta["topology"] == {"nodes_off": [], "edges_off": [1]}
    assert [s.node for s in only_c.steps] == ["src", "c", "join"] and only_c.answer == "x"
    assert broken.status == "error" and "topology is not a valid graph" in broken.error and not broken.steps
    assert "exit 'join' is not reachable" in broken.error


def test_a_sub_graph_is_checked_in_microseconds(root):
    """The compile check of a sub-graph (every shipped graph with each of its edges switched off in turn)."""
    from masgraph.graph import Topology, compile_spec
    from masgraph.loader import load_spec

    worst = 0.0
    for path in sorted((root / "graphs").glob("*.yaml")):
        graph = compile_spec(load_spec(path), str(path))
        for i in range(len(graph.spec.edges)):
            best = min(_timed(graph, Topology(edges_off=frozenset({i}))) for _ in range(5))  # uncached each time
            worst = max(worst, best)
    assert worst < 1e-3


def _timed(graph, topology) -> float:
    t0 = time.perf_counter()
    graph._make_view(topology)
    return time.perf_counter() - t0


@register_agent("note")
async def _note(ctx):
    from masgraph.memory.action_log import Action

    ctx.memory.append(Action(ctx.node, "noted", result="n"))
    return NodeOutput(text="n")


@register_agent("reads-memory")
async def _reads_memory(ctx):
    return NodeOutput(text=ctx.memory.render(), answer=ctx.merged)


@pytest.mark.parametrize("merge, unused", [("concat", []), ("vote", []), ("first", ["c", "b2"])])
def test_outputs_a_merge_discards_are_recorded_as_unused(merge, unused, run):
    tr = run_one(fan_in_graph(merge), run)  # src, a, b1, c, b2, join; `first` keeps a's
    assert [tr.steps[i].node for i in tr.unused_steps] == unused


def test_a_failed_episode_leaves_the_outputs_nobody_reached_unused(run):
    @register_agent("explodes-too")
    async def explodes(ctx):
        raise RuntimeError("boom")

    tr = run_one(fan_in_graph(b2="explodes-too"), run)  # src, a, b1, c, b2 (failed): a and c never reach the join
    assert [tr.steps[i].node for i in tr.unused_steps] == ["a", "c"]


@pytest.mark.parametrize("join, unused", [("reads-memory", []), ("gather", ["w"])])
def test_a_memory_entry_shown_to_a_later_prompt_counts_as_used(join, unused, run):
    graph = (GraphBuilder("mem").add_node("src", role="custom", agent="echo")
             .add_node("a", role="custom", agent="echo").add_node("w", role="custom", agent="note")
             .add_node("join", role="custom", agent=join, merge="first")
             .add_edge("src", "a").add_edge("src", "w").add_edge("a", "join").add_edge("w", "join").compile())
    tr = run_one(graph, run)  # the merge keeps a's output; w's reaches the join only through memory, if rendered
    assert tr.status == "ok" and [tr.steps[i].node for i in tr.unused_steps] == unused


def test_a_batch_of_episodes_runs_with_fewer_gc_passes_and_puts_the_callers_thresholds_back(run):
    """The finished traces pile up during a run; the default gen-0 threshold (700) rescans them ever more often
    (~10-25 % of a no-op run, masgraph/gc_scope.py). Inside a batch it is raised; after it, the caller's settings
    are back, also when batches overlap or one fails."""
    import gc

    from masgraph.runtime.gc_scope import GEN0
    from masgraph.runtime.scheduler import run_bounded

    seen: list[int] = []

    async def episode(ep, index=0):
        seen.append(gc.get_threshold()[0])
        await asyncio.sleep(0.01 * (index % 3))  # overlapping batches finish in mixed order
        if ep == "boom":
            raise RuntimeError("boom")
        return ep

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 11, 12)

        async def batches():
            return await asyncio.gather(run_bounded(episode, ["a", "b", "c"], 2),
                                        run_bounded(episode, ["d", "e"], 1))
        assert run(batches()) == [["a", "b", "c"], ["d", "e"]]
        assert seen and all(t >= GEN0 for t in seen)
        assert gc.get_threshold() == (700, 11, 12)
        with pytest.raises(RuntimeError):
            run(run_bounded(episode, ["x", "boom"], 2))
        assert gc.get_threshold() == (700, 11, 12)
        gc.set_threshold(0, 11, 12)  # automatic collection off: the caller's choice stays
        seen.clear()
        run(run_bounded(episode, ["a"], 1))
        assert seen == [0] and gc.get_threshold() == (0, 11, 12)
    finally:
        gc.set_threshold(*before)


# --- an async agent that escapes its node timeout is not recorded ok (issue 28, finding 8) ----------------

@register_agent("loop-blocker")
async def loop_blocker(ctx):
    if ctx.query == "after-await":
        await asyncio.sleep(0)  # the timer is armed, but cannot fire while the loop is blocked
    time.sleep(0.5)  # a blocking call inside `async def`
    return NodeOutput(text="done", answer="done")


@register_agent("cancel-swallower")
async def cancel_swallower(ctx):
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        pass
    return NodeOutput(text="late", answer="late")


@pytest.mark.parametrize("query", ["at-once", "after-await"])
def test_an_agent_that_blocks_the_event_loop_fails_its_step_with_the_fix(query, run):
    graph = GraphBuilder("blk").add_node("solo", role="custom", agent="loop-blocker", timeout_s=0.1,
                                         retries=1).compile()
    tr = run_one(graph, run, query=query)
    [step] = tr.steps
    assert tr.status == "error" and tr.answer is None
    assert "blocked the event loop" in step.error and "asyncio.to_thread" in step.error
    assert step.attempts == 1  # not retried: it would block every episode again


def test_an_agent_that_blocks_within_its_timeout_is_ok(run):
    graph = GraphBuilder("blk").add_node("solo", role="custom", agent="loop-blocker", timeout_s=30).compile()
    assert run_one(graph, run).status == "ok"


def test_an_agent_that_swallows_its_timeout_is_a_timed_out_step(run):
    graph = GraphBuilder("swallow").add_node("solo", role="custom", agent="cancel-swallower", timeout_s=0.1).compile()
    tr = run_one(graph, run)
    assert tr.status == "error" and tr.answer is None
    assert tr.steps[0].error == "node timed out after 0.1s" and tr.steps[0].text == ""


def test_an_episode_stalled_by_another_agent_blocking_the_loop_is_not_blamed(run):
    """Only the time inside an agent's own code counts: a waiting agent that overran because another one held
    the loop is ok (its timer could not fire either: it returned in the same loop pass)."""
    from masgraph.runtime.scheduler import Scheduler

    @register_agent("waits-briefly")
    async def waits_briefly(ctx):
        if ctx.query == "blocker":
            await asyncio.sleep(0.01)
            time.sleep(0.5)
        else:
            await asyncio.sleep(0.05)
        return NodeOutput(text=ctx.query, answer=ctx.query)

    graph = GraphBuilder("two").add_node("solo", role="custom", agent="waits-briefly", timeout_s=0.3).compile()
    sched = Scheduler(graph, resolve_agents(graph.spec), {}, {}, concurrency=2)
    blocker, waiter = run(sched.run([EpisodeInput("b", "blocker"), EpisodeInput("w", "waiter")]))
    assert "blocked the event loop" in blocker.steps[0].error
    assert "blocked" not in (waiter.steps[0].error or "")  # ok, or timed out in the same loop pass


def test_unparsed_with_an_object_generate_did_not_return_fails_the_step(scripted, runner_for, run):
    """A node that marks something other than its own completion gets an error, not a silently lost mark."""
    @register_agent("marks-a-copy")
    async def marks_a_copy(ctx):
        completion = await ctx.generate([{"role": "user", "content": ctx.query}])
        ctx.unparsed(str(completion), "off format")  # a copy of it, not the completion itself
        return NodeOutput(text="x", answer="2")

    graph = (GraphBuilder("marks").add_policy("p", backend="scripted")
             .add_node("solo", role="custom", agent="marks-a-copy", policy="p").compile())
    [tr] = run(runner_for(graph, scripted({"solo": "hello"}), n=1).run_task(Sum())).traces
    assert tr.status == "error" and "ctx.unparsed()" in tr.steps[0].error
