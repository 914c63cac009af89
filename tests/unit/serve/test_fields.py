"""Every chat-completions field, sent by the official `openai` client to a real server on a socket: honoured
with its OpenAI meaning (`n` episodes, the answering node's sampling, `stop`, `seed`, `logprobs`,
`GET /v1/models/{id}`) or refused with a 400 naming the param; never a silent 200 (issue 57, findings 1-8)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from masgraph.agents.registry import register_agent
from masgraph.backends.base import Completion
from masgraph.node import NodeOutput
from masgraph.streaming import sink_for
from tests.unit.serve.serving import scripted_agent, serving

TWO_NODES = """\
name: echo
policies:
  main: {backend: scripted, model: none, sampling: {temperature: 0.7, max_tokens: 64}}
nodes:
  think: {role: generator, policy: main}
  answer: {role: generator, policy: main}
edges: [{source: think, target: answer}]
entry: think
exit: answer
"""

NO_LLM = "name: echo\nnodes:\n  answer: {role: custom, agent: parrot-fields}\nentry: answer\nexit: answer\n"


@register_agent("parrot-fields")
async def _parrot(ctx):
    return NodeOutput(text=ctx.query, answer=ctx.query)


class _Bytes:
    """A tokenizer whose tokens are UTF-8 bytes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", "replace")


class ModelLike:
    """A scripted model that behaves as a model's backend does: a tokenizer (UTF-8 bytes) and a context of
    `max_context` tokens, `max_tokens` honoured (a longer reply is cut, finish_reason `length`), a logprob per
    token, and the answer node's text streamed a token at a time. Records every request."""

    returns_tokens = True
    tokenizer = _Bytes()

    def __init__(self, reply: str = "Answer: 579", max_context: int = 400):
        self.reply, self.max_context, self.requests = reply, max_context, []

    async def complete(self, requests):
        [req] = requests
        self.requests.append(req)
        sink, whole = sink_for(req), list(self.reply.encode())
        ids = whole[:req.sampling.max_tokens]
        for k in range(1, len(ids) + 1):
            if sink is not None:
                sink.update(bytes(ids[:k]).decode("utf-8", "ignore"))
                await asyncio.sleep(0.001)
        return [Completion(text=bytes(ids).decode("utf-8", "replace"), prompt_ids=[1], completion_ids=ids,
                           logprobs=[-(i + 1) / 100 for i in range(len(ids))],
                           finish_reason="length" if len(ids) < len(whole) else "stop")]

    async def aclose(self) -> None:
        return None


@pytest.fixture(scope="module")
def model_like():
    """A server of a two-node graph (think -> answer) on `ModelLike`: (client, backend)."""
    backend = ModelLike()
    with serving(scripted_agent(TWO_NODES, backend)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), backend


@pytest.fixture(scope="module")
def plain():
    """A server of the one-node graph on the plain scripted backend (it records no tokenizer)."""
    with serving(scripted_agent()) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def create(client: openai.OpenAI, text: str = "What is 2 + 3?", **fields):
    return client.chat.completions.create(model="echo", messages=[{"role": "user", "content": text}], **fields)


def refused(client: openai.OpenAI, param: str, code: str | None = None, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **fields)
    err = info.value
    assert err.status_code == 400 and err.param == param and (code is None or err.code == code), err.body
    return err


def answer_calls(backend: ModelLike, since: int) -> list:
    return [r for r in backend.requests[since:] if r.key[1] == "answer"]


# --- n: n episodes, n choices ----------------------------------------------------------------------------------

def test_n_runs_n_episodes_and_returns_n_choices(model_like):
    client, backend = model_like
    one = create(client)
    r = create(client, n=3, extra_body={"masgraph": {"trace": True}})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == "579" for c in r.choices)
    assert len({c.model_extra["masgraph"]["trace_id"] for c in r.choices}) == 3  # three episodes
    assert r.usage.total_tokens == 3 * one.usage.total_tokens


def test_n_streams_every_choice(model_like):
    client, _ = model_like
    texts: dict[int, str] = {}
    finished = {}
    for c in create(client, n=2, stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert texts == {0: "579", 1: "579"} and finished == {0: "stop", 1: "stop"}


def test_n_out_of_range_is_a_400(model_like):
    refused(model_like[0], "n", n=0)
    refused(model_like[0], "n", n=17)


# --- the answering node's sampling: max_tokens, temperature, top_p, seed; stop on the answer -------------------

@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_bounds_the_answering_node_and_says_length(model_like, field):
    client, backend = model_like
    since = len(backend.requests)
    r = create(client, **{field: 9})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "5"  # "Answer: 5"
    calls = backend.requests[since:]
    assert [(c.key[1], c.sampling.max_tokens) for c in calls] == [("think", 64), ("answer", 9)]


def test_temperature_and_top_p_apply_to_the_answering_node_only(model_like):
    client, backend = model_like
    since = len(backend.requests)
    assert create(client, temperature=0.2, top_p=0.5).choices[0].message.content == "579"
    think, answer = backend.requests[since:]
    assert (think.sampling.temperature, think.sampling.top_p) == (0.7, 1.0)  # the graph's own
    assert (answer.sampling.temperature, answer.sampling.top_p) == (0.2, 0.5)


def test_a_seed_makes_the_episode_repeatable(model_like):
    client, backend = model_like

    def seeds(**fields) -> list[int]:
        since = len(backend.requests)
        create(client, **fields)
        return [r.seed for r in backend.requests[since:]]

    assert seeds(seed=7) == seeds(seed=7) != seeds(seed=8)
    assert seeds() != seeds()  # unseeded requests sample afresh
    since = len(backend.requests)
    create(client, seed=7, n=2)
    assert len({r.seed for r in answer_calls(backend, since)}) == 2  # each choice its own sample


@pytest.mark.parametrize("stream", [False, True])
def test_stop_cuts_the_answer_before_the_first_stop_sequence(model_like, stream):
    client, _ = model_like
    for stop, content in ((["7"], "5"), ("9", "57"), (["x", "57"], ""), (["0"], "579")):
        if stream:
            chunks = list(create(client, stop=stop, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == content and chunks[-1].choices[0].finish_reason == "stop", (stop, text)
        else:
            r = create(client, stop=stop)
            assert r.choices[0].message.content == content and r.choices[0].finish_reason == "stop", stop


def test_a_stream_holds_back_what_may_begin_a_stop_sequence():
    from masgraph.serve.fields import StopCut

    cut = StopCut(("\n\n", "END"))
    assert [cut.feed(p) for p in ("ab", "c\n", "d", "E", "N", "X")] == ["ab", "c", "\nd", "", "", "ENX"]
    cut = StopCut(("END",))
    assert [cut.feed(p) for p in ("aE", "N", "D rest")] == ["a", "", ""] and cut.cut and cut.sent == "a"


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"seed": "7"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"n": "2"}, "n"),
])
def test_a_field_of_the_wrong_type_or_range_is_a_400_naming_it(model_like, fields, param):
    refused(model_like[0], param, **fields)


# --- logprobs of the answer's tokens -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_those_of_the_answer_tokens(model_like, stream):
    client, _ = model_like
    if stream:
        chunks = list(create(client, logprobs=True, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    else:
        r = create(client, logprobs=True)
        content, tokens = r.choices[0].message.content, r.choices[0].logprobs.content
    # "Answer: 579": the answer's tokens are bytes 8-10, each logprob as the backend recorded it
    assert content == "579" and [t.token for t in tokens] == ["5", "7", "9"]
    assert [t.logprob for t in tokens] == [-0.09, -0.1, -0.11] and tokens[0].bytes == [53]
    tokens = create(client, logprobs=True, stop=["9"]).choices[0].logprobs.content
    assert [t.token for t in tokens] == ["5", "7"]  # those of the answer as cut


def test_logprobs_from_a_backend_that_records_no_tokens_or_top_logprobs_are_a_400(model_like, plain):
    err = refused(plain, "logprobs", "unsupported_parameter", logprobs=True)
    assert "no tokenizer" in err.message
    refused(model_like[0], "top_logprobs", "unsupported_parameter", logprobs=True, top_logprobs=2)
    refused(model_like[0], "top_logprobs", top_logprobs=0)  # without logprobs: true


def test_sampling_fields_for_an_answering_node_without_an_llm_are_a_400():
    with serving(scripted_agent(NO_LLM)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for field, value in (("temperature", 0.5), ("max_tokens", 5), ("logprobs", True)):
            err = refused(client, field, "unsupported_parameter", **{field: value})
            assert "runs no LLM" in err.message
        assert create(client, stop=["s"], seed=3, n=2).choices[1].message.content == "What i"


# --- what a graph agent does not do: refused, naming the field; no-op values accepted ----------------------------

@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "add"}}], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "add"}]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
])
def test_what_a_graph_agent_does_not_do_is_a_400_unsupported_parameter(plain, fields, param):
    refused(plain, param, "unsupported_parameter", **fields)


def test_a_field_openai_does_not_have_is_a_400_unknown_parameter(plain):
    err = refused(plain, "top_k", "unknown_parameter", extra_body={"top_k": 5})
    assert "unrecognized request argument" in err.message


def test_fields_that_ask_for_nothing_more_are_accepted(plain):
    r = create(plain, tools=[{"type": "function", "function": {"name": "add"}}], tool_choice="none",
               parallel_tool_calls=False, response_format={"type": "text"}, frequency_penalty=0, presence_penalty=0,
               logit_bias={}, store=False, service_tier="auto", modalities=["text"], user="u-1",
               metadata={"team": "a"}, prompt_cache_key="k")
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


# --- GET /v1/models/{id} --------------------------------------------------------------------------------------------

def test_models_retrieve_names_the_served_model_and_404s_others(plain):
    assert plain.models.retrieve("echo").id == "echo"
    with pytest.raises(openai.NotFoundError) as info:
        plain.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"


# --- a question longer than the context --------------------------------------------------------------------------

def test_a_question_over_the_context_is_a_400_unless_truncation_is_asked_for(model_like):
    client, backend = model_like  # a context of 400 tokens, 64 kept to answer in
    err = refused(client, "messages", "context_length_exceeded", text="x" * 340)
    assert "340 tokens" in err.message and "400 tokens" in err.message
    refused(client, "messages", "context_length_exceeded", text="x" * 300, max_tokens=200)  # room to answer
    assert create(client, text="x" * 300).choices[0].message.content == "579"
    assert create(client, text="x" * 340, extra_body={"masgraph": {"truncate": True}}).choices[0].message.content


# --- masgraph.stream_steps (issue 59): each node's step as it finishes ------------------------------------------

def test_stream_steps_sends_each_nodes_step_in_order_and_the_same_answer(model_like):
    client, _ = model_like
    whole = create(client).choices[0].message.content
    plain_chunks = list(create(client, stream=True))
    assert not any((c.model_extra or {}).get("masgraph") for c in plain_chunks)  # the plain stream is unchanged
    chunks = list(create(client, stream=True, extra_body={"masgraph": {"stream_steps": True}}))
    steps = [(i, c.model_extra["masgraph"]["step"]) for i, c in enumerate(chunks)
             if (c.model_extra or {}).get("masgraph")]
    assert [s["node"] for _, s in steps] == ["think", "answer"]
    assert steps[1][1]["text"] == "Answer: 579" and steps[1][1]["role"] == "generator"
    texts = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
    assert steps[0][0] < texts[0] and texts[-1] < steps[1][0]  # the answering node's step after its text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole == "579"
    assert all(c.choices[0].delta.content in (None, "") for _, c in ((i, chunks[i]) for i, _ in steps))
    refused(client, "masgraph.stream_steps", extra_body={"masgraph": {"stream_steps": True}})  # needs stream


def test_the_context_check_reads_a_backends_token_layout_as_vllms_keeps_it():
    from types import SimpleNamespace

    from masgraph.serve.fields import Plan, check_context
    from masgraph.serve.guards import ApiError

    class LayoutOnly(ModelLike):  # vllm: a tokenizer, and the context on its token layout
        layout = SimpleNamespace(max_context=100)

    agent = scripted_agent(TWO_NODES, LayoutOnly(max_context=None))
    asyncio.run(check_context("x" * 36, agent, Plan(), truncate=False))  # 36 + 64 to answer in fits 100
    with pytest.raises(ApiError) as info:
        asyncio.run(check_context("x" * 37, agent, Plan(), truncate=False))
    assert info.value.body["error"]["code"] == "context_length_exceeded"
