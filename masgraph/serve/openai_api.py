"""The OpenAI chat-completions wire format, as much of it as an agent endpoint needs: the request (validated, with
located 400 errors), the response and stream chunks, usage, and OpenAI-style error objects.

A graph answers a question, so the question is the last user message; sampling parameters a client sends
(`temperature`, `max_tokens`, ...) are accepted and ignored: the graph's own policies decide how each node
samples. The opt-in extension `"masgraph": {"trace": true}` adds the episode's trace id and steps."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from masgraph.trace import Trace

__all__ = ["ChatRequest", "chunk", "completion", "error_body", "extension", "locate", "lone_surrogate", "question_of",
           "usage", "validation_message"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class Extension(BaseModel):
    """`"masgraph": {...}` in the request body (the OpenAI client passes it with `extra_body`)."""

    model_config = ConfigDict(extra="forbid")
    trace: StrictBool = False
    """Return the trace id and steps with the answer."""
    conversation: str | None = Field(None, min_length=1, max_length=256)
    """A conversation id of the client's choosing: memory nodes with `scope: conversation` keep their fact store
    across the requests that name the same one (each request's facts added to what the earlier ones left)."""


class ChatRequest(BaseModel):
    """POST /v1/chat/completions. Unknown OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: StrictBool = False
    """JSON true or false only (lax parsing would take "yes", "no", 0 or 1)."""
    stream_options: StreamOptions | None = None
    masgraph: Extension = Field(default_factory=Extension)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first problem of a request as one line, and the parameter it is about (OpenAI's `param`)."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return (f"{param}: {err['msg']}" if param else err["msg"]), param


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


def usage(trace: Trace) -> dict[str, int]:
    """Token usage of the whole episode: every LLM call of every node."""
    prompt, completion_ = trace.prompt_tokens, trace.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion_, "total_tokens": prompt + completion_}


def extension(trace: Trace, store_path: str | None) -> dict[str, Any]:
    return {"trace_id": trace.episode_id, "status": trace.status, "run_dir": store_path,
            "topology": trace.topology.decisions if trace.topology is not None else None,
            "steps": [{"node": s.node, "role": s.role, "turn": s.turn, "route": s.route, "text": s.text,
                       "tool": s.tool.model_dump() if s.tool is not None else None, "error": s.error,
                       "parse_error": s.parse_error, "duration_s": s.duration_s,
                       **({"memory_ops": [op.model_dump() for op in s.memory_ops]} if s.memory_ops else {})}
                      for s in trace.steps]}


def completion(request_id: str, trace: Trace, answer: str, model: str, with_trace: bool,
               store_path: str | None) -> dict[str, Any]:
    """A `chat.completion` object for a finished episode."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer, "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": usage(trace)}
    if with_trace:
        body["masgraph"] = extension(trace, store_path)
    return body


def chunk(request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None = None,
          usage_: dict[str, int] | None = None, choices: bool = True) -> dict[str, Any]:
    """One `chat.completion.chunk` of a stream (`choices=False`: the final usage-only chunk)."""
    body: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk",
                            "created": int(time.time()), "model": model, "system_fingerprint": None,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}] if choices else []}
    if usage_ is not None:
        body["usage"] = usage_
    return body
