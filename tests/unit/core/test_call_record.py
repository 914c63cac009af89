"""One record per LLM call: `LLMCall` is the backend's `Completion` plus what was asked, each field declared once;
the `llm_call` event is a view built from the record; a record built on the hot path (unvalidated) stores and
reads back like a validated one."""

from __future__ import annotations

import inspect
import typing

from masgraph.backends.base import Completion as BackendCompletion
from masgraph.backends.base import Request, llm_call, replayed
from masgraph.events import LLMCallFinished, NodeEvent
from masgraph.spec import SamplingSpec
from masgraph.trace import Completion, LLMCall, Record


def _declared(cls: type) -> set[str]:
    """The fields `cls` itself declares (not those it inherits)."""
    return set(inspect.get_annotations(cls))


def test_every_field_of_a_call_is_declared_once():
    assert BackendCompletion is Completion  # backends return the trace's own model
    assert issubclass(LLMCall, Completion)
    assert list(LLMCall.model_fields)[:len(Completion.model_fields)] == list(Completion.model_fields)
    for cls in LLMCall.__mro__:
        if cls is not Completion and isinstance(cls, type) and issubclass(cls, Record):
            twice = _declared(cls) & set(Completion.model_fields)
            assert not twice, f"{cls.__name__} declares {sorted(twice)} again: they are Completion's"
    for prop in ("n_prompt", "n_completion"):
        assert prop in Completion.__dict__ and prop not in LLMCall.__dict__


def test_the_event_is_a_view_of_the_record():
    """Every field of the light event is the record's (same name and type) or one of its two counts, and `of`
    fills them all from the record."""
    counts = {"prompt_tokens": "n_prompt", "completion_tokens": "n_completion"}
    own = set(LLMCallFinished.model_fields) - set(NodeEvent.model_fields) - {"kind"}
    for name in own - set(counts):
        assert name in LLMCall.model_fields, f"LLMCallFinished.{name} is not a field of LLMCall"
        assert LLMCallFinished.model_fields[name].annotation == LLMCall.model_fields[name].annotation, name
    call = LLMCall(policy="p", adapter="a", prompt_ids=[1, 2, 3], completion_ids=[4], logprobs=[-0.5], text="x",
                   latency_s=0.25, queue_s=0.125, batch_size=3)
    event = LLMCallFinished.of(call, "e1", "node", 2)
    assert set(event.__dict__) == set(LLMCallFinished.model_fields)
    assert event == LLMCallFinished.model_validate(event.model_dump())
    for name in own:
        assert getattr(event, name) == getattr(call, counts.get(name, name)), name
    assert (event.episode_id, event.node, event.turn) == ("e1", "node", 2)


def test_llm_call_and_replayed_are_inverse_and_store_like_validated_records():
    c = Completion(text="four", prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1, -0.2],
                   finish_reason="length", policy_version=7, batch_size=2)
    req = Request([{"role": "user", "content": "2+2?"}], policy="main", adapter="solver",
                  sampling=SamplingSpec(temperature=0.7, top_p=0.9))
    call = llm_call(req, c, latency_s=0.5, queue_s=0.25)
    assert set(call.__dict__) == set(LLMCall.model_fields)
    validated = LLMCall.model_validate(call.model_dump())
    assert validated == call and validated.model_dump_json() == call.model_dump_json()
    assert (call.policy, call.adapter, call.temperature, call.top_p) == ("main", "solver", 0.7, 0.9)
    back = replayed(call)
    assert type(back) is Completion and back == c
    call.parse_error = "no answer"  # a node's `unparsed` marks the record after the fact
    assert LLMCall.model_validate_json(call.model_dump_json()).parse_error == "no answer"


def test_stored_call_keeps_its_old_shape():
    """Fields at their defaults stay out of the stored trace (a call from a backend that does not batch stores
    as it did before `batch_size` was recorded), and a call stored before it reads back with batch size 1."""
    old = {"policy": "p", "adapter": None, "policy_version": 0, "prompt_ids": [1], "completion_ids": [2],
           "logprobs": [-0.1], "temperature": 1.0, "top_p": 1.0, "text": "t", "finish_reason": "stop",
           "prompt_truncated": False, "latency_s": 0.1}
    call = LLMCall.model_validate(old)
    assert call.batch_size == 1 and call.model_dump() == old
    assert typing.get_args(LLMCall.model_fields["finish_reason"].annotation) == ("stop", "length", "error")
