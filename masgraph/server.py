"""`masgraph serve`: an agent behind an OpenAI-compatible HTTP endpoint (FastAPI on uvicorn).

    POST /v1/chat/completions   the last user message is the question; non-streaming or `stream: true` (SSE)
    GET  /v1/models             the one model served (the graph's name)
    GET  /health                liveness, load and the trace store's state (no auth)
    GET  /metrics               Prometheus text: requests by code, latency, episodes by status, tokens

Every request runs one episode on a shared engine, so concurrent requests batch their LLM calls together. The
guards: bearer-token auth (when a key is set), a request body limit (413), a bounded queue (429 with
Retry-After), a per-request timeout (504), OpenAI-style 400s for malformed JSON or fields (a lone UTF-16
surrogate among them: no trace store or response could hold it); a client that goes away cancels its episode;
SIGTERM lets in-flight requests finish, then exits (uvicorn's graceful shutdown). A trace store that fails
(a full disk) does not stop the serving: /health says "degraded" with the store's last error, /metrics counts
its errors, the log has a line for each."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

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

__all__ = ["ServeConfig", "check_bind", "create_app", "serve"]

_log = logging.getLogger("uvicorn.error")
"""The server's own lines go where uvicorn's go (its format, its --log-level)."""


@dataclass(frozen=True)
class ServeConfig:
    """How the endpoint guards itself. Defaults suit one CPU box; raise them on a GPU server."""

    api_key: str | None = None
    """Bearer token every /v1 and /metrics request must carry (None: no auth; only for loopback binds)."""
    max_body_bytes: int = 1 << 20
    """Largest request body (413 beyond)."""
    max_concurrency: int = 64
    """Episodes in flight at once (their LLM calls batch together)."""
    max_queue: int = 256
    """Requests waiting for a slot beyond those; more get 429 with Retry-After."""
    timeout_s: float = 300.0
    """Per-request limit (504 beyond; the episode is cancelled)."""
    store: Path | None = None
    """Run directory that keeps every episode's trace (events.jsonl); None: traces are not stored."""


class ApiError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


class _Gate:
    """Admission: at most `concurrency` episodes run, `queue` more wait; beyond that a request is refused."""

    def __init__(self, concurrency: int, queue: int):
        self.slots, self.capacity, self.admitted = asyncio.Semaphore(concurrency), concurrency + queue, 0

    def admit(self) -> _Ticket:
        if self.admitted >= self.capacity:
            raise ApiError(429, f"the server is at capacity ({self.capacity} requests in flight or queued); retry "
                                "shortly", "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        self.admitted += 1
        return _Ticket(self)


class _Ticket:
    def __init__(self, gate: _Gate):
        self.gate, self.held = gate, True

    def release(self) -> None:  # idempotent: a stream's generator and its cleanup may both call it
        if self.held:
            self.held = False
            self.gate.admitted -= 1


class _Metrics:
    def __init__(self, store: RunStore | None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("masgraph_requests", "HTTP requests by path and status code", ["path", "code"],
                                registry=r)
        self.latency = Histogram("masgraph_request_seconds", "Request latency (chat completions)", registry=r,
                                 buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, 300))
        self.in_flight = Gauge("masgraph_requests_in_flight", "Chat requests admitted and not finished", registry=r)
        if store is not None:
            Gauge("masgraph_trace_store_errors", "Trace records the store could not write as sent, and failed "
                  "writes (0 while sound)", registry=r).set_function(lambda: store.errors)
        self.episodes = Counter("masgraph_episodes", "Episodes by final status", ["status"], registry=r)
        self.tokens = Counter("masgraph_tokens", "LLM tokens of all episodes", ["kind"], registry=r)


class _Count:
    """Pure ASGI middleware counting responses by path and status (no BaseHTTPMiddleware: it would hide client
    disconnects from the endpoint)."""

    def __init__(self, app: Any, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in _PATHS else "other"
            self.metrics.requests.labels(path, str(status)).inc()


_PATHS = {"/v1/chat/completions", "/v1/models", "/health", "/metrics"}


def create_app(agent: Agent, model: str, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The ASGI app serving `agent` as model `model`."""
    gate = _Gate(config.max_concurrency, config.max_queue)
    store = (RunStore(config.store, agent.graph.spec, {"serve": {"model": model, "max_concurrency":
             config.max_concurrency, "timeout_s": config.timeout_s}}) if config.store is not None else None)
    metrics = _Metrics(store)
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
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

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
        req = _parse(await _read_body(request, config.max_body_bytes))
        if req.model != model:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model!r}", param="model",
                           code="model_not_found")
        question = question_of(req)
        if question is None:
            raise ApiError(400, "messages: no user message with text content (the question is the last user "
                                "message)", param="messages")
        ticket, rid = gate.admit(), uuid.uuid4().hex[:24]
        metrics.in_flight.inc()
        if req.stream:
            return StreamingResponse(_stream(req, question, rid, ticket), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            ans = await _answer(question, rid, request)
        finally:
            ticket.release()
            metrics.in_flight.dec()
        return completion(rid, ans.trace, ans.answer or "", model, req.masgraph.trace, _store_path())

    async def _stream(req: ChatRequest, question: str, rid: str, ticket: _Ticket) -> AsyncIterator[str]:
        try:
            yield _sse(chunk(rid, model, {"role": "assistant", "content": ""}))
            try:
                ans = await _answer(question, rid, None)  # a disconnect cancels this generator, and the episode
            except ApiError as exc:
                yield _sse(exc.body)
                yield "data: [DONE]\n\n"
                return
            yield _sse(chunk(rid, model, {"content": ans.answer or ""}))
            final = chunk(rid, model, {}, "stop")
            if req.masgraph.trace:
                final["masgraph"] = extension(ans.trace, _store_path())
            yield _sse(final)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(chunk(rid, model, {}, usage_=usage(ans.trace), choices=False))
            yield "data: [DONE]\n\n"
        finally:
            ticket.release()
            metrics.in_flight.dec()

    async def _answer(question: str, rid: str, request: Request | None) -> Answer:
        """The episode for one request, within the timeout; cancelled when the client goes away."""
        t0 = time.perf_counter()

        async def run() -> Answer:
            async with gate.slots:
                return await agent.aask(question, sinks=[store] if store is not None else [],
                                        meta={"request_id": rid})

        task = asyncio.ensure_future(run())
        try:
            async with asyncio.timeout(config.timeout_s):
                while True:
                    done, _ = await asyncio.wait({task}, timeout=0.2)
                    if done:
                        break
                    if request is not None and await request.is_disconnected():
                        task.cancel()
                        raise ApiError(499, "client closed the request", code="client_closed")
        except TimeoutError:
            raise ApiError(504, f"the episode took longer than the server's {config.timeout_s:g}s limit; it was "
                                "cancelled", "timeout_error", code="timeout") from None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            metrics.latency.observe(time.perf_counter() - t0)
        ans = task.result()
        trace = ans.trace
        served[0] += 1
        metrics.episodes.labels(trace.status).inc()
        u = usage(trace)
        metrics.tokens.labels("prompt").inc(u["prompt_tokens"])
        metrics.tokens.labels("completion").inc(u["completion_tokens"])
        if not ans.ok:
            status = 504 if trace.status == "timeout" else 500
            raise ApiError(status, f"the agent failed on this question (trace {trace.episode_id}): {trace.error}",
                           "server_error", code=f"episode_{trace.status}")
        return ans

    def _store_path() -> str | None:
        return str(store.path) if store is not None else None

    app.add_middleware(_Count, metrics=metrics)
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes is over the server's {limit}-byte limit",
                       code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body is over the server's {limit}-byte limit", code="body_too_large")
    return bytes(body)


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
"""Where a JSON body can hold a lone surrogate: an escape (raw surrogate bytes are not UTF-8: a decode error)."""


def _parse(body: bytes) -> ChatRequest:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
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


def check_bind(host: str, api_key: str | None, allow_public: bool) -> None:
    """Refuse to serve a non-loopback address without an API key, unless told to."""
    if api_key is not None or allow_public:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise MasgraphError(f"--host {host} is reachable from other machines and no API key is set: pass --api-key "
                            "(or set MASGRAPH_API_KEY), or --allow-public-without-key if that is really meant")


def serve(agent: Agent, model: str, host: str, port: int, config: ServeConfig = ServeConfig(),
          log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests finish first (at most `config.timeout_s` more)."""
    import uvicorn

    uvicorn.run(create_app(agent, model, config), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=int(config.timeout_s) + 5, limit_concurrency=None)
