"""The OpenAI chat-completions wire format, as much of it as an agent endpoint needs: the request (validated, with
located 400 errors), the response and stream chunks, usage, and OpenAI-style error objects.

A graph answers a question, so the question is the last user message. Every field of the request is declared
here: those a graph agent can honour (`n`, the answering node's sampling, `stop`, `logprobs`: see
masgraph/serve/fields.py), those it refuses unless they ask for nothing (client-side `tools`, `response_format`
other than text: a 400 `unsupported_parameter` naming the field), and no others (a field that is not OpenAI's is a
400 `unknown_parameter`). The opt-in extension `"masgraph": {"trace": true}` adds the episode's trace id and
steps."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from masgraph.trace import Step, Trace

__all__ = ["ChatRequest", "choice", "chunk", "completion", "error_body", "extension", "locate", "lone_surrogate",
           "question_of", "step_view", "usage", "validation_message"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None
    """Refused when true (no obfuscation padding is sent)."""


class Extension(BaseModel):
    """`"masgraph": {...}` in the request body (the OpenAI client passes it with `extra_body`)."""

    model_config = ConfigDict(extra="forbid")
    trace: StrictBool = False
    """Return the trace id and steps with the answer."""
    conversation: str | None = Field(None, min_length=1, max_length=256)
    """A conversation id of the client's choosing: memory nodes with `scope: conversation` keep their fact store
    across the requests that name the same one (each request's facts added to what the earlier ones left)."""
    stream_steps: StrictBool = False
    """With `stream: true`, also send each node's step as it finishes: a chunk with an empty delta whose `masgraph.step`
    names the node (role, turn, route, text); the answer's text streams as without it."""
    truncate: StrictBool = False
    """Take a question longer than a model's context, its prompts cut in the middle to fit (without it, such a
    question is a 400 `context_length_exceeded`)."""


MAX_N = 16
"""Most choices (episodes) one request may ask for."""

Number = Annotated[float, Field(strict=True)]
"""A JSON number (an int is taken as a float; a string is not)."""
Int = Annotated[int, Field(strict=True)]


class ChatRequest(BaseModel):
    """POST /v1/chat/completions: every OpenAI field, typed; a field OpenAI does not have is refused. What each
    honoured field does, and why the refused ones are, is masgraph/serve/fields.py."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: StrictBool = False
    """JSON true or false only (lax parsing would take "yes", "no", 0 or 1)."""
    stream_options: StreamOptions | None = None
    n: Int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: Int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: Int | None = Field(None, ge=1, le=8192)
    stop: StrictStr | list[StrictStr] | None = Field(None, max_length=4)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    seed: Int | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    user: StrictStr | None = Field(None, max_length=256)
    safety_identifier: StrictStr | None = Field(None, max_length=256)
    metadata: dict[str, Annotated[str, Field(strict=True, max_length=512)]] | None = Field(None, max_length=16)
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    # accepted only when they ask for nothing a graph agent does not do (fields.py says why)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Number] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict[str, Any] | None = None
    masgraph: Extension = Field(default_factory=Extension)


def validation_message(exc: ValidationError) -> tuple[str, str | None, str | None]:
    """The first problem of a request as one line, the parameter it is about (OpenAI's `param`) and its code
    (`unknown_parameter` for a field the request may not have)."""
    errors = exc.errors()
    err = errors[0]
    loc = list(err["loc"])
    tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and _UNION_TAG.fullmatch(p)), None)
    param = ".".join(str(p) for p in loc[:tag]) or None
    if err["type"] == "extra_forbidden":
        return (f"{param}: unrecognized request argument (not a field of OpenAI's chat completions, nor of the "
                "`masgraph` extension; docs/export-serve.md lists the fields served)"), param, "unknown_parameter"
    if tag is not None:  # a union's members each failed: say which types the field takes
        where = tuple(loc[:tag])
        kinds = dict.fromkeys(e["loc"][tag] for e in errors if len(e["loc"]) > tag and e["loc"][:tag] == where)
        return f"{param}: not one of the types this field takes ({' or '.join(map(str, kinds))})", param, None
    return (f"{param}: {err['msg']}" if param else err["msg"]), param, None


_UNION_TAG = re.compile(r"str|int|float|bool|[a-z-]+\[.*\]")
"""How pydantic names the member of a union in an error's location (`str`, `list[str]`, `dict[str,any]`)."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(data: Any) -> str | None:
    """Where decoded JSON holds a lone UTF-16 surrogate (JSON's `"\\ud800"` escape without its pair, or the raw
    bytes of one: not a character, so no UTF-8 file or response can hold it): see `locate`."""
    return locate(data, lambda s: isinstance(s, str) and _SURROGATE.search(s) is not None)


def locate(data: Any, bad: Callable[[Any], bool]) -> str | None:
    """The dotted path of the first value in decoded JSON for which `bad` holds, or of the object one of whose
    keys it holds for ("" for the body itself), as `validation_message` names a field; None when there is none.
    Walked without recursion, so however deep the JSON nests."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                if bad(key):
                    return path
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in reversed(list(enumerate(value))))
        elif bad(value):
            return path
    return None


def question_of(request: ChatRequest) -> str | None:
    """The text of the last user message (text parts joined), or None when there is none."""
    for message in reversed(request.messages):
        if message.role != "user":
            continue
        content = message.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content if p.type == "text" and p.text)
        return content if content and content.strip() else None
    return None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object (what the official clients parse into their exceptions)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(*traces: Trace) -> dict[str, int]:
    """Token usage of whole episodes (one per choice): every LLM call of every node."""
    prompt, completion_ = sum(t.prompt_tokens for t in traces), sum(t.completion_tokens for t in traces)
    return {"prompt_tokens": prompt, "completion_tokens": completion_, "total_tokens": prompt + completion_}


def extension(trace: Trace, store_path: str | None) -> dict[str, Any]:
    return {"trace_id": trace.episode_id, "status": trace.status, "run_dir": store_path,
            "topology": trace.topology.decisions if trace.topology is not None else None,
            "steps": [step_view(s) for s in trace.steps]}


def step_view(s: Step) -> dict[str, Any]:
    """One step as the trace extension and a `stream_steps` chunk show it."""
    return {"node": s.node, "role": s.role, "turn": s.turn, "route": s.route, "text": s.text,
            "tool": s.tool.model_dump() if s.tool is not None else None, "error": s.error,
            "parse_error": s.parse_error, "duration_s": s.duration_s,
            **({"memory_ops": [op.model_dump() for op in s.memory_ops]} if s.memory_ops else {})}


def choice(index: int, content: str, finish_reason: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One choice of a `chat.completion`."""
    return {"index": index, "message": {"role": "assistant", "content": content, "refusal": None},
            "logprobs": logprobs, "finish_reason": finish_reason}


def completion(request_id: str, traces: list[Trace], choices: list[dict[str, Any]], model: str, with_trace: bool,
               store_path: str | None) -> dict[str, Any]:
    """A `chat.completion` object for finished episodes, one per choice. The trace extension is the first
    episode's, and each choice's own when there are several."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "system_fingerprint": None, "choices": choices, "usage": usage(*traces)}
    if with_trace:
        body["masgraph"] = extension(traces[0], store_path)
        if len(traces) > 1:
            for c, trace in zip(choices, traces):
                c["masgraph"] = extension(trace, store_path)
    return body


def chunk(request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None = None,
          usage_: dict[str, int] | None = None, choices: bool = True, index: int = 0,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk` of a stream, for choice `index` (`choices=False`: the final usage-only
    chunk)."""
    body: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
                            "created": int(time.time()), "model": model, "system_fingerprint": None,
                            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}] if choices else []}
    if usage_ is not None:
        body["usage"] = usage_
    return body
