"""What crosses the wire into `masgraph serve`, and the error that goes back when an episode fails: a POST body
read within its limits, parsed as the OpenAI request (UTF-8 JSON, numbers finite and of sane length, text valid
Unicode, each refusal a 400 naming the field), and a failed episode said in the user's terms."""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import math
import re
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from masgraph.serve.guards import ApiError
from masgraph.serve.openai_api import ChatRequest, locate, lone_surrogate, validation_message
from masgraph.spec import GraphSpec
from masgraph.trace import Trace

__all__ = ["MAX_NUMBER_CHARS", "failed", "parse", "read_body", "require_json"]

_log = logging.getLogger("uvicorn.error")


def require_json(request: Request) -> None:
    """POST bodies must be declared JSON: a cross-site page can send a form or text/plain without asking the
    browser's preflight, but not application/json."""
    media = (request.headers.get("content-type") or "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, not {media or 'missing'}",
                       param="Content-Type", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes is over the server's {limit}-byte limit",
                       code="body_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise ApiError(413, f"request body is over the server's {limit}-byte limit", code="body_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within the server's {timeout_s:g}s limit",
                       code="body_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ApiError(499, "client closed the request", code="client_closed") from None
    return bytes(body)


MAX_NUMBER_CHARS = 100
"""Longest number literal a request may hold (an int64 seed has 20 characters, a float's repr at most 24)."""


_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
"""Where a decoded body can hold a lone surrogate: an escape, or raw surrogate bytes (let through by the
`surrogatepass` decode, so the 400 can name the field that holds them)."""


class _Refused:
    """A number the request may not hold, in place of its value until `_parse` names where it is."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _number_hooks(refused: list[_Refused]) -> dict[str, Any]:
    """json.loads hooks that put a `_Refused` (also appended to `refused`) in place of NaN, Infinity, a float out
    of a double's range, and a number literal longer than MAX_NUMBER_CHARS."""
    def refuse(why: str) -> _Refused:
        refused.append(_Refused(why))
        return refused[-1]

    def too_long(text: str) -> bool:
        return len(text) > MAX_NUMBER_CHARS

    def floating(text: str) -> float | _Refused:
        if too_long(text):
            return refuse(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
        value = float(text)
        return value if math.isfinite(value) else refuse(f"{text} is out of the range of a double")

    def integer(text: str) -> int | _Refused:
        return refuse(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})") if too_long(text) \
            else int(text)

    return {"parse_float": floating, "parse_int": integer,
            "parse_constant": lambda text: refuse(f"{text} is not a JSON number")}


def parse(body: bytes) -> ChatRequest:
    """The request of a body: UTF-8 JSON, its numbers finite and of sane length, its text valid Unicode; each
    refusal a 400 naming the field (OpenAI's `param`)."""
    try:
        text = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})",
                       code="invalid_json") from None
    refused: list[_Refused] = []
    try:
        data = json.loads(text, **_number_hooks(refused))
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    if refused:
        where = locate(data, lambda v: isinstance(v, _Refused)) or ""
        why = refused[0].why  # the first in the document, as `locate` walks it
        raise ApiError(400, f"{where or 'the request body'}: {why}; send a finite number in plain notation",
                       param=where or None, code="invalid_json")
    if _MAYBE_SURROGATE.search(text) and (where := lone_surrogate(data)) is not None:
        raise ApiError(400, f"{where or 'the request body'}: holds a lone UTF-16 surrogate (an escape \\ud800-"
                            "\\udfff without its pair, or the raw bytes of one), which is not text; send valid "
                            "Unicode", param=where or None, code="invalid_unicode")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        message, param, code = validation_message(exc)
        raise ApiError(400, message, param=param, code=code) from None


def failed(trace: Trace, spec: GraphSpec) -> ApiError:
    """The error of a failed episode: 504 when it ran out of time (the episode's limit or a node's: a node waits
    for its LLM call on a loaded server), else 500; both carry the trace id and say what failed."""
    timed_out = trace.status == "timeout" or any(s.error is not None and s.error.startswith("node timed out")
                                                 for s in trace.steps)
    message = f"the agent failed on this question (trace {trace.episode_id}): {_what_failed(trace, spec)}"
    if timed_out:
        return ApiError(504, message, "timeout_error", code="episode_timeout")
    return ApiError(500, message, "server_error", code=f"episode_{trace.status}")


_BUGS = (AttributeError, LookupError, NameError, TypeError, ValueError, ArithmeticError, AssertionError,
         RecursionError)
"""Built-in exceptions that mean a bug in an agent or a backend (an OSError, a RuntimeError an agent raises on
purpose, a MasgraphError, say something the user can act on, so their messages are passed on)."""


_RAISED = re.compile(r"(?:^|: )([A-Z]\w*): ")
"""Where an error text names the exception class that raised it (`ValueError: ...`)."""


def _what_failed(trace: Trace, spec: GraphSpec) -> str:
    """A failed episode's error in the user's terms. An error of masgraph's own (a MasgraphError, a backend's
    located error, a tool's message, an OSError) is said as it is; a built-in exception of `_BUGS` (`not enough
    values to unpack`, an AttributeError) is a bug in an agent or a backend, not in the request: the reply names
    the node, its policy and backend and the exception's class, and the log keeps the message."""
    step = next((s for s in reversed(trace.steps) if s.error is not None), None)
    error = (step.error if step is not None else None) or trace.error or "no error recorded"
    raised = _RAISED.search(error)
    kind = getattr(builtins, raised.group(1), None) if raised is not None else None
    if not (isinstance(kind, type) and issubclass(kind, _BUGS)):
        return trace.error or error
    _log.warning("episode %s failed on an internal error: %s", trace.episode_id, trace.error or error)
    if step is None:
        return (f"the episode hit an internal error ({kind.__name__}) outside its nodes, not a problem with the "
                "request; the server log has the message")
    node = spec.nodes.get(step.node)
    policy = getattr(node, "policy", None)
    backend = spec.policies[policy].backend if policy in spec.policies else None
    where = (f"its agent ({node.role if node is not None else 'unknown'}) or the {backend} backend of its policy "
             f"{policy!r}" if policy is not None else f"its agent ({getattr(node, 'role', 'unknown')})")
    return (f"node {step.node!r} hit an internal error ({kind.__name__}) in {where}, not a problem with the "
            "request; the server log has the message, the stored trace the step")
