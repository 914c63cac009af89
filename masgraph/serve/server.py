"""`masgraph serve`: an agent behind an OpenAI-compatible HTTP endpoint (FastAPI on uvicorn).

    POST /v1/chat/completions   the last user message is the question; non-streaming or `stream: true` (SSE: the
                                built-in generator's answer streams as it decodes, see masgraph/streaming.py);
                                each field honoured or refused with a 400 naming it (masgraph/serve/fields.py)
    GET  /v1/models[/{id}]      the one model served (the graph's name)
    GET  /health                liveness, load and the trace store's state (no auth)
    GET  /metrics               Prometheus text: requests by code, latency, episodes by status, tokens, queue

Every request runs one episode per choice (`n`) on a shared engine, so concurrent requests batch their LLM calls
together.

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
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from masgraph.events import EpisodeFinished, EpisodeStarted, Event, StepFinished
from masgraph.rundir.store import RunStore
from masgraph.serve.agent import Agent, Answer
from masgraph.serve.fields import Plan, check_context, plan
from masgraph.serve.guards import (
    _RETRY,
    ApiError,
    _Edge,
    _Gate,
    _guarded_protocol,
    _is_loopback,
    _Metrics,
    _Ticket,
    check_bind,
)
from masgraph.serve.openai_api import error_body, question_of, usage
from masgraph.serve.replies import Reply
from masgraph.serve.wire import failed, parse, read_body, require_json
from masgraph.streaming import AnswerStream
from masgraph.trace import Step, Trace

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
    """Largest request head, from its request line to the blank line that ends it (400 beyond)."""
    loopback_hosts_only: bool = True
    """Without an API key, answer only requests whose Host is a loopback name (DNS rebinding); `serve` turns
    it off for a keyless public bind (--allow-public-without-key)."""

    @property
    def queue_wait_s(self) -> float:
        return self.timeout_s if self.max_wait_s is None else self.max_wait_s

    @property
    def connection_limit(self) -> int:
        return self.max_connections or self.max_concurrency + self.max_queue + 64


def create_app(agent: Agent, model: str, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The ASGI app serving `agent` as model `model`."""
    gate = _Gate(config.max_concurrency, config.max_queue, config.queue_wait_s)
    store = (RunStore(config.store, agent.graph.spec, {"serve": {"model": model, "max_concurrency":
             config.max_concurrency, "timeout_s": config.timeout_s}}) if config.store is not None else None)
    watch = _WatchedStore(store) if store is not None else None
    metrics, sinks = _Metrics(gate, store), [watch] if watch is not None else []
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
        if config.api_key is not None and not _authorized(request, config.api_key):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`", code="invalid_api_key")

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """No auth (load balancers probe it), so it names no path unless the request carries the API key: the
        run dir's path, and a store error that names a file, are the server's business."""
        sound = watch is None or not watch.failing
        trace_store = None
        if store is not None:
            shown = config.api_key is not None and _authorized(request, config.api_key)
            last = store.last_error
            if last is not None and not shown:
                last = last.replace(str(store.path), "<run dir>")
            trace_store = {**({"path": str(store.path)} if shown else {}), "errors": store.errors,
                           "last_error": last}
        return {"status": "ok" if sound else "degraded", "model": model, "in_flight": gate.admitted,
                "running": gate.running, "queued": gate.admitted - gate.running, "trace_store": trace_store}

    served_model = {"id": model, "object": "model", "created": started, "owned_by": "masgraph"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [served_model]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        if model_id != model:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {model!r}",
                           "not_found_error", param="model", code="model_not_found")
        return served_model

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        authorize(request)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        authorize(request)
        require_json(request)
        req = parse(await read_body(request, config.max_body_bytes, config.body_timeout_s))
        if req.model != model:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model!r}", param="model",
                           code="model_not_found")
        question = question_of(req)
        if question is None:
            raise ApiError(400, "messages: no user message with text content (the question is the last user "
                                "message)", param="messages")
        asked = plan(req, agent)
        await check_context(question, agent, asked, req.masgraph.truncate)
        tickets = []
        try:
            tickets.extend(gate.admit() for _ in range(asked.n))
        except ApiError:
            for ticket in tickets:
                ticket.release()
            raise
        rid = uuid.uuid4().hex[:24]
        reply = Reply(req, asked, rid, model, agent, _store_path())
        streams = [agent.answer_stream() for _ in tickets] if req.stream else [None] * len(tickets)
        episodes = [_start(question, rid, ticket, stream, req.masgraph.conversation, asked, i,
                           reply.step_sink(i) if req.masgraph.stream_steps else None)
                    for i, (ticket, stream) in enumerate(zip(tickets, streams))]
        if req.stream:  # the background task ends the episodes of a stream cut before its generator started
            return StreamingResponse(reply.stream(episodes, streams, _settled),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(_end, episodes, tickets))
        try:
            answers = await _answers(episodes, request)
        finally:
            for ticket in tickets:
                ticket.release()
        return reply.body(answers)

    async def _end(episodes: list[asyncio.Task], tickets: list[_Ticket]) -> None:
        for episode, ticket in zip(episodes, tickets):
            episode.cancel()  # done already, unless the stream was cut before its generator started
            ticket.release()

    def _start(question: str, rid: str, ticket: _Ticket, stream: AnswerStream | None, conversation: str | None,
               asked: Plan, index: int, on_step: Callable[[Step], None] | None) -> asyncio.Task:
        """Episode `index` of a request (its choice `index`), as its own task, started now: queued, then run
        within the timeout. `stream` gets the answer's text; `conversation` names the conversation whose memory it
        continues (`scope: conversation` memory nodes). A request cancelled before its episode began (its client
        went away while it was queued) is stored as a `cancelled` episode, as one cancelled while it runs is.
        `on_step` gets each step as it finishes."""
        meta = {"request_id": rid, **({"conversation": conversation} if conversation is not None else {}),
                **({"choice": index} if asked.n > 1 else {}), **asked.meta}
        seen = _Seen(sinks, on_step)
        queued = time.perf_counter()
        ask = {"sampling": asked.sampling, "seed": asked.seed, "sample": index}
        episode = asyncio.ensure_future(_episode(question, meta, ticket, stream, seen, ask))

        def ended(task: asyncio.Future) -> None:
            if stream is not None:
                stream.close()  # also when it failed before its episode began
            if task.cancelled() and not seen.started and sinks:
                _record_unstarted(question, meta, time.perf_counter() - queued)
            _retrieved(task)

        episode.add_done_callback(ended)
        return episode

    async def _answers(episodes: list[asyncio.Task], request: Request | None) -> list[Answer]:
        """The answers of a request's episodes (the first failure's error when one failed); the episodes are
        cancelled when the client goes away (watched here for a non-streaming `request`)."""
        t0 = time.perf_counter()
        every = asyncio.ensure_future(asyncio.wait(episodes))
        waits: set[asyncio.Future] = {every}
        if request is not None:
            waits.add(asyncio.ensure_future(_disconnected(request)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not every.done():
                raise ApiError(499, "client closed the request", code="client_closed")
        finally:
            for task in (*waits, *episodes):
                task.cancel()
            await asyncio.gather(*waits, *episodes, return_exceptions=True)
            metrics.latency.observe(time.perf_counter() - t0)
        answers, errors = [], []
        for episode in episodes:
            try:
                answers.append(_outcome(episode))
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return answers

    async def _settled(episode: asyncio.Task) -> Answer:
        return (await _answers([episode], None))[0]

    async def _episode(question: str, meta: dict[str, Any], ticket: _Ticket, stream: AnswerStream | None,
                       seen: _Seen, ask: dict[str, Any]) -> Answer:
        """Wait for a slot, then run the episode within `timeout_s` of its start (504 beyond)."""
        try:
            await ticket.start()
            limit = asyncio.timeout(config.timeout_s)  # its deadline is set now: the wait for a slot is not counted
            try:
                async with limit:
                    return await agent.aask(question, sinks=[seen], meta=meta, stream=stream, **ask)
            except TimeoutError:
                if not limit.expired():
                    raise
                raise ApiError(504, f"the episode took longer than the server's {config.timeout_s:g}s limit; it "
                                    "was cancelled", "timeout_error", code="timeout") from None
        finally:
            ticket.release()

    def _record_unstarted(question: str, meta: dict[str, str], waited_s: float) -> None:
        """Store a request cancelled before its episode began as a `cancelled` episode of no steps."""
        episode_id = uuid.uuid4().hex[:16]
        trace = Trace(episode_id=episode_id, item_id=episode_id, query=question, status="cancelled",
                      error="the client closed the request before its episode started (it was queued)",
                      duration_s=waited_s, meta=dict(meta))
        for sink in sinks:
            sink.emit(EpisodeStarted(episode_id=episode_id, item_id=episode_id, query=question,
                                     started=time.time() - waited_s))
            sink.emit(EpisodeFinished(trace=trace))

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
            raise failed(ans.trace, agent.graph.spec)
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


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


class _Seen:
    """One request's sinks: forwards to the server's, noting whether its episode has begun (and passing each
    finished step to `on_step`, for `stream_steps`)."""

    def __init__(self, sinks: list[_WatchedStore], on_step: Callable[[Step], None] | None = None):
        self.sinks, self.started, self.on_step = sinks, False, on_step

    def emit(self, event: Event) -> None:
        if isinstance(event, EpisodeStarted):
            self.started = True
        elif self.on_step is not None and isinstance(event, StepFinished):
            self.on_step(event.step)
        for sink in self.sinks:
            sink.emit(event)


class _WatchedStore:
    """The run store as the episodes' sink, noting whether its latest episode went down whole. /health is
    degraded while the store fails (`failing`: errors since the last episode it wrote cleanly), not for the rest
    of the server's life after one record it had to repair; its `errors` count stays cumulative for /metrics."""

    def __init__(self, store: RunStore):
        self.store, self.errors_when_sound = store, 0

    def emit(self, event: Event) -> None:
        before = self.store.errors
        self.store.emit(event)
        if isinstance(event, EpisodeFinished) and self.store.errors == before:  # written whole, now
            self.errors_when_sound = before

    @property
    def failing(self) -> bool:
        return self.store.errors > self.errors_when_sound


def _retrieved(task: asyncio.Future) -> None:
    """Mark a task's exception as seen (asyncio logs an unseen one as an error when the task is collected)."""
    if not task.cancelled():
        task.exception()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away: the body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """uvicorn.Config/uvicorn.run keyword arguments that apply `config`'s connection guards."""
    return {"http": _guarded_protocol(config.header_timeout_s, config.max_header_bytes),
            "limit_concurrency": config.connection_limit, "timeout_keep_alive": config.keep_alive_s,
            "h11_max_incomplete_event_size": config.max_header_bytes,
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
