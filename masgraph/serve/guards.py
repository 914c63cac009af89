"""The HTTP edge of `masgraph serve`: admission, OpenAI-style errors for whatever escapes the app, the loopback
Host check, bind rules, and header/body timeouts on uvicorn connections."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from masgraph.errors import MasgraphError
from masgraph.serve.openai_api import error_body

if TYPE_CHECKING:
    from masgraph.rundir.store import RunStore

_log = logging.getLogger("uvicorn.error")
"""The server's own lines go where uvicorn's go (its format, its --log-level)."""


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


class ApiError(Exception):
    """An error answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


_RETRY = {"Retry-After": "1"}


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


_LINGER_S = 2.0
"""Longest a connection refused with a 400 stays open to discard the rest of its request."""


_HEAD_END = re.compile(rb"\n\r?\n")
"""The blank line that ends a request head, as h11 finds it."""


def _guarded_protocol(header_timeout_s: float, max_header_bytes: int = 16 * 1024) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the guards it lacks. uvicorn arms no timer on a new connection and stops its
    keep-alive timer at the first byte, so a silent or dribbling connection was held forever: here a request's
    head must arrive within `header_timeout_s` of the connection opening or of its previous response (a head
    begun and not finished gets a 408, a silent connection is just closed). uvicorn's `limit_concurrency` check
    answers plain text: here a connection beyond that many gets an OpenAI-style 503 for its requests, and a
    malformed head, or one over `max_header_bytes`, an OpenAI-style 400. (h11's `max_incomplete_event_size`
    bounds only a head still unfinished: a whole head that arrives in one read, up to the transport's 256 KiB,
    passes it, so the size of each head is checked here before h11 parses it.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cap, self.limit_concurrency = self.limit_concurrency, None  # uvicorn's check off: ours instead
            self.head_timer: asyncio.TimerHandle | None = None
            self.heard = self.draining = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self.cap is not None and len(self.connections) > self.cap:
                self.app = _over_capacity
            self.await_head()

        def data_received(self, data: bytes) -> None:
            if self.draining:  # a refused connection, lingering
                return
            self.heard = True
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # a request's head has arrived
                self.stop_timer()

        def handle_events(self) -> None:
            """Refuse a head over the limit before h11 parses it (here both for a head just received and for a
            pipelined one buffered behind a response)."""
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                buffered = self.conn.trailing_data[0]
                end = _HEAD_END.search(buffered)
                size = end.end() if end is not None else len(buffered)
                if size > max_header_bytes:
                    self.logger.warning("Refused a request head over %d bytes.", max_header_bytes)
                    self.send_400_response(f"the request head is over the server's {max_header_bytes}-byte limit")
                    return
            super().handle_events()

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
            self.linger()

        def linger(self) -> None:
            """End a refused connection so that the client reads the 400: closing with bytes of its request still
            unread would reset the connection, and a reset client loses what it had not read yet. So: send EOF,
            then discard what it still sends for up to `_LINGER_S`, then close."""
            self.stop_timer()
            self.draining = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(_LINGER_S, self.transport.close)
            else:
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
