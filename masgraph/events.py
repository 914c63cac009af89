"""The one event stream: everything observable in a run or a training run is a typed event sent to sinks.

The scheduler emits episode, step, LLM-call and tool-call events; trainers emit train-step, evaluation and
checkpoint events. Sinks (the run store, metrics.jsonl, the progress bar, a TUI) only receive; nothing
else observes a run. A sink must be cheap and must not raise (a raising sink is counted, never fatal).

An LLM call's record is the step's `LLMCall`; its `llm_call` event is a light view of it (`LLMCallFinished.of`:
who, tokens, timing), not the record, because the step line already stores the call and its token ids would
double events.jsonl (~1 kB more per call for a short prompt).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, Protocol

from pydantic import Field, TypeAdapter

from masgraph.trace import LLMCall, Record, Step, Trace, unvalidated

EVENT_SCHEMA_VERSION = 3
"""Bumped when an event's fields change incompatibly (v1 had no step_started/llm_call/tool_call/train events;
v2 had no `Step.sources`, and its stores wrote no episodes.jsonl). Readers read every version."""


class EpisodeStarted(Record):
    kind: Literal["episode_started"] = "episode_started"
    episode_id: str
    item_id: str
    query: str
    started: float = 0.0
    """Wall-clock time.time() at the start."""


class NodeEvent(Record):
    """An event of one node step: the episode, the node and its turn (the run of that node in the episode)."""

    episode_id: str
    node: str
    turn: int


class StepStarted(NodeEvent):
    """A node step began (its inputs are ready); the matching `step` event carries the result."""

    kind: Literal["step_started"] = "step_started"
    started: float = 0.0


class LLMCallFinished(NodeEvent):
    """One completion returned to a node: a light view of its `LLMCall`, built by `of` (the step's `llm` list keeps
    the calls of its last attempt in full). Light because each call gets a line of its own in events.jsonl beside
    the step line that holds it: the whole record would write its token ids twice."""

    kind: Literal["llm_call"] = "llm_call"
    policy: str
    adapter: str | None = None
    prompt_tokens: int = 0
    """`LLMCall.n_prompt` (the server's count or the ids')."""
    completion_tokens: int = 0
    """`LLMCall.n_completion`."""
    latency_s: float = 0.0
    batch_size: int = 1
    queue_s: float = 0.0

    @classmethod
    def of(cls, call: LLMCall, episode_id: str, node: str, turn: int) -> LLMCallFinished:
        """The event of `call`, made by `node`'s run `turn` in episode `episode_id` (unvalidated: the hot path)."""
        return fast(cls, episode_id=episode_id, node=node, turn=turn, policy=call.policy, adapter=call.adapter,
                    prompt_tokens=call.n_prompt, completion_tokens=call.n_completion, latency_s=call.latency_s,
                    batch_size=call.batch_size, queue_s=call.queue_s)


class ToolCallFinished(NodeEvent):
    """One tool call of a node ended (its full record is the step's `tool`)."""

    kind: Literal["tool_call"] = "tool_call"
    tool: str
    ok: bool
    duration_s: float = 0.0


class StepFinished(Record):
    kind: Literal["step"] = "step"
    step: Step


class EpisodeFinished(Record):
    kind: Literal["episode_finished"] = "episode_finished"
    trace: Trace


class TrainStep(Record):
    """A training step's metrics (what metrics.jsonl records); step 0 is the untrained evaluation."""

    kind: Literal["train_step"] = "train_step"
    step: int
    metrics: dict[str, Any] = Field(default_factory=dict)


class EvalFinished(Record):
    """A held-out evaluation ended."""

    kind: Literal["eval"] = "eval"
    step: int
    metrics: dict[str, Any] = Field(default_factory=dict)


class Credited(Record):
    """The advantages a training step pushed one episode's LLM calls by (what `masgraph watch` shows per call)."""

    kind: Literal["credit"] = "credit"
    step: int
    """The training step (1-based) whose update used them."""
    episode_id: str
    calls: list[tuple[int, int, float]]
    """(step index in the episode, call index in the step, advantage) of every call that was a training row."""
    counterfactual: list[tuple[int, int, str, float]] = Field(default_factory=list, exclude_if=lambda v: not v)
    """With counterfactual credit (masgraph.learn.counterfactual): (step index, call index, alternative, the episode's
    score with it in the call's place) of every variant scored; left out of the stored event when none."""


class CheckpointSaved(Record):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str


Event = Annotated[EpisodeStarted | StepStarted | LLMCallFinished | ToolCallFinished | StepFinished | EpisodeFinished
                  | TrainStep | EvalFinished | Credited | CheckpointSaved, Field(discriminator="kind")]
EVENT = TypeAdapter(Event)
"""Parses one event from its JSON object (`EVENT.validate_python(obj)`)."""


_KIND: dict[type, str] = {}


def fast(cls: type[Record], **values: Any) -> Any:
    """An event built without validation or default filling, for the scheduler's hot path (`trace.unvalidated`):
    `values` must name every field of `cls` except `kind`, with the right types."""
    kind = _KIND.get(cls)
    if kind is None:  # model_fields is a slow property on pydantic >= 2.11: read it once per class
        kind = _KIND[cls] = cls.model_fields["kind"].default
    values["kind"] = kind
    return unvalidated(cls, values)


class Sink(Protocol):
    """Receives events; must be cheap and must not raise."""

    def emit(self, event: Event) -> None: ...


class ListSink:
    """Keeps every event in memory (tests, notebooks)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    @property
    def traces(self) -> list[Trace]:
        return [e.trace for e in self.events if isinstance(e, EpisodeFinished)]


class Emitter:
    """Sends events to sinks; a sink that raises is counted in `errors`, never fatal."""

    def __init__(self, sinks: Iterable[Sink] = ()):
        self.sinks = list(sinks)
        self.errors = 0

    def __call__(self, event: Event) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:
                self.errors += 1
