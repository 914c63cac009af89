"""The episode loop: plan the ready nodes, run them concurrently, route their outputs, repeat — for many
episodes at once. It emits typed events to sinks and knows nothing of training, storage or UIs."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from masgraph.backends.base import Backend, Request
from masgraph.graph import Graph
from masgraph.memory.action_log import ActionLog
from masgraph.node import Agent, NodeContext, NodeOutput, ToolFn
from masgraph.spec import EdgeSpec, PolicySpec
from masgraph.trace import EpisodeFinished, EpisodeStarted, LLMCall, Sink, Step, StepFinished, Trace


@dataclass(frozen=True)
class EpisodeInput:
    """One episode to run: a query and where it came from (sample = index within a group of rollouts)."""

    item_id: str
    query: str
    sample: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Policy:
    """A named policy bound to the backend that serves it."""

    name: str
    spec: PolicySpec
    backend: Backend


class _StepFailed(Exception):
    pass


class Scheduler:
    """Runs episodes of a compiled graph concurrently.

    Example:
        >>> sched = Scheduler(graph, agents, policies, tools={}, sinks=[ListSink()], concurrency=16)
        >>> traces = asyncio.run(sched.run([EpisodeInput("q1", "What is 2+3?")]))
    """

    def __init__(self, graph: Graph, agents: dict[str, Agent], policies: dict[str, Policy],
                 tools: dict[str, ToolFn], sinks: Sequence[Sink] = (), concurrency: int = 8, seed: int = 0,
                 score: Callable[[EpisodeInput, Trace], float] | None = None):
        self.graph, self.agents, self.policies, self.tools = graph, agents, policies, tools
        self.sinks, self.concurrency, self.seed, self.score = list(sinks), concurrency, seed, score
        self._spec = graph.spec
        self._out_edges = {n: graph.out_edges(n) for n in self._spec.nodes}
        self._node_tools = {n: {t: tools[t] for t in (getattr(s, "tools", None) or tools) if t in tools}
                            for n, s in self._spec.nodes.items()}
        self.sink_errors = 0
        """Events a sink failed to take (counted, never fatal)."""

    async def run(self, episodes: Iterable[EpisodeInput]) -> list[Trace]:
        """Run all episodes under the concurrency limit; every episode yields a Trace, failed ones too."""
        gate = asyncio.Semaphore(self.concurrency)

        async def guarded(i: int, ep: EpisodeInput) -> Trace:
            async with gate:
                return await self.run_episode(ep, index=i)

        tasks = [asyncio.ensure_future(guarded(i, ep)) for i, ep in enumerate(episodes)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def run_episode(self, ep: EpisodeInput, index: int = 0) -> Trace:
        trace = Trace(episode_id=f"{index:06d}-{ep.item_id}-{ep.sample}", item_id=ep.item_id, query=ep.query,
                      meta={"sample": ep.sample, **ep.meta})
        self._emit(EpisodeStarted(episode_id=trace.episode_id, item_id=ep.item_id, query=ep.query))
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self._spec.limits.episode_timeout_s):
                await self._loop(ep, trace, index)
        except TimeoutError:
            trace.status, trace.error = "timeout", f"episode exceeded {self._spec.limits.episode_timeout_s}s"
        except asyncio.CancelledError:
            trace.status, trace.error = "cancelled", "run interrupted"
            trace.duration_s = time.perf_counter() - t0
            self._emit(EpisodeFinished(trace=trace))
            raise
        except _StepFailed as exc:
            trace.status, trace.error = "error", str(exc)
        except Exception as exc:  # a bug in an agent or sink must not take the run down
            trace.status, trace.error = "error", f"{type(exc).__name__}: {exc}"
        trace.duration_s = time.perf_counter() - t0
        if self.score is not None and trace.status == "ok":
            try:
                trace.reward = float(self.score(ep, trace))
            except Exception as exc:
                trace.error = f"reward failed: {type(exc).__name__}: {exc}"
        self._emit(EpisodeFinished(trace=trace))
        return trace

    async def _loop(self, ep: EpisodeInput, trace: Trace, index: int) -> None:
        spec, limits = self._spec, self._spec.limits
        memory = ActionLog(spec.memory.max_actions, spec.memory.max_result_chars)
        runs: Counter[str] = Counter()
        frontier: dict[str, list[tuple[str, NodeOutput]]] = {spec.entry: []}
        while frontier:
            for node in frontier:
                if node in self.graph.cycle_of and runs[node] >= (limits.max_turns or 1):
                    raise _StepFailed(f"node {node!r} would exceed max_turns={limits.max_turns}")
            if len(trace.steps) + len(frontier) > limits.max_steps:
                raise _StepFailed(f"episode exceeded max_steps={limits.max_steps}")
            for node in frontier:
                runs[node] += 1
            if len(frontier) == 1:
                [(node, inputs)] = frontier.items()
                results = [await self._step(ep, trace, index, node, runs[node], inputs, memory)]
            else:
                results = await asyncio.gather(*(self._step(ep, trace, index, n, runs[n], inp, memory)
                                                 for n, inp in frontier.items()))
            for _, _, step in results:  # recorded in plan order, so traces do not depend on timing
                step.index = len(trace.steps)
                trace.steps.append(step)
                self._emit(StepFinished(step=step))
            failed = next((s for _, _, s in results if s.error is not None), None)
            if failed is not None:
                raise _StepFailed(f"node {failed.node!r} failed after {failed.attempts} attempt(s): {failed.error}")
            nxt: dict[str, list[tuple[str, NodeOutput]]] = {}
            for node, out, step in results:
                if node == spec.exit:
                    trace.answer = out.answer if out.answer is not None else out.text
                    return
                for edge in self._route(node, out, runs[node], step):
                    nxt.setdefault(edge.target, []).append((node, out))
            frontier = nxt
        raise _StepFailed("no edge fired and the exit node was not reached")

    def _route(self, node: str, out: NodeOutput, turn: int, step: Step) -> list[EdgeSpec]:
        edges = self._out_edges[node]
        fired = [e for e in edges if e.when is None or e.when == out.route]
        max_turns = self._spec.limits.max_turns
        if max_turns is not None and turn >= max_turns and node in self.graph.cycle_of:
            leaving = [e for e in edges if self.graph.leaves_cycle(e)]
            if leaving:  # the turn bound forces the loop's exit
                step.bounded = True  # (rare: one assignment per bounded loop)
                return [e for e in leaving if e in fired] or leaving
        return fired

    async def _step(self, ep: EpisodeInput, trace: Trace, index: int, node: str, turn: int,
                    inputs: list[tuple[str, NodeOutput]], memory: ActionLog) -> tuple[str, NodeOutput, Step]:
        nspec = self._spec.nodes[node]
        started, t0 = time.time(), time.perf_counter()
        agent, merged = self.agents[node], _merge(nspec.merge, inputs)
        out, error, calls, attempt = NodeOutput(), None, [], 0
        for attempt in range(1, nspec.retries + 2):
            calls = []  # only the last attempt's LLM calls are part of the step
            ctx = NodeContext(node, self._spec, ep.query, turn, inputs, merged, memory,
                              self._generator(ep, index, node, turn, calls), self._node_tools[node])
            try:
                async with asyncio.timeout(nspec.timeout_s):  # no extra task per step, unlike wait_for
                    out = await agent(ctx)
                error = None
                break
            except TimeoutError:
                error = f"node timed out after {nspec.timeout_s}s"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        # built once at the end: pydantic attribute assignment costs ~2 µs each on this hot path
        step = Step(episode_id=trace.episode_id, index=0, node=node, role=nspec.role, turn=turn,
                    route=out.route, text=out.text, llm=calls, tool=out.tool, parse_error=out.parse_error,
                    error=error, attempts=attempt, started=started, duration_s=time.perf_counter() - t0)
        return node, out, step

    def _generator(self, ep: EpisodeInput, index: int, node: str, turn: int, calls: list[LLMCall]):
        policy_name = self._spec.nodes[node].policy

        async def generate(messages: list[dict[str, str]]):
            if policy_name is None:
                raise RuntimeError(f"node {node!r} has no policy to generate with")
            policy = self.policies[policy_name]
            k = len(calls)
            seed = zlib.crc32(f"{self.seed}|{ep.item_id}|{ep.sample}|{node}|{turn}|{k}".encode())
            req = Request(messages, policy_name, policy.spec.adapter, policy.spec.sampling, seed,
                          key=(index, node, turn, k))
            t0 = time.perf_counter()
            [c] = await policy.backend.complete([req])
            calls.append(LLMCall(
                policy=policy_name, adapter=policy.spec.adapter, policy_version=c.policy_version,
                prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, logprobs=c.logprobs, text=c.text,
                finish_reason=c.finish_reason, prompt_truncated=c.prompt_truncated,
                latency_s=time.perf_counter() - t0))
            return c

        return generate

    def _emit(self, event: Any) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:  # a broken sink is counted, never fatal
                self.sink_errors += 1


def _merge(rule: str | None, inputs: list[tuple[str, NodeOutput]]) -> str:
    """Merge parallel inputs: concat (labelled), vote (most common answer), first."""
    if not inputs:
        return ""
    if len(inputs) == 1 or rule == "first":
        return inputs[0][1].text
    if rule == "vote":
        votes = Counter((o.answer or o.text).strip() for _, o in inputs)
        return votes.most_common(1)[0][0]
    return "\n\n".join(f"[{src}]\n{o.text}" for src, o in inputs)
