"""A deployable agent: a graph (with a checkpoint's adapters and learned topology) that answers questions one at a
time, concurrently — what `masgraph serve` and `masgraph.load_agent` put behind an API.

Concurrent `aask` calls share one engine, so their LLM calls batch together in the backend; the sync `ask` runs
on the agent's own event loop thread, so it can be called from anywhere (a script, a notebook, a thread pool)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from masgraph.errors import MasgraphError
from masgraph.events import Sink
from masgraph.graph import Graph
from masgraph.rundir.layout import CHECKPOINTS
from masgraph.runtime.engine import BackendOptions, Engine
from masgraph.serve.bundle import Bundle, load_bundle
from masgraph.streaming import AnswerStream, answer_node
from masgraph.trace import Trace

__all__ = ["Agent", "Answer", "load_agent", "open_source"]


@dataclass(frozen=True)
class Answer:
    """What an agent says, and the episode behind it."""

    answer: str | None
    """The exit node's answer (None when the episode failed: see `trace.status` and `trace.error`)."""
    trace: Trace

    @property
    def ok(self) -> bool:
        return self.trace.status == "ok" and self.answer is not None

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of every LLM call of the episode."""
        return self.trace.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of every LLM call of the episode."""
        return self.trace.completion_tokens


class Agent:
    """A graph ready to answer: its engine built once, a checkpoint's adapters loaded, its topology policy (for a
    graph with a `topology:` section) picking each question's sub-graph — by default `greedy` for a learned
    topology and `sample` for the untrained prior (as `masgraph run` does).

    Example:
        >>> agent = load_agent("graphs/agentflow.yaml")
        >>> agent.ask("What is 12 * 7 + 3?").answer
        '87'
    """

    def __init__(self, graph: Graph, checkpoint: str | Path | None = None,
                 topology: Literal["greedy", "sample"] | None = None, deterministic: bool = False,
                 engine: Engine | None = None, bundle: Bundle | None = None):
        from masgraph.rundir.checkpoint import checkpoint_adapters, resolve_checkpoint
        from masgraph.topology.policy import load_policy

        if checkpoint is not None and bundle is not None:
            raise MasgraphError("a bundle carries its own adapters; do not pass a checkpoint with it")
        self.graph, self.mode, self.bundle = graph, topology, bundle
        self.checkpoint = resolve_checkpoint(checkpoint) if checkpoint is not None else None
        # checked early, and against the graph (every adapter it trains is there)
        adapters = checkpoint_adapters(self.checkpoint, graph.spec) if self.checkpoint is not None else {}
        if bundle is not None:
            adapters = bundle.adapters
        self.topology = load_policy(graph, bundle.path if bundle is not None and bundle.topology_file
                                    else self.checkpoint)
        if self.mode is None:
            self.mode = "greedy" if self.topology is not None and self.topology.version > 0 else "sample"
        self.engine = engine or Engine(graph, options=BackendOptions(deterministic=deterministic))
        self.engine.load_adapters(adapters)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def name(self) -> str:
        return self.graph.spec.name

    async def aask(self, question: str, *, sinks: Sequence[Sink] = (), meta: dict | None = None,
                   stream: AnswerStream | None = None, sampling: dict[str, Any] | None = None,
                   seed: int | None = None, sample: int = 0) -> Answer:
        """Answer one question (an episode on this agent's engine); never raises for a failed episode — the
        trace says what failed. `stream` (`self.answer_stream()`) receives the answer as it decodes. `sampling`
        replaces settings of the answering node's policy (`temperature`, `top_p`, `max_tokens`) for this
        episode; `seed` makes it repeatable: the topology's draw and every call's seed derive from it and
        `sample` (which of several answers to one question this is)."""
        if not isinstance(question, str) or not question.strip():
            raise MasgraphError("the question is empty; ask something")
        topology = choice = None
        if self.topology is not None:
            greedy = self.mode == "greedy"
            draw = random.getrandbits(31) if seed is None else (seed + sample) % 2 ** 31
            picked = self.topology.sample(question, seed=None if greedy else draw, greedy=greedy)
            topology, choice = picked.topology, picked.choice
        extra: dict[str, Any] = {} if stream is None else {"stream": stream}  # an engine without streaming
        if sampling:  # (or a custom engine) takes only the arguments it is given
            extra["sampling"] = {self.graph.spec.exit: sampling}
        if seed is not None:
            extra.update(item_id=f"seed-{seed}", sample=sample)
        trace = await self.engine.episode(question, topology=topology, choice=choice, sinks=sinks, meta=meta,
                                          **extra)
        return Answer(trace.answer if trace.status == "ok" else None, trace)

    def answer_stream(self) -> AnswerStream:
        """A stream for one `aask` call: iterate it for the answer's text as it decodes (only the built-in
        generator's answer streams; see masgraph/streaming.py), then `rest(answer.answer)` completes it."""
        return AnswerStream(answer_node(self.graph.spec))

    def ask(self, question: str) -> Answer:
        """`aask` from synchronous code (runs on the agent's own event loop thread)."""
        return asyncio.run_coroutine_threadsafe(self.aask(question), self._own_loop()).result()

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="masgraph-agent", daemon=True)
            self._thread.start()
        return self._loop

    async def aclose(self) -> None:
        await self.engine.aclose()

    def close(self) -> None:
        """Release the backends (and the loop thread of `ask`)."""
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join()
            self._loop = self._thread = None
        else:
            asyncio.run(self.aclose())


def open_source(source: str | Path, check_models: bool = True) -> tuple[Graph, Bundle | None]:
    """The graph of a graph YAML file, or of a bundle (a directory written by `masgraph export`, or its .tar.gz;
    checked against its manifest first) with the bundle."""
    from masgraph.graph import compile_spec
    from masgraph.loader import keep_source, load_spec

    path = Path(source)
    bundle = None
    if path.is_dir() or path.name.endswith(".tar.gz"):
        if path.is_dir() and not (path / "manifest.json").exists() and (path / CHECKPOINTS).is_dir():
            raise MasgraphError(f"{path} is a training run; export it first (`masgraph export {path} --out DIR`) "
                                "or pass its graph with --checkpoint")
        bundle = load_bundle(path)
        path = bundle.graph_file
    spec = load_spec(path)
    if bundle is not None and bundle.indexes:  # a bundle's search index resolves inside it, not in the cwd
        root = bundle.path.resolve()
        tools = {name: t.model_copy(update={"options": {**t.options, "index": str(root / bundle.indexes[name])}})
                 if name in bundle.indexes else t for name, t in spec.tools.items()}
        spec = keep_source(spec.model_copy(update={"tools": tools}), spec)
    return compile_spec(spec, str(path), check_models=check_models), bundle


def load_agent(source: str | Path, checkpoint: str | Path | None = None,
               topology: Literal["greedy", "sample"] | None = None, deterministic: bool = False) -> Agent:
    """An `Agent` from a bundle (`masgraph export`) or a graph YAML file (optionally with a training run's
    checkpoint)."""
    graph, bundle = open_source(source)
    return Agent(graph, checkpoint, topology, deterministic, bundle=bundle)
