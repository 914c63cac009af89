"""Typed records of an episode: a Trace of Steps, each with its LLM calls and tool call (events.py carries them).

One LLM call has one record: `LLMCall` is the backend's `Completion` plus what was asked and how long it took."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field


class Record(BaseModel):
    """Base of trace records and events: unknown fields are errors."""

    model_config = {"extra": "forbid"}


R = TypeVar("R", bound=Record)


_set_fields = BaseModel.__dict__["__pydantic_fields_set__"].__set__  # slot setters: quicker than object.__setattr__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def unvalidated(cls: type[R], values: dict[str, Any]) -> R:
    """An instance of `cls` holding `values` as is, without validation or default filling, for the hot path (a few
    times quicker than `model_construct`): `values` must name every field of `cls`, with the right types."""
    obj = object.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    _set_fields(obj, set(values))
    _set_extra(obj, None)
    _set_private(obj, None)
    return obj


class Completion(Record):
    """What one LLM call produced, token-in / token-out: what a backend returns, and (as the base of `LLMCall`) what
    the trace records of it. Declared once here, so the two cannot drift."""

    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """Per-token log-probability of each completion id under softmax(logits / temperature) over the whole
    vocabulary: temperature-scaled but NOT top-p truncated (so it is exactly recomputable from the logits);
    for a greedy call (temperature 0) under the raw softmax(logits), i.e. temperature 1."""
    finish_reason: Literal["stop", "length", "error"] = "stop"
    prompt_truncated: bool = False
    """True when the prompt outgrew the context and older memory was dropped."""
    policy_version: int = 0
    """Version of the adapter that served the call (its learner's update count)."""
    batch_size: int = Field(1, exclude_if=lambda v: v == 1)
    """Rows decoded together with this one, itself included (1 for backends that do not batch; left out of the
    stored trace when 1)."""
    prompt_tokens: int | None = Field(None, exclude_if=lambda v: v is None)
    """Prompt length the server reported, from a backend that returns text only (no ids to count); left out of the
    stored trace when None, as it is for every call that has its ids."""
    completion_tokens: int | None = Field(None, exclude_if=lambda v: v is None)
    """Output length the server reported, like `prompt_tokens`."""

    @property
    def n_prompt(self) -> int:
        """Prompt tokens: the server's count when it reported one, else the ids'."""
        return len(self.prompt_ids) if self.prompt_tokens is None else self.prompt_tokens

    @property
    def n_completion(self) -> int:
        """Completion tokens: the server's count when it reported one, else the ids'."""
        return len(self.completion_ids) if self.completion_tokens is None else self.completion_tokens


COMPLETION_FIELDS = tuple(Completion.model_fields)
"""The fields of what a call produced, in order (read once: `model_fields` is a slow property)."""


class LLMCall(Completion):
    """One call exactly as the model saw and produced it: its `Completion` plus what was asked (policy, adapter,
    sampling) and how long it took."""

    policy: str
    adapter: str | None = None
    temperature: float | None = None
    """Sampling temperature of the call (0 = greedy); None only in traces recorded before it was recorded."""
    top_p: float | None = None
    """Nucleus mass the token was sampled with (it does not enter `logprobs`); None as for `temperature`."""
    latency_s: float = 0.0
    """Wall time of the call, from the request to the completion (`queue_s` included)."""
    queue_s: float = Field(0.0, exclude_if=lambda v: v == 0.0)
    """Of `latency_s`, the time the call waited in the backend's queue before it was served (the hf batcher:
    until its batch started); not counted by the node's or the episode's time limit. 0 for a backend with no
    queue of its own (a remote server's queue is part of the call's time); left out of the stored trace when 0."""
    parse_error: str | None = Field(None, exclude_if=lambda v: v is None)
    """This call's output did not follow its node's format: set by a node that calls its model several times in a
    step (a memory manager, once per fact) through `NodeContext.unparsed`, so the format is credited per call
    (trainers/credit.py); the step's `parse_error` says whether any call failed. None otherwise (left out of the
    stored trace)."""


class ToolCall(Record):
    """One tool invocation and its result or error."""

    tool: str
    input: str
    output: str | None = None
    error: str | None = None
    duration_s: float = 0.0


class MemoryOp(Record):
    """One operation of a memory manager on its episode's fact store (masgraph/memory/store.py): what it read, what
    it answered, and what was applied (`op`, `target`: the entry it added, replaced or removed)."""

    fact: str
    op: Literal["ADD", "UPDATE", "DELETE", "NOOP"]
    target: int | None = None
    text: str | None = None
    """The entry's text after the operation (ADD, UPDATE)."""
    output: str = ""
    """The manager's raw output ('' for a rule-based manager)."""
    error: str | None = None
    """Why the output was not applied as written (the fallback, ADD of the fact, was)."""


class Step(Record):
    """One node step of one episode."""

    episode_id: str
    index: int
    node: str
    role: str
    turn: int
    """1-based count of this node's runs in the episode (its loop turn)."""
    route: str | None = None
    """Label matched against the `when` of outgoing edges."""
    sources: list[str] = Field(default_factory=list)
    """The nodes whose outputs this step received, in order: the edges it was reached by (none for the entry)."""
    text: str = ""
    """The node's output text (what downstream nodes read)."""
    llm: list[LLMCall] = Field(default_factory=list)
    tool: ToolCall | None = None
    bounded: bool = False
    """The loop's turn bound forced this step's exit edge."""
    parse_error: str | None = None
    """The model output did not follow the expected format; the node used its documented fallback."""
    error: str | None = None
    """The step failed (exception, timeout, backend error) after all retries."""
    memory_ops: list[MemoryOp] = Field(default_factory=list, exclude_if=lambda v: not v)
    """A memory manager's operations on the episode's fact store, in order (left out of the stored trace when none)."""
    attempts: int = 1
    started: float = 0.0
    duration_s: float = 0.0
    """Wall time of the step, every attempt."""
    queue_s: float = Field(0.0, exclude_if=lambda v: v == 0.0)
    """Of `duration_s`, the time the node's clock was stopped because its LLM calls waited in the backend's
    queue: not counted by its `timeout_s` (see masgraph/workclock.py); left out of the stored trace when 0."""
    work_s: float | None = Field(None, exclude_if=lambda v: v is None)
    """What the node's `timeout_s` counted, every attempt: `duration_s` less `queue_s`, with the time its calls
    were computed in a batch of n rows counted as 1/n of it (None in traces recorded before it was)."""


class TopologyChoice(Record):
    """The topology an episode ran, as a topology policy chose it."""

    decisions: dict[str, str]
    """Every decision of the graph's `topology:` section -> the option taken (skipped ones too)."""
    logprobs: dict[str, float] = Field(default_factory=dict)
    """The decisions actually made (not skipped) -> log-probability under the policy that sampled them."""
    version: int = 0
    """Version of the topology policy (its update count)."""
    mode: Literal["sample", "greedy"] = "sample"

    @property
    def logprob(self) -> float:
        """Log-probability of the whole topology: the sum over the decisions made."""
        return sum(self.logprobs.values())


EVALUATION = "evaluation"
"""The key of `Trace.meta` that marks a training run's held-out evaluation episode: the step it evaluated (the
episode index's `eval`; watch filters on it)."""


class Trace(Record):
    """A whole episode: the query, every step, the answer, the reward and how it ended."""

    episode_id: str
    item_id: str
    query: str
    steps: list[Step] = Field(default_factory=list)
    answer: str | None = None
    reward: float | None = None
    status: Literal["ok", "error", "timeout", "cancelled"] = "ok"
    error: str | None = None
    duration_s: float = 0.0
    """Wall time of the episode."""
    queue_s: float = Field(0.0, exclude_if=lambda v: v == 0.0)
    """Of `duration_s`, the time the episode's clock was stopped, every node step it ran waiting in the backend's
    queue: not counted by `episode_timeout_s`; left out of the stored trace when 0."""
    work_s: float | None = Field(None, exclude_if=lambda v: v is None)
    """What `episode_timeout_s` counted (see `Step.work_s`; None in traces recorded before it was)."""
    judge_calls: list[LLMCall] = Field(default_factory=list, exclude_if=lambda v: not v)
    """The calls of an LLM judge that scored the answer (`masgraph.tasks.judge`; none when its verdict was cached): kept
    apart from the steps' calls, so the episode's turns and tokens stay the graph's own; left out when empty."""
    topology: TopologyChoice | None = None
    """The decisions of a topology policy this episode ran (None: the whole graph, or a topology given directly)."""
    unused_steps: list[int] = Field(default_factory=list)
    """Indices of the (successful) steps whose output nothing used: no later step received it (a fan-in merge
    that keeps one input discards the others) and no later prompt showed its memory entry; the exit's step is the
    answer. Component rationality for topology learning: such a node cost tokens for nothing."""
    meta: dict[str, Any] = Field(default_factory=dict)

    def __repr__(self) -> str:  # short: a full dump of every step is what model_dump_json is for
        return (f"Trace(episode_id={self.episode_id!r}, status={self.status!r}, steps={len(self.steps)}, "
                f"answer={self.answer!r}, reward={self.reward!r})")

    @property
    def llm_calls(self) -> list[LLMCall]:
        return [c for s in self.steps for c in s.llm]

    @property
    def completion_tokens(self) -> int:
        return sum(c.n_completion for c in self.llm_calls)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.n_prompt for c in self.llm_calls)

    @property
    def turns(self) -> int:
        """Most runs of any node (the number of loop turns taken)."""
        return max((s.turn for s in self.steps), default=0)


def full_reward(reward: float | None) -> bool:
    """The default correctness rule: the reward is the maximum (1.0). A trace's reader (the TUI on a run stored
    before verdicts were) applies it where the episode recorded no verdict of its own."""
    return reward is not None and reward >= 1.0
