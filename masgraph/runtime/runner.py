"""Run a graph on a task: items x samples through the engine's scheduler, stored and summarised.

`masgraph run`, the benchmarks and the trainers' rollouts and evaluations all go through `Runner`, so rollouts
in training are the same code path as evaluation."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from masgraph.backends import Backend
from masgraph.errors import MasgraphError
from masgraph.events import ListSink, Sink
from masgraph.graph import Graph
from masgraph.registry import Registry
from masgraph.rundir.store import RunStore, new_run_dir
from masgraph.runtime.engine import BackendOptions, Engine, EngineLike
from masgraph.runtime.scheduler import EpisodeInput, Policy, Scheduler
from masgraph.tasks import CORRECT, Item, Task, is_correct, task_ref
from masgraph.trace import Trace


class TopologySampler(Protocol):
    """What picks an episode's topology (a `TopologyPolicy`): `sample(query, seed, greedy)` returns an object with
    `.topology` (a `Topology`) and `.choice` (a `TopologyChoice`)."""

    def sample(self, query: str, seed: int | None = None, greedy: bool = False) -> Any: ...


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
    topology: Literal["sample", "greedy"] = "sample"
    """With a topology policy: each episode samples its topology, or takes the most likely one."""


@dataclass
class RunResult:
    traces: list[Trace]
    summary: dict[str, Any]
    run_dir: Path | None = None


@dataclass
class RunContext:
    """What a run's extension may use: the runner, the task, its items by id, and the run's own scheduler (its
    sinks, e.g. the run directory and progress, see every episode it runs)."""

    runner: Runner
    task: Task
    items: dict[str, Item]
    scheduler: Scheduler


class RunExtension(Protocol):
    """Shapes the episodes of one run beyond items × samples (training's rollout shaping lives on the trainer
    side, `masgraph.learn.rollouts`; the runner only calls this)."""

    def starts(self, samples: int) -> int:
        """How many of an item's `samples` the runner starts as independent episodes (sample indices 0..n-1)."""
        ...

    async def extend(self, run: RunContext, episodes: list[EpisodeInput], traces: list[Trace]) -> list[Trace]:
        """After the started `episodes` finished as `traces` (in input order): every trace of the run, each item's
        `samples` kept together; may run more episodes (on `run.scheduler`) and annotate traces."""
        ...


class Runner:
    """Runs tasks on one engine (its backends shared across runs, so the model loads once).

    Example:
        >>> runner = Runner(graph, RunConfig(n=8))
        >>> result = asyncio.run(runner.run_task(get_task("basic_arithmetic")))
        >>> result.summary["accuracy"]
    """

    def __init__(self, graph: Graph, config: RunConfig | None = None, backends: dict[str, Backend] | None = None,
                 registry: Registry | None = None, engine: EngineLike | None = None,
                 topology: TopologySampler | None = None, log_dir: str | Path | None = None):
        self.graph, self.config = graph, config or RunConfig()
        if topology is None and graph.spec.topology is not None:  # a supergraph never runs whole
            from masgraph.topology.policy import load_policy

            topology = load_policy(graph)
        self.topology = topology
        """A topology policy (`masgraph.topology.policy.TopologyPolicy`): every episode runs the sub-graph it picks
        for its query (recorded in the trace). Default: none for a plain graph (it runs whole), the untrained
        uniform prior for a graph with a `topology:` section."""
        c = self.config
        self.engine = engine or Engine(graph, registry, backends, BackendOptions(
            c.deterministic, c.max_batch_size, c.batch_wait_ms, c.seed, str(log_dir) if log_dir else None))
        self._judges: dict[str, Any] = {}
        self.last_result: RunResult | None = None
        """The latest run's result, set also when that run was cancelled (its summary counts what finished)."""

    @property
    def backends(self) -> dict[tuple, Backend]:
        return self.engine.backends

    @property
    def policies(self) -> dict[str, Policy]:
        return self.engine.policies

    def load_checkpoint(self, path: str | Path) -> Path:
        """Serve the trained adapters of a checkpoint (a run dir -> its latest, or RUN/checkpoints/step-N)."""
        return self.engine.load_checkpoint(path)

    def scheduler(self, sinks: Sequence[Sink] = (), score: Any = None) -> Scheduler:
        return self.engine.scheduler(sinks, score, concurrency=self.config.concurrency, seed=self.config.seed)

    async def run_items(self, task: Task, items: list[Item], sinks: Sequence[Sink] = (),
                        store: bool = True, run_dir: Path | None = None,
                        extension: RunExtension | None = None, meta: dict[str, Any] | None = None,
                        id_prefix: str = "") -> RunResult:
        """Run items × samples; store the run directory (a new one under `runs_dir`, or `run_dir`) unless
        store=False. When the run is cancelled, the summary (summary.json, and `last_result`) still counts every
        episode that finished. An `extension` (training's rollout shaping, `masgraph.learn.rollouts`) decides how
        many of an item's samples start as independent episodes and runs more episodes after them. `meta` goes
        into every episode's `Trace.meta` and `id_prefix` before its id (a training run's evaluation marks its
        episodes so)."""
        by_id = {it.id: it for it in items}
        finished = ListSink()  # the traces that ended, also when the run is cancelled before gather returns
        all_sinks: list[Sink] = [*sinks, finished]
        run_store = None
        if store:
            run_store = RunStore(run_dir or new_run_dir(self.config.runs_dir, self.graph.spec.name), self.graph.spec,
                                 {"run": asdict(self.config), "task": task_ref(task)})
            all_sinks.append(run_store)
        samples = self.config.samples
        sched = self.scheduler(all_sinks, score=self.scorer(task, by_id))
        starts = extension.starts(samples) if extension is not None else samples
        episodes = [EpisodeInput(it.id, it.question, s, {"gold": it.answer, **_type_of(it), **(meta or {})})
                    for it in items for s in range(starts)]
        if id_prefix:
            episodes = [replace(ep, episode_id=f"{id_prefix}{k:06d}-{ep.item_id}-{ep.sample}")
                        for k, ep in enumerate(episodes)]
        if self.topology is not None:
            greedy = self.config.topology == "greedy"
            episodes = [self._with_topology(ep, greedy) for ep in episodes]
        traces: list[Trace] = []
        interrupted = False
        try:
            traces = await sched.run(episodes)  # in input order
            if extension is not None:
                traces = await extension.extend(RunContext(self, task, by_id, sched), episodes, traces)
        except BaseException:
            interrupted = True
            raise
        finally:
            traces = traces or finished.traces
            summary = summarize(traces, planned=len(items) * self.config.samples) | {
                "task": task.name, "graph": self.graph.spec.name, "interrupted": interrupted,
                "sink_errors": sched.sink_errors}
            if run_store is not None:
                run_store.close(summary)
            self.last_result = RunResult(traces, summary, run_store.path if run_store else None)
        return self.last_result

    def scorer(self, task: Task, by_id: dict[str, Item]) -> Any:
        """The run's reward: the task's own scoring, or its judge's (a task with a `judge`: an async call)."""
        spec = getattr(task, "judge", None)
        if spec is None:
            return lambda ep, tr: score_episode(task, by_id[ep.item_id], tr)
        judge = self.judge(spec)

        async def judged(ep: EpisodeInput, trace: Trace) -> float:
            item = by_id[ep.item_id]
            reward = await judge.score(item.question, item.meta.get("gold") or [item.answer], trace)
            trace.meta[CORRECT] = bool(task.correct(item, trace, reward))
            return reward
        return judged

    def require_driver(self, what: str, fix: str) -> None:
        """Refuse `what` on Ray rollout workers: it needs the driver's own engine (its policies)."""
        if not self.engine.in_process:
            raise MasgraphError(f"{what} needs the driver's engine: not available with Ray rollouts yet; {fix}")

    def judge(self, spec: Any) -> Any:
        """The judge `spec` (a `masgraph.judge.JudgeSpec`) describes, built once per runner; its model is served by
        this engine (shared with the graph's policies when it names the same model)."""
        from masgraph.tasks.judge import Judge

        key = spec.model_dump_json()
        if key not in self._judges:
            self.require_driver("a judge scorer", "score with a string scorer, or run without --ray")
            self._judges[key] = Judge(self.engine.policy("judge", spec.policy), spec, self.engine.registry)
        return self._judges[key]

    def _with_topology(self, ep: EpisodeInput, greedy: bool) -> EpisodeInput:
        """The episode with the topology its policy picks (seeded per run seed, item and sample)."""
        assert self.topology is not None
        seed = zlib.crc32(f"{self.config.seed}|{ep.item_id}|{ep.sample}|topology".encode())
        picked = self.topology.sample(ep.query, seed=seed, greedy=greedy)
        return replace(ep, topology=picked.topology, choice=picked.choice)

    async def run_task(self, task: Task, sinks: Sequence[Sink] = (), store: bool = True) -> RunResult:
        items = task.items(self.config.split, self.config.n, self.config.seed)
        return await self.run_items(task, items, sinks, store)

    async def aclose(self) -> None:
        for judge in self._judges.values():
            judge.close()
        await self.engine.aclose()


def _type_of(item: Item) -> dict[str, Any]:
    """A mixed task's query type (`Item.meta["type"]`), kept in the episode's meta (per-type metrics read it)."""
    return {"type": item.meta["type"]} if "type" in item.meta else {}


def score_episode(task: Task, item: Item, trace: Trace) -> float:
    """The episode's reward; the task's verdict on it (`Task.correct`) is recorded beside it in `trace.meta`, so
    every reader of the trace (summaries, the episode index, watch, benchmarks) counts the same episodes correct."""
    reward = task.reward(item, trace)
    trace.meta[CORRECT] = bool(task.correct(item, trace, reward))
    return reward


FAILURE_KINDS = ("timeout", "error", "cancelled", "parse")
"""How an episode can fail, as summaries count them: timed out, errored (a step, the run or its scorer), cancelled
(in flight or not started when the run stopped), or finished with an answer not in the expected format (the exit
node used its fallback: a model failure, still scored; the others are not model answers)."""


def failure_kind(trace: Trace) -> str | None:
    """One of FAILURE_KINDS for an episode that failed, None for one that finished cleanly."""
    if trace.status != "ok":
        return trace.status
    if trace.error is not None:  # finished, but its reward could not be computed (scheduler.apply_score)
        return "error"
    last = trace.steps[-1] if trace.steps else None
    return "parse" if last is not None and last.parse_error is not None else None


def mean(values: Any) -> float:
    """Arithmetic mean as a float (statistics.mean is exact but ~20x slower on large runs)."""
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(traces: list[Trace], planned: int | None = None) -> dict[str, Any]:
    """Accuracy (the task's verdict: `tasks.is_correct`), mean reward, turns, tokens, failures by kind, over the
    episodes that ended (`episodes`); `cancelled` counts the rest of `planned` (in flight or not started when the
    run stopped). `accuracy` counts a failed episode as wrong; `accuracy_finished` is over the `finished` ones only
    (no timeout or error: the model's answers), so an infrastructure failure is not read as a model failure."""
    done = [t for t in traces if t.status != "cancelled"]
    planned = len(traces) if planned is None else planned
    out: dict[str, Any] = {"episodes": len(done), "cancelled": planned - len(done)}
    kinds = [failure_kind(t) for t in done]
    out["failures"] = {k: kinds.count(k) for k in FAILURE_KINDS} | {"cancelled": out["cancelled"]}
    if not done:
        return out
    finished = [t for t, k in zip(done, kinds) if k in (None, "parse")]
    correct = sum(map(is_correct, done))
    rewards = [t.reward or 0.0 for t in done]
    steps = [s for t in done for s in t.steps]
    tools = [s.tool for s in steps if s.tool]
    return out | {
        "accuracy": correct / len(done),
        "correct": correct,
        "finished": len(finished),
        "accuracy_finished": correct / len(finished) if finished else None,
        "reward_mean": mean(rewards),
        "reward_mean_finished": mean(t.reward or 0.0 for t in finished) if finished else None,
        "turns_mean": mean(t.turns for t in done),
        "completion_tokens_mean": mean(t.completion_tokens for t in done),
        "llm_calls_mean": mean(len(t.llm_calls) for t in done),
        "status": {s: sum(t.status == s for t in done) for s in ("ok", "error", "timeout")},
        "parse_error_rate": mean(s.parse_error is not None for s in steps),
        "tool_error_rate": mean(tool.error is not None for tool in tools),
        "duration_s_mean": mean(t.duration_s for t in done),
        "queue_s_mean": mean(t.queue_s for t in done),  # of duration_s: waiting in the backend's queue, not timed
    } | _judged(done)


def _judged(traces: list[Trace]) -> dict[str, Any]:
    """What an LLM judge did (masgraph/judge.py), when one scored: verdicts, how many came from its cache, how many
    said neither yes nor no, its calls and their tokens."""
    verdicts = [t.meta["judge"] for t in traces if "judge" in t.meta]
    if not verdicts:
        return {}
    calls = [c for t in traces for c in t.judge_calls]
    return {"judge": {"verdicts": len(verdicts), "cached": sum(bool(v.get("cached")) for v in verdicts),
                      "unparsed": sum(bool(v.get("unparsed")) for v in verdicts), "calls": len(calls),
                      "prompt_tokens": sum(c.n_prompt for c in calls),
                      "completion_tokens": sum(c.n_completion for c in calls)}}
