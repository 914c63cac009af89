"""Helpers for the server's tests: a real uvicorn server on a socket in a thread, a scripted agent to serve,
request bodies, raw sockets and a disk that fills up. Shared by tests/unit/serve/test_*.py and the conversation
test (tests/unit/memory/test_conversations.py)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import socket
import threading
import time

from masgraph.backends.scripted import ScriptedBackend
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.runtime.engine import Engine
from masgraph.serve.agent import Agent
from masgraph.serve.server import ServeConfig, create_app, uvicorn_options

GRAPH = """\
name: echo
policies:
  main: {backend: scripted, model: none}
nodes:
  answer: {role: generator, policy: main}
entry: answer
exit: answer
"""

JSON = {"Content-Type": "application/json"}


def scripted_agent(text: str = GRAPH, backend: ScriptedBackend | None = None) -> Agent:
    """`text`'s graph on a scripted backend (default: answers `Answer: <length of the last message>`)."""
    graph = compile_spec(parse_spec(text, "serve.yaml"))
    backend = backend or ScriptedBackend(default=lambda req: f"Answer: {len(req.messages[-1]['content'])}")
    return Agent(graph, engine=Engine(graph, backends={"scripted": backend}))


@contextlib.contextmanager
def serving(agent: Agent, config: ServeConfig | None = None, model: str = "echo"):
    """A real uvicorn server in a thread, on a port the OS picks; yields its base URL."""
    import uvicorn

    config = config or ServeConfig()
    app = create_app(agent, model, config)
    # log_config=None: uvicorn's records reach the root logger, so `caplog` sees them (tracebacks included)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", log_config=None,
                                           **uvicorn_options(config)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def ask(text: str, model: str = "echo", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


async def until(condition, seconds: float = 60) -> None:
    """Wait (polling in a thread, without blocking the loop for long) until `condition()` holds; fail after
    `seconds`."""
    deadline = time.monotonic() + seconds
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a 60 s socket timeout fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST `body` byte for byte (http.client: no client-side encoding or escaping)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body, {**JSON, **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Disk:
    """A run dir's file whose writes fail while `full` is set (a full disk)."""

    full = False

    def __init__(self, file):
        self.file = file

    def write(self, data: bytes) -> int:
        if Disk.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def tracebacks(caplog) -> list[str]:
    """Log records that carry a traceback (a leaked exception), as text."""
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info is not None]
