"""Run a graph on a task: build backends, tools and agents, drive the scheduler, store and summarise.

`masgraph run`, the benchmarks and (later) the trainers all go through `Runner`, so rollouts in
training are the same code path as evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from masgraph.agents.registry import resolve_agents
from masgraph.agents.tools.registry import build_tools
from masgraph.backends import Backend, make_backend
from masgraph.errors import MasgraphError
from masgraph.graph import Graph
from masgraph.scheduler import EpisodeInput, Policy, Scheduler
from masgraph.store import RunStore, new_run_dir
from masgraph.tasks import Item, Task
from masgraph.trace import ListSink, Sink, Trace


@dataclass
class RunConfig:
    """How to run: which items, how many at once, and how the hf backend batches."""

    n: int = 16
    """Items to run."""
    split: str = "test"
    """Task split: train | test."""
    samples: int = 1
    """Rollouts per item (a GRPO group)."""
    concurrency: int = 16
    """Episodes in flight at once."""
    seed: int = 0
    """Seeds item generation and per-request sampling."""
    deterministic: bool = False
    """hf backend: batches formed by count, rows ordered by key, seeded sampling per request."""
    max_batch_size: int = 32
    """hf backend: most requests decoded together."""
    batch_wait_ms: float = 3.0
    """hf backend: how long the batcher waits for more requests."""
    runs_dir: str = "runs"
    """Where run directories are created."""


@dataclass
class RunResult:
    traces: list[Trace]
    summary: dict[str, Any]
    run_dir: Path | None = None


class Runner:
    """Owns the backends of one graph (shared across runs, so the model loads once).

    Example:
        >>> runner = Runner(graph, RunConfig(n=8))
        >>> result = asyncio.run(runner.run_task(get_task("basic_arithmetic")))
        >>> result.summary["accuracy"]
    """

    def __init__(self, graph: Graph, config: RunConfig | None = None, backends: dict[str, Backend] | None = None):
        self.graph, self.config = graph, config or RunConfig()
        spec = graph.spec
        self.agents = resolve_agents(spec)
        self.tools = build_tools(spec.tools)
        self.backends: dict[tuple, Backend] = {}
        self.policies: dict[str, Policy] = {}
        self.last_result: RunResult | None = None
        """The latest run's result, set also when that run was cancelled (its summary counts what finished)."""
        for name, pol in spec.policies.items():
            if pol.backend == "scripted" and "scripted" not in (backends or {}):
                raise MasgraphError(
                    f"policy {name!r} uses `backend: scripted`, which replays canned replies for tests and has none "
                    "in a graph file; serve it with `backend: hf` (a local model) or `backend: litellm` (a server), "
                    "or run the graph from Python with Runner(graph, backends={'scripted': ScriptedBackend(...)})")
            key = (pol.backend, pol.model, pol.api_base)
            if key not in self.backends:
                given = (backends or {}).get(pol.backend)
                self.backends[key] = given or make_backend(pol, **self._options(pol.backend))
            backend = self.backends[key]
            if pol.adapter and hasattr(backend, "add_adapter") and pol.adapter not in getattr(backend, "versions", {}):
                backend.add_adapter(pol.adapter)
            self.policies[name] = Policy(name, pol, backend)

    def load_checkpoint(self, path: str | Path) -> Path:
        """Serve the trained adapters of a checkpoint (a run dir -> its latest, or RUN/checkpoints/step-N)."""
        from masgraph.checkpoint import checkpoint_adapters, resolve_checkpoint

        checkpoint = resolve_checkpoint(path)
        for name, adapter_dir in checkpoint_adapters(checkpoint).items():
            for backend in self.backends.values():
                if hasattr(backend, "load_adapter"):
                    backend.load_adapter(name, str(adapter_dir))
        return checkpoint

    def _options(self, kind: str) -> dict[str, Any]:
        c = self.config
        if kind == "hf":
            return {"deterministic": c.deterministic, "max_batch_size": c.max_batch_size,
                    "batch_wait_ms": c.batch_wait_ms, "seed": c.seed}
        return {}

    def scheduler(self, sinks: Sequence[Sink] = (), score: Any = None) -> Scheduler:
        return Scheduler(self.graph, self.agents, self.policies, self.tools, sinks,
                         concurrency=self.config.concurrency, seed=self.config.seed, score=score)

    async def run_items(self, task: Task, items: list[Item], sinks: Sequence[Sink] = (),
                        store: bool = True) -> RunResult:
        """Run items × samples; store the run directory unless store=False. When the run is cancelled, the
        summary (summary.json, and `last_result`) still counts every episode that finished."""
        by_id = {it.id: it for it in items}
        finished = ListSink()  # the traces that ended, also when the run is cancelled before gather returns
        all_sinks: list[Sink] = [*sinks, finished]
        run_store = None
        if store:
            run_store = RunStore(new_run_dir(self.config.runs_dir, self.graph.spec.name), self.graph.spec,
                                 {"run": asdict(self.config), "task": task.name})
            all_sinks.append(run_store)
        sched = self.scheduler(all_sinks, score=lambda ep, tr: task.reward(by_id[ep.item_id], tr))
        episodes = [EpisodeInput(it.id, it.question, s, {"gold": it.answer})
                    for it in items for s in range(self.config.samples)]
        traces: list[Trace] = []
        interrupted = False
        try:
            traces = await sched.run(episodes)  # in input order
        except BaseException:
            interrupted = True
            raise
        finally:
            traces = traces or finished.traces
            summary = summarize(traces, planned=len(episodes)) | {
                "task": task.name, "graph": self.graph.spec.name, "interrupted": interrupted,
                "sink_errors": sched.sink_errors}
            if run_store is not None:
                run_store.close(summary)
            self.last_result = RunResult(traces, summary, run_store.path if run_store else None)
        return self.last_result

    async def run_task(self, task: Task, sinks: Sequence[Sink] = (), store: bool = True) -> RunResult:
        items = task.items(self.config.split, self.config.n, self.config.seed)
        return await self.run_items(task, items, sinks, store)

    async def aclose(self) -> None:
        for b in self.backends.values():
            await b.aclose()


def mean(values: Any) -> float:
    """Arithmetic mean as a float (statistics.mean is exact but ~20x slower on large runs)."""
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(traces: list[Trace], planned: int | None = None) -> dict[str, Any]:
    """Accuracy (reward ≥ 0.5 counts as correct), mean reward, turns, tokens, failures by kind, over the episodes
    that finished; `cancelled` counts the rest of `planned` (in flight or not started when the run stopped)."""
    done = [t for t in traces if t.status != "cancelled"]
    planned = len(traces) if planned is None else planned
    out: dict[str, Any] = {"episodes": len(done), "cancelled": planned - len(done)}
    if not done:
        return out
    rewards = [t.reward or 0.0 for t in done]
    steps = [s for t in done for s in t.steps]
    tools = [s.tool for s in steps if s.tool]
    return out | {
        "accuracy": mean(r >= 0.5 for r in rewards),
        "reward_mean": mean(rewards),
        "turns_mean": mean(t.turns for t in done),
        "completion_tokens_mean": mean(t.completion_tokens for t in done),
        "llm_calls_mean": mean(len(t.llm_calls) for t in done),
        "status": {s: sum(t.status == s for t in done) for s in ("ok", "error", "timeout")},
        "parse_error_rate": mean(s.parse_error is not None for s in steps),
        "tool_error_rate": mean(tool.error is not None for tool in tools),
        "duration_s_mean": mean(t.duration_s for t in done),
    }
