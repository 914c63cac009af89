"""`masgraph serve`: an agent behind an OpenAI-compatible HTTP endpoint (FastAPI on uvicorn).

    POST /v1/chat/completions   the last user message is the question; non-streaming or `stream: true` (SSE: the
                                built-in generator's answer streams as it decodes, see masgraph/streaming.py)
    GET  /v1/models             the one model served (the graph's name)
    GET  /health                liveness, load and the trace store's state (no auth)
    GET  /metrics               Prometheus text: requests by code, latency, episodes by status, tokens, queue

Every request runs one episode on a shared engine, so concurrent requests batch their LLM calls together.

Admission: at most `max_concurrency` episodes run and `max_queue` more requests wait for a slot (each at most
`max_wait_s`: 503 beyond); a request beyond those is refused at once with 429 and Retry-After. A request's
`timeout_s` starts when its episode starts, not when it arrived (504 beyond; the episode is cancelled).

Every failure is an OpenAI-style error body (`{"error": {"message", "type", "param", "code"}}`), never a bare
500: 400 bad JSON or fields (a lone UTF-16 surrogate, JSON nested past the parser's depth, a number too long),
401 auth, 404 model, 408 a body too slow, 413 too large, 415 not application/json, 429/503 busy, 504 too slow,
500 an episode that failed (with its trace id). A client that goes away cancels its episode; SIGTERM lets
admitted requests finish, then exits (uvicorn's graceful shutdown). A trace store that fails (a full disk) does
not stop the serving: /health says "degraded" with the store's last error, /metrics counts its errors, the log
has a line for each.

Connections: uvicorn has no header or body timeouts and holds a silent connection forever, so a connection must
send a request's head within `header_timeout_s` of opening or of its previous response, and a body must arrive
within `body_timeout_s`; connections beyond `max_connections` get a 503. A server without an API key is a
loopback server: it answers only requests whose Host is a loopback name (a DNS-rebinding page cannot reach it),
and every POST must be application/json (a cross-site form or `text/plain` fetch cannot)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import re
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from masgraph.agent import Agent, Answer
from masgraph.errors import MasgraphError
from masgraph.openai_api import (
    ChatRequest,
    chunk,
    completion,
    error_body,
    extension,
    lone_surrogate,
    question_of,
    usage,
    validation_message,
)
from masgraph.store import RunStore
from masgraph.streaming import AnswerStream
from masgraph.trace import Trace

__all__ = ["ServeConfig", "check_bind", "create_app", "serve", "uvicorn_options"]

_log = logging.getLogger("uvicorn.error")
"""The server's own lines go where uvicorn's go (its format, its --log-level)."""


@dataclass(frozen=True)
class ServeConfig:
    """How the endpoint guards itself. Defaults suit one CPU box; raise them on a GPU server."""

    api_key: str | None = None
    """Bearer token every /v1 and /metrics request must carry (None: no auth; only for loopback binds)."""
    max_body_bytes: int = 1 << 20
    """Largest request body (413 beyond)."""
    max_concurrency: int = 32
    """Episodes running at once (their LLM calls batch together). The engine's default batch is 32 rows, so
    each node's call of every running episode fits one batch; more would wait for later batches inside the
    episode, against the nodes' own timeouts, instead of in the queue."""
    max_queue: int = 256
    """Requests waiting for a slot beyond those; more get 429 with Retry-After at once."""
    max_wait_s: float | None = None
    """Longest a request waits in the queue (503 with Retry-After beyond); None: `timeout_s`."""
    timeout_s: float = 300.0
    """Limit of one episode, from when it starts (504 beyond; the episode is cancelled)."""
    store: Path | None = None
    """Run directory that keeps every episode's trace (events.jsonl); None: traces are not stored."""
    max_connections: int | None = None
    """Open connections at once (503 beyond); None: max_concurrency + max_queue + 64 (health checks, scrapes)."""
    header_timeout_s: float = 10.0
    """A connection must send a request's head within this of opening or of its previous response."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this of its head (408 beyond)."""
    keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this (uvicorn's default)."""
    max_header_bytes: int = 16 * 1024
    """Largest request head (h11's default; 400 beyond)."""
    loopback_hosts_only: bool = True
    """Without an API key, answer only requests whose Host is a loopback name (DNS rebinding); `serve` turns
    it off for a keyless public bind (--allow-public-without-key)."""

    @property
    def queue_wait_s(self) -> float:
        return self.timeout_s if self.max_wait_s is None else self.max_wait_s

    @property
    def connection_limit(self) -> int:
        return self.max_connections or self.max_concurrency + self.max_queue + 64


class ApiError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


_RETRY = {"Retry-After": "1"}


class _Gate:
    """Admission: at most `concurrency` episodes run, `queue` more wait (each at most `max_wait_s`); a request
    beyond those is refused at once."""

    def __init__(self, concurrency: int, queue: int, max_wait_s: float):
        self.slots, self.capacity, self.max_wait_s = asyncio.Semaphore(concurrency), concurrency + queue, max_wait_s
        self.admitted = 0
        """Requests running or queued."""
        self.running = 0

    def admit(self) -> _Ticket:
        if self.admitted >= self.capacity:
            raise ApiError(429, f"the server is at capacity ({self.capacity} requests running or queued); retry "
                                "shortly", "rate_limit_error", code="queue_full", headers=_RETRY)
        self.admitted += 1
        return _Ticket(self)


class _Ticket:
    """One admitted request: queued until `start`, running until `release`."""

    def __init__(self, gate: _Gate):
        self.gate, self.held, self.running = gate, True, False

    async def start(self) -> None:
        """Wait for a slot (503 after the gate's `max_wait_s`)."""
        try:
            async with asyncio.timeout(self.gate.max_wait_s):
                await self.gate.slots.acquire()
        except TimeoutError:
            raise ApiError(503, f"the server is busy: no episode slot freed up within {self.gate.max_wait_s:g}s; "
                                "retry later", "server_error", code="queue_timeout", headers=_RETRY) from None
        self.running = True
        self.gate.running += 1

    def release(self) -> None:
        """Give the slot and the place back; idempotent (the episode, a stream and a handler may each call it)."""
        if self.running:
            self.running = False
            self.gate.running -= 1
            self.gate.slots.release()
        if self.held:
            self.held = False
            self.gate.admitted -= 1


class _Metrics:
    def __init__(self, gate: _Gate, store: RunStore | None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("masgraph_requests", "HTTP requests by path and status code", ["path", "code"],
                                registry=r)
        self.latency = Histogram("masgraph_request_seconds", "Request latency (chat completions)", registry=r,
                                 buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, 300))
        Gauge("masgraph_requests_in_flight", "Chat requests admitted and not finished", registry=r).set_function(
            lambda: gate.admitted)
        Gauge("masgraph_requests_running", "Chat requests whose episode runs", registry=r).set_function(
            lambda: gate.running)
        Gauge("masgraph_requests_queued", "Chat requests waiting for an episode slot", registry=r).set_function(
            lambda: gate.admitted - gate.running)
        if store is not None:
            Gauge("masgraph_trace_store_errors", "Trace records the store could not write as sent, and failed "
                  "writes (0 while sound)", registry=r).set_function(lambda: store.errors)
        self.episodes = Counter("masgraph_episodes", "Episodes by final status", ["status"], registry=r)
        self.tokens = Counter("masgraph_tokens", "LLM tokens of all episodes", ["kind"], registry=r)


_PATHS = {"/v1/chat/completions", "/v1/models", "/health", "/metrics"}

_Send = Callable[[dict], Awaitable[None]]


class _Edge:
    """Pure ASGI middleware around every request (no BaseHTTPMiddleware: it would hide client disconnects from
    the endpoint): a keyless server's Host check, a count of responses by path and status, and the last resort
    that answers whatever escapes the app with an OpenAI-style error: no bare 500, and a request cancelled from
    outside (uvicorn's shutdown) gets a 503 and one log line, not a traceback."""

    def __init__(self, app: Any, metrics: _Metrics, check_host: bool):
        self.app, self.metrics, self.check_host = app, metrics, check_host

    async def __call__(self, scope: dict, receive: Any, send: _Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        where = f"{scope['method']} {scope['path']}"
        try:
            if self.check_host and not _loopback_host(_header(scope, b"host")):
                raise ApiError(400, f"Host {_header(scope, b'host')!r} is not a loopback name: a server without an "
                                    "API key answers only requests to localhost, 127.0.0.1 or [::1]",
                               param="Host", code="invalid_host")
            await self.app(scope, receive, send_status)
        except ApiError as exc:
            await _answer_late(send_status, status, exc)
        except asyncio.CancelledError:  # not re-raised: uvicorn would log a traceback and send a bare 500
            _log.warning("%s: cancelled before it was answered (server shutting down)", where)
            await _answer_late(send_status, status, ApiError(
                503, "the server cancelled this request (it is shutting down); retry", "server_error",
                code="cancelled", headers=_RETRY))
        except Exception as exc:  # a bug: its traceback, and still an OpenAI-style answer
            _log.error("%s: unexpected error", where, exc_info=exc)
            await _answer_late(send_status, status, ApiError(
                500, f"internal server error ({type(exc).__name__}); the server log has the details",
                "server_error", code="internal_error"))
        finally:
            path = scope["path"] if scope["path"] in _PATHS else "other"
            self.metrics.requests.labels(path, str(status or 500)).inc()


async def _answer_late(send: _Send, status: int, exc: ApiError) -> None:
    """Send `exc` as the response, unless one has started (then the connection just ends)."""
    if status:
        return
    response = exc.response()
    with suppress(Exception, asyncio.CancelledError):  # the client may be gone, the task cancelled again
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def create_app(agent: Agent, model: str, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The ASGI app serving `agent` as model `model`."""
    gate = _Gate(config.max_concurrency, config.max_queue, config.queue_wait_s)
    store = (RunStore(config.store, agent.graph.spec, {"serve": {"model": model, "max_concurrency":
             config.max_concurrency, "timeout_s": config.timeout_s}}) if config.store is not None else None)
    metrics, sinks = _Metrics(gate, store), [store] if store is not None else []
    started, served = int(time.time()), [0]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:  # after uvicorn has drained the in-flight requests; the agent is closed whatever the store does
            try:
                if store is not None:
                    store.close({"episodes": served[0], "store_errors": store.errors})
            except Exception as exc:
                _log.error("closing the trace store %s failed: %s: %s", store.path, type(exc).__name__, exc)
            finally:
                await agent.aclose()

    app = FastAPI(title=f"masgraph: {model}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind),
                            status_code=exc.status_code)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        sound = store is None or store.errors == 0
        return {"status": "ok" if sound else "degraded", "model": model, "in_flight": gate.admitted,
                "running": gate.running, "queued": gate.admitted - gate.running,
                "trace_store": None if store is None else {"path": str(store.path), "errors": store.errors,
                                                           "last_error": store.last_error}}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": started,
                                            "owned_by": "masgraph"}]}

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        authorize(request)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        authorize(request)
        _require_json(request)
        req = _parse(await _read_body(request, config.max_body_bytes, config.body_timeout_s))
        if req.model != model:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model!r}", param="model",
                           code="model_not_found")
        question = question_of(req)
        if question is None:
            raise ApiError(400, "messages: no user message with text content (the question is the last user "
                                "message)", param="messages")
        ticket, rid = gate.admit(), uuid.uuid4().hex[:24]
        if req.stream:  # the background task releases the ticket of a stream cut before its generator started
            return StreamingResponse(_stream(req, question, rid, ticket), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(ticket.release))
        try:
            ans = await _answer(question, rid, ticket, request, conversation=req.masgraph.conversation)
        finally:
            ticket.release()
        return completion(rid, ans.trace, ans.answer or "", model, req.masgraph.trace, _store_path())

    async def _stream(req: ChatRequest, question: str, rid: str, ticket: _Ticket) -> AsyncIterator[str]:
        """The SSE events of a streaming request: the role, the answer's text as the answer node decodes it, the
        rest of the answer when the episode ends (all of it when nothing streamed), the finish chunk, usage if
        asked, [DONE]. A failure after the first event is an OpenAI-style error event, then [DONE]."""
        stream = agent.answer_stream()
        answering = asyncio.ensure_future(_answer(question, rid, ticket, None, stream, req.masgraph.conversation))
        answering.add_done_callback(lambda _: stream.close())  # also when it failed before its episode began
        try:
            yield _sse(chunk(rid, model, {"role": "assistant", "content": ""}))
            async for text in stream:  # a disconnect cancels this generator (Starlette listens for it) and the episode
                yield _sse(chunk(rid, model, {"content": text}))
            try:
                ans = await answering
            except ApiError as exc:
                yield _sse(exc.body)
                yield "data: [DONE]\n\n"
                return
            except Exception as exc:  # a bug: its traceback in the log, an error event to the client
                _log.error("POST /v1/chat/completions (stream): unexpected error", exc_info=exc)
                yield _sse(error_body(f"internal server error ({type(exc).__name__}); the server log has the "
                                      "details", "server_error", code="internal_error"))
                yield "data: [DONE]\n\n"
                return
            rest = stream.rest(ans.answer or "")
            if rest is None:
                _log.warning("stream %s (trace %s): the answer node's final answer does not continue the text "
                             "streamed (it wrote a second answer, or its step was retried); the stream kept what "
                             "it had sent", rid, ans.trace.episode_id)
            elif rest:
                yield _sse(chunk(rid, model, {"content": rest}))
            final = chunk(rid, model, {}, "stop")
            if req.masgraph.trace:
                final["masgraph"] = extension(ans.trace, _store_path())
            yield _sse(final)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(chunk(rid, model, {}, usage_=usage(ans.trace), choices=False))
            yield "data: [DONE]\n\n"
        finally:
            answering.cancel()  # a client gone: the episode is cancelled
            with suppress(asyncio.CancelledError):
                await asyncio.gather(answering, return_exceptions=True)
            ticket.release()

    async def _answer(question: str, rid: str, ticket: _Ticket, request: Request | None,
                      stream: AnswerStream | None = None, conversation: str | None = None) -> Answer:
        """The episode of one request, run as its own task: queued, then run within the timeout; cancelled when
        the client goes away (watched here for a non-streaming `request`). `stream` gets the answer's text;
        `conversation` names the conversation whose memory it continues (`scope: conversation` memory nodes)."""
        t0 = time.perf_counter()
        meta = {"request_id": rid, **({"conversation": conversation} if conversation is not None else {})}
        episode = asyncio.ensure_future(_episode(question, meta, ticket, stream))
        episode.add_done_callback(_retrieved)
        waits = {episode}
        if request is not None:
            waits.add(asyncio.ensure_future(_disconnected(request)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not episode.done():
                raise ApiError(499, "client closed the request", code="client_closed")
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            metrics.latency.observe(time.perf_counter() - t0)
        return _outcome(episode)

    async def _episode(question: str, meta: dict[str, str], ticket: _Ticket, stream: AnswerStream | None) -> Answer:
        """Wait for a slot, then run the episode within `timeout_s` of its start (504 beyond)."""
        try:
            await ticket.start()
            limit = asyncio.timeout(config.timeout_s)  # its deadline is set now: the wait for a slot is not counted
            try:
                async with limit:
                    return await agent.aask(question, sinks=sinks, meta=meta, stream=stream)
            except TimeoutError:
                if not limit.expired():
                    raise
                raise ApiError(504, f"the episode took longer than the server's {config.timeout_s:g}s limit; it "
                                    "was cancelled", "timeout_error", code="timeout") from None
        finally:
            ticket.release()

    def _outcome(episode: asyncio.Future) -> Answer:
        """The answer of a finished episode task, or the ApiError that fits how it ended."""
        if episode.cancelled():  # not by this request (it only cancels an episode it no longer waits for)
            raise ApiError(503, "the episode was cancelled inside the server before it finished; retry",
                           "server_error", code="episode_cancelled", headers=_RETRY)
        exc = episode.exception()
        if isinstance(exc, ApiError):
            raise exc
        if exc is not None:
            raise exc  # a bug: _Edge logs it and answers 500
        ans: Answer = episode.result()
        _count(ans.trace)
        if not ans.ok:
            raise _failed(ans.trace)
        return ans

    def _count(trace: Trace) -> None:
        served[0] += 1
        metrics.episodes.labels(trace.status).inc()
        u = usage(trace)
        metrics.tokens.labels("prompt").inc(u["prompt_tokens"])
        metrics.tokens.labels("completion").inc(u["completion_tokens"])

    def _store_path() -> str | None:
        return str(store.path) if store is not None else None

    app.add_middleware(_Edge, metrics=metrics, check_host=config.api_key is None and config.loopback_hosts_only)
    return app


def _failed(trace: Trace) -> ApiError:
    """The error of a failed episode: 504 when it ran out of time (the episode's limit or a node's: a node waits
    for its LLM call on a loaded server), else 500; both carry the trace id."""
    timed_out = trace.status == "timeout" or any(s.error is not None and s.error.startswith("node timed out")
                                                 for s in trace.steps)
    message = f"the agent failed on this question (trace {trace.episode_id}): {trace.error}"
    if timed_out:
        return ApiError(504, message, "timeout_error", code="episode_timeout")
    return ApiError(500, message, "server_error", code=f"episode_{trace.status}")


def _retrieved(task: asyncio.Future) -> None:
    """Mark a task's exception as seen (asyncio logs an unseen one as an error when the task is collected)."""
    if not task.cancelled():
        task.exception()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away: the body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _require_json(request: Request) -> None:
    """POST bodies must be declared JSON: a cross-site page can send a form or text/plain without asking the
    browser's preflight, but not application/json."""
    media = (request.headers.get("content-type") or "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, not {media or 'missing'}",
                       param="Content-Type", code="unsupported_media_type")


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
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


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
"""Where a JSON body can hold a lone surrogate: an escape (raw surrogate bytes are not UTF-8: a decode error)."""


def _parse(body: bytes) -> ChatRequest:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    except ValueError:  # an integer longer than Python converts
        raise ApiError(400, f"the request body has a number of more than {sys.get_int_max_str_digits()} digits",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    if _ESCAPED_SURROGATE.search(body) and (where := lone_surrogate(data)) is not None:
        raise ApiError(400, f"{where or 'the request body'}: holds a lone UTF-16 surrogate (an escape \\ud800-"
                            "\\udfff without its pair), which is not text; send valid Unicode",
                       param=where or None, code="invalid_unicode")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param=param) from None


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_host(header: str | None) -> bool:
    """Whether a Host header names this machine's loopback (localhost, 127.0.0.0/8, [::1]; any port). A request
    without one (HTTP/1.0) passes: no browser sends that."""
    if header is None:
        return True
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return _is_loopback(host.rstrip("."))


def check_bind(host: str, api_key: str | None, allow_public: bool) -> None:
    """Refuse to serve a non-loopback address without an API key, unless told to."""
    if api_key is not None or allow_public or _is_loopback(host):
        return
    raise MasgraphError(f"--host {host} is reachable from other machines and no API key is set: pass --api-key "
                        "(or set MASGRAPH_API_KEY), or --allow-public-without-key if that is really meant")


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """uvicorn.Config/uvicorn.run keyword arguments that apply `config`'s connection guards."""
    return {"http": _guarded_protocol(config.header_timeout_s), "limit_concurrency": config.connection_limit,
            "timeout_keep_alive": config.keep_alive_s, "h11_max_incomplete_event_size": config.max_header_bytes,
            # a queued request may wait, then run: SIGTERM lets both finish
            "timeout_graceful_shutdown": int(config.queue_wait_s + config.timeout_s) + 5}


def serve(agent: Agent, model: str, host: str, port: int, config: ServeConfig = ServeConfig(),
          log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; admitted requests finish first."""
    import uvicorn

    if config.api_key is None and not _is_loopback(host):  # a keyless public bind, asked for: any Host
        config = dataclasses.replace(config, loopback_hosts_only=False)
    uvicorn.run(create_app(agent, model, config), host=host, port=port, log_level=log_level,
                **uvicorn_options(config))


def _guarded_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the guards it lacks. uvicorn arms no timer on a new connection and stops its
    keep-alive timer at the first byte, so a silent or dribbling connection was held forever: here a request's
    head must arrive within `header_timeout_s` of the connection opening or of its previous response (a head
    begun and not finished gets a 408, a silent connection is just closed). uvicorn's `limit_concurrency` check
    answers plain text: here a connection beyond that many gets an OpenAI-style 503 for its requests, and a
    malformed or oversized head an OpenAI-style 400."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cap, self.limit_concurrency = self.limit_concurrency, None  # uvicorn's check off: ours instead
            self.head_timer: asyncio.TimerHandle | None = None
            self.heard = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self.cap is not None and len(self.connections) > self.cap:
                self.app = _over_capacity
            self.await_head()

        def data_received(self, data: bytes) -> None:
            self.heard = True
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # a request's head has arrived
                self.stop_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_timer()
            super().connection_lost(exc)

        def await_head(self) -> None:
            self.stop_timer()
            self.heard = False
            self.head_timer = self.loop.call_later(header_timeout_s, self.head_timed_out)

        def stop_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_timed_out(self) -> None:
            self.head_timer = None
            if self.transport.is_closing():
                return
            if self.heard and self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
                self.transport.write(_request_timeout(f"the request head did not arrive within the server's "
                                                      f"{header_timeout_s:g}s limit"))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}", code="invalid_http")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Guarded


async def _over_capacity(scope: dict, receive: Any, send: _Send) -> None:
    """The app of a connection beyond the cap."""
    await _answer_late(send, 0, ApiError(503, "the server has too many open connections; retry shortly",
                                         "server_error", code="too_many_connections",
                                         headers={**_RETRY, "Connection": "close"}))


def _request_timeout(message: str) -> bytes:
    """A whole 408 response that closes the connection, written where h11 has no request to answer."""
    body = json.dumps(error_body(message, code="header_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body))
