"""The episode loop: plan the ready nodes, run them concurrently, route their outputs, repeat — for many
episodes at once. It emits typed events to sinks and knows nothing of training, storage or UIs.

Time limits measure work (masgraph/workclock.py): a node's `timeout_s` and the episode's `episode_timeout_s`
do not count the time an LLM call waits in the backend's queue (recorded as `queue_s` on the call, the step and
the trace), and count a call's time in a batch of n rows as 1/n (what they counted: `work_s` on the step and
the trace); a wall-clock ceiling (10x the limit, at least 600 s) still ends a step or episode that only waits."""

from __future__ import annotations

import asyncio
import inspect
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from masgraph.backends.base import Backend, Request, llm_call, replayed
from masgraph.errors import MasgraphError
from masgraph.events import (
    EpisodeFinished,
    EpisodeStarted,
    LLMCallFinished,
    Sink,
    StepFinished,
    StepStarted,
    ToolCallFinished,
    fast,
)
from masgraph.graph import Graph, GraphView, Topology
from masgraph.memory.action_log import ActionLog
from masgraph.memory.conversations import ConversationStores
from masgraph.node import Agent, NodeContext, NodeOutput, ToolFn
from masgraph.runtime.eager import _Resumed, gather_eager
from masgraph.runtime.gc_scope import fewer_collections
from masgraph.spec import EdgeSpec, PolicySpec
from masgraph.trace import LLMCall, Step, TopologyChoice, Trace
from masgraph.workclock import WAITER, CallWait, WorkClock, not_working


@dataclass(frozen=True)
class EpisodeInput:
    """One episode to run: a query and where it came from (sample = index within a group of rollouts), and
    optionally the part of the graph it runs (`topology`; default the whole graph) and its id."""

    item_id: str
    query: str
    sample: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    topology: Topology | None = None
    choice: TopologyChoice | None = None
    """The topology policy's decisions that gave `topology` (recorded in the trace)."""
    episode_id: str | None = None
    """Default: `<run index>-<item_id>-<sample>`."""
    replay: dict[tuple[str, int, int], LLMCall] | None = None
    """Calls answered from this record instead of the backend, by (node, turn, call index in the step): a branched
    sibling's shared prefix (masgraph/branching.py)."""
    sampling: dict[str, dict[str, Any]] | None = None
    """Sampling settings of this episode's calls that replace their policy's, by node (a served request's
    `temperature`, `top_p`, `max_tokens` on its answering node)."""


@dataclass
class Policy:
    """A named policy bound to the backend that serves it."""

    name: str
    spec: PolicySpec
    backend: Backend


async def run_bounded(run_episode: Callable[..., Awaitable[Trace]], episodes: Iterable[EpisodeInput],
                      concurrency: int) -> list[Trace]:
    """`run_episode(ep, index=i)` for every episode, at most `concurrency` at once, results in input order; on
    failure or cancellation the rest are cancelled and awaited."""
    gate = asyncio.Semaphore(concurrency)

    async def guarded(i: int, ep: EpisodeInput) -> Trace:
        async with gate:
            return await run_episode(ep, index=i)

    with fewer_collections():  # the finished traces pile up; default GC thresholds rescan them (masgraph/gc_scope.py)
        tasks = [asyncio.ensure_future(guarded(i, ep)) for i, ep in enumerate(episodes)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


Score = Callable[[EpisodeInput, Trace], "float | Awaitable[float]"]
"""An episode's reward: a plain function, or an async one (a scorer that calls a model: `masgraph.tasks.judge`)."""


async def apply_score(score: Score | None, ep: EpisodeInput, trace: Trace) -> None:
    """Set the reward of a finished ok episode; a scorer that raises is recorded in `trace.error`, never fatal."""
    if score is not None and trace.status == "ok":
        try:
            value = score(ep, trace)
            trace.reward = float(await value if inspect.isawaitable(value) else value)
        except Exception as exc:
            trace.error = f"reward failed: {type(exc).__name__}: {exc}"


class _StepFailed(Exception):
    pass


class _BlockedLoop(Exception):
    """An async agent ran past its node timeout without yielding to the event loop, so the timer could not fire
    (and every other episode stalled meanwhile)."""


T = TypeVar("T")


async def _within(coro: Awaitable[T], clock: WorkClock) -> T:
    """Await an agent's step under its node's work clock (its timer is armed only if the coroutine suspends, as
    `await_within` does), closing the two ways an async agent escapes its timeout: a result
    returned after the timer fired (the agent caught the CancelledError) is a TimeoutError, and an agent whose
    own code held the event loop longer than `timeout_s` (e.g. `time.sleep` in an `async def`: the timer cannot
    fire while the loop is blocked) is `_BlockedLoop`, whatever it returned. Only the time spent inside the
    agent's coroutine counts, so an agent delayed by another one blocking the loop is not blamed."""
    timeout_s = clock.limit_s
    if not isinstance(coro, Coroutine):
        async with asyncio.timeout_at(clock.deadline()) as timer:
            clock.timer = timer
            try:
                return await coro
            finally:
                clock.timer = None
    clocked = _Clocked(coro)
    steps = clocked.__await__()
    try:
        first = steps.send(None)
    except StopIteration as done:  # finished without suspending: no timer needed (see masgraph/eager.py)
        clocked.check(timeout_s)
        return done.value
    except BaseException:
        steps.close()
        raise
    async with asyncio.timeout_at(clock.deadline()) as timer:  # rescheduled as the clock stops and starts
        clock.timer = timer
        try:
            value = await _Resumed(steps, first)  # type: ignore[arg-type]  (a generator: send, throw, close)
        finally:
            clock.timer = None
    if timer.expired():  # it fired, and the agent swallowed the cancellation
        raise TimeoutError
    clocked.check(timeout_s)
    return value


class _Clocked:
    """Awaitable that drives a coroutine as `await` does (every yield, send, throw and close passed through),
    adding up the time spent inside it (`held_s`): time in which the event loop ran nothing else."""

    __slots__ = ("coro", "held_s")

    def __init__(self, coro: Coroutine[Any, Any, Any]):
        self.coro, self.held_s = coro, 0.0

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, clock = self.coro, time.perf_counter
        sent: Any = None
        exc: BaseException | None = None
        while True:
            t0 = clock()
            try:
                value = coro.send(sent) if exc is None else coro.throw(exc)
            except StopIteration as done:
                self.held_s += clock() - t0
                return done.value
            self.held_s += clock() - t0
            try:
                sent, exc = (yield value), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # e.g. the CancelledError of a timeout: delivered into the coroutine
                sent, exc = None, e

    def check(self, timeout_s: float) -> None:
        if self.held_s > timeout_s:
            raise _BlockedLoop(
                f"node blocked the event loop for {self.held_s:.1f}s, over its {timeout_s}s timeout, which could "
                "not fire meanwhile (nor could any other episode run): the async agent made a blocking call, such "
                "as time.sleep or a synchronous client, inside `async def`; fix: `await asyncio.sleep(...)` or an "
                "async client, run the blocking work with `await asyncio.to_thread(...)`, or make the agent a "
                "plain `def` (it then runs in a worker thread under its timeout)")


_Frontier = dict[str, list[tuple[str, NodeOutput]]]
"""Nodes ready this superstep -> the (source, output) inputs they have received, in plan order."""


class Scheduler:
    """Runs episodes of a compiled graph concurrently, one superstep (all ready nodes) at a time.

    A fan-in node waits until none of its branches is still live, then runs once on all their inputs;
    branches that died (no edge fired) are not waited for.

    Example:
        >>> sched = Scheduler(graph, agents, policies, tools={}, sinks=[ListSink()], concurrency=16)
        >>> traces = asyncio.run(sched.run([EpisodeInput("q1", "What is 2+3?")]))
    """

    def __init__(self, graph: Graph, agents: dict[str, Agent], policies: dict[str, Policy],
                 tools: dict[str, ToolFn], sinks: Sequence[Sink] = (), concurrency: int = 8, seed: int = 0,
                 score: Score | None = None,
                 tool_descriptions: dict[str, str] | None = None, conversations: ConversationStores | None = None,
                 memo_greedy: bool = False):
        self.graph, self.policies, self.tools = graph, policies, tools
        self._memo: dict[tuple, asyncio.Future] | None = {} if memo_greedy else None
        """With `memo_greedy`: a greedy (temperature 0) call whose policy and messages equal an earlier one's of this
        scheduler takes that call's completion instead of decoding again (counterfactual variants, which re-run the
        same frozen reader on mostly the same inputs); in-flight duplicates wait for the first."""
        self.conversations = conversations
        """Conversation memories (`scope: conversation` memory nodes); None: each such episode keeps its own."""
        self.agents = {name: _as_async(agent) for name, agent in agents.items()}
        self.sinks, self.concurrency, self.seed, self.score = list(sinks), concurrency, seed, score
        if tool_descriptions is None:
            from masgraph.registry import default_registry
            from masgraph.tools import tool_descriptions as describe

            tool_descriptions = describe((graph.registry or default_registry()).tools, graph.spec.tools)
        self.tool_descriptions = tool_descriptions
        self._spec = graph.spec
        self._node_tools = {n: {t: tools[t] for t in (getattr(s, "tools", None) or tools) if t in tools}
                            for n, s in self._spec.nodes.items()}
        self.sink_errors = 0
        """Events a sink failed to take (counted, never fatal)."""

    async def run(self, episodes: Iterable[EpisodeInput]) -> list[Trace]:
        """Run all episodes under the concurrency limit; every episode yields a Trace, failed ones too."""
        return await run_bounded(self.run_episode, episodes, self.concurrency)

    async def run_episode(self, ep: EpisodeInput, index: int = 0) -> Trace:
        """Run one episode on its topology (the whole graph by default); it always yields a Trace."""
        trace = Trace(episode_id=ep.episode_id or f"{index:06d}-{ep.item_id}-{ep.sample}", item_id=ep.item_id,
                      query=ep.query, meta={"sample": ep.sample, **ep.meta}, topology=ep.choice)
        if ep.topology is not None:
            trace.meta["topology"] = ep.topology.to_dict()
        self._emit(EpisodeStarted(episode_id=trace.episode_id, item_id=ep.item_id, query=ep.query,
                                  started=time.time()))
        t0 = time.perf_counter()
        clock = WorkClock(self._spec.limits.episode_timeout_s, highest=True)  # working while any node step works
        try:
            if ep.topology is None and self._spec.topology is not None:
                raise _StepFailed(f"graph {self._spec.name!r} declares a `topology:`, so an episode runs one of its "
                                  "sub-graphs, not the whole: give the episode a topology (TopologyPolicy.sample; a "
                                  "Runner samples one itself)")
            view = self.graph.view(ep.topology)
            if view.problems:
                raise _StepFailed("the episode's topology is not a valid graph: "
                                  + "; ".join(f"{p.path}: {p.message}" for p in view.problems))
            async with asyncio.timeout_at(clock.deadline()) as timer:  # the episode's work clock
                clock.timer = timer
                try:
                    await self._loop(ep, trace, index, view, clock)
                finally:
                    clock.timer = None
        except TimeoutError:
            trace.status, trace.error = "timeout", clock.describe("episode")
        except asyncio.CancelledError:
            trace.status, trace.error = "cancelled", "run interrupted"
            trace.duration_s, trace.queue_s, trace.work_s = time.perf_counter() - t0, clock.waited_s(), clock.work_s()
            self._emit(EpisodeFinished(trace=trace))
            raise
        except _StepFailed as exc:
            trace.status, trace.error = "error", str(exc)
        except Exception as exc:  # a bug in an agent or sink must not take the run down
            trace.status, trace.error = "error", f"{type(exc).__name__}: {exc}"
        trace.duration_s, trace.queue_s, trace.work_s = time.perf_counter() - t0, clock.waited_s(), clock.work_s()
        await apply_score(self.score, ep, trace)
        self._emit(EpisodeFinished(trace=trace))
        return trace

    async def _loop(self, ep: EpisodeInput, trace: Trace, index: int, view: GraphView, clock: WorkClock) -> None:
        spec, limits = self._spec, self._spec.limits
        memory = ActionLog(spec.memory.max_actions, spec.memory.max_result_chars)
        runs: Counter[str] = Counter()
        frontier: _Frontier = {spec.entry: []}
        reads = _Reads()
        try:
            while frontier:
                ready, waiting = _plan(frontier, view.waits_for)
                for node in ready:
                    if node in view.cycle_of and runs[node] >= (limits.max_turns or 1):
                        raise _StepFailed(f"node {node!r} would exceed max_turns={limits.max_turns}")
                if len(trace.steps) + len(ready) > limits.max_steps:
                    raise _StepFailed(f"episode exceeded max_steps={limits.max_steps}")
                for node, inputs in ready.items():
                    runs[node] += 1
                    if inputs:
                        reads.received(spec.nodes[node].merge, inputs)
                if len(ready) == 1:
                    [(node, inputs)] = ready.items()
                    results = [await self._step(ep, trace, index, node, runs[node], inputs, memory, clock)]
                else:
                    results = await gather_eager([self._step(ep, trace, index, n, runs[n], inp, memory, clock)
                                                  for n, inp in ready.items()])
                nxt = waiting  # a waiting fan-in node keeps the inputs it has so far
                answer = None
                for node, out, step in results:  # routed first, so a step event never changes after it is sent
                    if node == spec.exit:
                        answer = out.answer if out.answer is not None else out.text
                    elif step.error is None:
                        for edge in _route(view, limits.max_turns, node, out, runs[node], step):
                            nxt.setdefault(edge.target, []).append((node, out))
                for _, _, step in results:  # recorded in plan order, so traces do not depend on timing
                    step.index = len(trace.steps)
                    trace.steps.append(step)
                    self._emit(fast(StepFinished, step=step))
                reads.made(results, memory)
                failed = next((s for _, _, s in results if s.error is not None), None)
                if failed is not None:
                    raise _StepFailed(f"node {failed.node!r} failed after {failed.attempts} attempt(s): "
                                      f"{failed.error}")
                if answer is not None:
                    trace.answer = answer
                    return
                frontier = nxt
            raise _StepFailed("no edge fired and the exit node was not reached")
        finally:
            trace.unused_steps = reads.unused(trace.steps, spec.exit, memory)

    async def _step(self, ep: EpisodeInput, trace: Trace, index: int, node: str, turn: int,
                    inputs: list[tuple[str, NodeOutput]], memory: ActionLog, episode: WorkClock
                    ) -> tuple[str, NodeOutput, Step]:
        nspec = self._spec.nodes[node]
        started, t0 = time.time(), time.perf_counter()
        self._emit(fast(StepStarted, episode_id=trace.episode_id, node=node, turn=turn, started=started))
        agent, merged = self.agents[node], _merge(nspec.merge, inputs)
        out, error, calls, attempt, queue_s, work_s = NodeOutput(), None, [], 0, 0.0, 0.0
        for attempt in range(1, nspec.retries + 2):  # noqa: B007 (the last attempt's number is recorded)
            calls = []  # only the last attempt's LLM calls are part of the step
            clock = WorkClock(nspec.timeout_s, episode)  # this attempt's work clock, one of the episode's steps
            generate, unparsed = self._generator(ep, trace, index, node, turn, calls, clock)
            ctx = NodeContext(node, self._spec, ep.query, turn, inputs, merged, memory, generate,
                              self._node_tools[node], self.tool_descriptions, _slot_prompt(ep.topology, node),
                              conversation=ep.meta.get("conversation"), conversations=self.conversations,
                              waiting=partial(not_working, clock), unparsed=unparsed)
            try:
                out = await _within(agent(ctx), clock)  # no task per step, unlike wait_for
                error = None
                break
            except _BlockedLoop as exc:  # not retried: it would stall every episode again
                error = str(exc)
                break
            except TimeoutError:
                error = clock.describe("node")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            finally:
                clock.close()
                queue_s, work_s = queue_s + clock.stopped_s, work_s + clock.worked_s
        # built once at the end: pydantic attribute assignment costs ~2 µs each on this hot path
        step = Step(episode_id=trace.episode_id, index=0, node=node, role=nspec.role, turn=turn,
                    route=out.route, sources=[src for src, _ in inputs], text=out.text, llm=calls, tool=out.tool,
                    parse_error=out.parse_error, error=error, memory_ops=out.memory_ops, attempts=attempt,
                    started=started, duration_s=time.perf_counter() - t0, queue_s=queue_s, work_s=work_s)
        if out.tool is not None:
            self._emit(fast(ToolCallFinished, episode_id=trace.episode_id, node=node, turn=turn, tool=out.tool.tool,
                            ok=out.tool.error is None, duration_s=out.tool.duration_s))
        return node, out, step

    def _generator(self, ep: EpisodeInput, trace: Trace, index: int, node: str, turn: int, calls: list[LLMCall],
                   clock: WorkClock):
        """The step's `generate` (each call recorded in `calls`) and `unparsed` (marks the recorded call that returned
        a given completion as off-format)."""
        policy_name = self._spec.nodes[node].policy
        made: list[tuple[Any, LLMCall]] = []  # (completion handed to the node, its record)

        def unparsed(completion: Any, reason: str) -> None:
            for c, call in made:
                if c is completion:
                    call.parse_error = reason
                    return
            raise MasgraphError(f"node {node!r}: ctx.unparsed() was given an object that none of this step's "
                                "generate() calls returned; pass it the completion generate() returned")

        async def generate(messages: list[dict[str, str]]):
            if policy_name is None:
                raise MasgraphError(f"node {node!r} has no `policy:` to generate with; give it one in the graph")
            policy = self.policies[policy_name]
            k = len(calls)
            if ep.replay and (node, turn, k) in ep.replay:  # a branched sibling's shared prefix
                calls.append(ep.replay[(node, turn, k)].model_copy(update={"parse_error": None}))
                made.append((replayed(calls[-1]), calls[-1]))
                return made[-1][0]
            seed = zlib.crc32(f"{self.seed}|{ep.item_id}|{ep.sample}|{node}|{turn}|{k}".encode())
            sampling = policy.spec.sampling
            if ep.sampling and node in ep.sampling:
                sampling = sampling.model_copy(update=ep.sampling[node])
            req = Request(messages, policy_name, policy.spec.adapter, sampling, seed, key=(index, node, turn, k))
            t0 = time.perf_counter()
            wait = CallWait(clock)  # the backend's queue charges the call's wait to it, not to the node's clock
            WAITER.set(wait)  # (not reset: this may resume in another context, see eager.py; a stale one is inert)
            if self._memo is not None and not sampling.temperature:
                [c] = await self._memoised((policy_name, policy.spec.adapter, repr(messages)), policy.backend, req)
            else:
                [c] = await policy.backend.complete([req])
            latency = time.perf_counter() - t0
            calls.append(llm_call(req, c, latency, wait.queue_s))
            made.append((c, calls[-1]))
            self._emit(LLMCallFinished.of(calls[-1], trace.episode_id, node, turn))
            return c

        return generate, unparsed

    async def _memoised(self, key: tuple, backend: Backend, req: Request) -> list[Any]:
        """`backend.complete([req])`, shared by every call with this key (a failed or cancelled one is forgotten)."""
        memo = self._memo
        assert memo is not None
        shared = memo.get(key)
        if shared is None:
            shared = memo[key] = asyncio.ensure_future(backend.complete([req]))

            def forget_failure(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    memo.pop(key, None)
            shared.add_done_callback(forget_failure)
        return await asyncio.shield(shared)

    def _emit(self, event: Any) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:  # a broken sink is counted, never fatal
                self.sink_errors += 1


def _slot_prompt(topology: Topology | None, node: str) -> str | None:
    """The prompt an episode's topology gives a slot node (None for every other node)."""
    if topology is None or not topology.prompts:
        return None
    return next((p for n, p in topology.prompts if n == node), None)


def _plan(frontier: _Frontier, waits_for: dict[str, frozenset[str]]) -> tuple[_Frontier, _Frontier]:
    """Split the frontier into the nodes to run now and the fan-in nodes that wait: those that another frontier
    node can still reach (a live branch). One always runs: the graph minus back edges is a DAG."""
    if len(frontier) == 1 or not waits_for:
        return frontier, {}
    waiting = {n: inputs for n, inputs in frontier.items() if n in waits_for and not waits_for[n].isdisjoint(frontier)}
    if not waiting:
        return frontier, {}
    return {n: inputs for n, inputs in frontier.items() if n not in waiting}, waiting


def _route(view: GraphView, max_turns: int | None, node: str, out: NodeOutput, turn: int, step: Step) -> list[EdgeSpec]:
    """The edges that fire after a step: unconditional ones and those whose `when` is the step's route; on a loop's
    last allowed turn, only edges leaving the loop (the turn bound forces the exit)."""
    edges = view.out_edges[node]
    fired = [e for e in edges if e.when is None or e.when == out.route]
    if max_turns is not None and turn >= max_turns and node in view.cycle_of:
        leaving = [e for e in edges if view.leaves_cycle(e)]
        if leaving:
            step.bounded = True  # (rare: one assignment per bounded loop)
            return [e for e in leaving if e in fired] or leaving
    return fired


class _Reads:
    """Which steps' outputs later steps used, for `Trace.unused_steps`: received as an input that the merge kept,
    or appended to memory and shown by a later render. Holds the outputs and entries it maps (by `id`), so their
    ids cannot be reused within the episode."""

    def __init__(self) -> None:
        self.outputs: dict[int, tuple[NodeOutput, int]] = {}  # id(output) -> (output, index of its step)
        self.entries: dict[int, tuple[object, int]] = {}  # id(memory entry) -> (entry, index of the step)
        self.used: set[int] = set()

    def received(self, merge: str | None, inputs: list[tuple[str, NodeOutput]]) -> None:
        for out in _read(merge, inputs):
            made = self.outputs.get(id(out))
            if made is not None:
                self.used.add(made[1])

    def made(self, results: list[tuple[str, NodeOutput, Step]], memory: ActionLog) -> None:
        for _, out, step in results:
            self.outputs[id(out)] = (out, step.index)
        actions = memory.actions
        if not actions or id(actions[-1]) in self.entries:  # nothing new (on the hot path: no scan)
            return
        by_node = {step.node: step.index for _, _, step in results}
        for entry in actions:  # the new entries belong to the step of the node that wrote them
            if id(entry) not in self.entries and entry.node in by_node:
                self.entries[id(entry)] = (entry, by_node[entry.node])

    def unused(self, steps: list[Step], exit_node: str, memory: ActionLog) -> list[int]:
        shown = {i for key, (_, i) in self.entries.items() if key in memory.shown}
        return [s.index for s in steps
                if s.error is None and s.node != exit_node and s.index not in self.used and s.index not in shown]


def _read(rule: str | None, inputs: list[tuple[str, NodeOutput]]) -> list[NodeOutput]:
    """The inputs whose content `_merge` keeps: all, except that `first` keeps one."""
    if len(inputs) > 1 and rule == "first":
        results = [o for _, o in inputs if o.has_result]
        return [(results or [o for _, o in inputs])[0]]
    return [o for _, o in inputs]


def _merge(rule: str | None, inputs: list[tuple[str, NodeOutput]]) -> str:
    """Merge parallel inputs, real results over non-results (failed tool, parse error, nothing printed):
    first (the first real result), vote (most common answer among the real results, if any), concat
    (labelled, real results last: the embedded model copies what comes last)."""
    if not inputs:
        return ""
    if len(inputs) == 1:
        return inputs[0][1].text
    if rule == "first":
        return _read(rule, inputs)[0].text
    results = [(src, o) for src, o in inputs if o.has_result]
    if rule == "vote":
        votes = Counter((o.answer or o.text).strip() for _, o in results or inputs)
        return votes.most_common(1)[0][0]
    others = [(src, o) for src, o in inputs if not o.has_result]
    return "\n\n".join(f"[{src}]\n{o.text}" for src, o in others + results)


def _as_async(agent: Agent) -> Agent:
    """A plain `def` agent runs in a worker thread, so it neither stalls other episodes nor escapes its
    node timeout (on timeout the thread is abandoned: Python cannot stop it, it finishes in the background)."""
    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__):
        return agent

    async def threaded(ctx: NodeContext) -> NodeOutput:
        out = await asyncio.to_thread(agent, ctx)
        return await out if inspect.isawaitable(out) else out  # a def that returns a coroutine
    return threaded
