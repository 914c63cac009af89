"""`masgraph serve BUNDLE --mcp`: the agent as an MCP server with one tool, `ask(question) -> {answer, trace_id}`,
over stdio or streamable HTTP (the `mcp` SDK's MCPServer; the `mcp` extra), so MCP clients (Claude Desktop, IDEs,
agent SDKs) can call a trained graph.

The trace id is the episode's id: with a trace store (the default of `serve`) the episode is in RUN/events.jsonl.
A failed or timed-out episode is the tool call's error (with the reason and trace id), never the server's end.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from masgraph.events import Sink
from masgraph.serve.agent import Agent

Transport = Literal["stdio", "http"]
PATH = "/mcp"
"""Where the streamable-HTTP endpoint is (http://HOST:PORT/mcp)."""


class Reply(BaseModel):
    """What `ask` returns (as structured content, and as its JSON text)."""

    answer: str
    """The agent's answer."""
    trace_id: str
    """The episode's id (in the server's trace store, RUN/events.jsonl)."""


def mcp_server(agent: Agent, timeout_s: float, sinks: Sequence[Sink] = ()) -> Any:
    """An MCPServer whose `ask` tool runs one episode of `agent` (its events to `sinks`, e.g. a RunStore)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer(agent.name, instructions=f"`ask` puts a question to the trained {agent.name!r} agent.",
                       log_level="WARNING")

    @server.tool(name="ask", description=f"Ask the {agent.name} agent a question; it answers with its graph "
                 "of LLM nodes and tools. Returns the answer and the trace id of the episode.")
    async def ask(question: str) -> Reply:
        try:
            async with asyncio.timeout(timeout_s):
                answer = await agent.aask(question, sinks=sinks)
        except TimeoutError:
            raise ToolError(f"the episode took longer than {timeout_s:g}s (serve --timeout)") from None
        except Exception as exc:  # an empty question, a backend failure: this call's error
            raise ToolError(str(exc) or type(exc).__name__) from None
        trace = answer.trace
        if not answer.ok:
            raise ToolError(f"the episode {trace.status} ({trace.error or 'no answer'}); trace {trace.episode_id}")
        return Reply(answer=answer.answer, trace_id=trace.episode_id)

    return server


def _bearer(app: Callable[..., Awaitable[None]], api_key: str) -> Callable[..., Awaitable[None]]:
    """ASGI: HTTP requests without `Authorization: Bearer KEY` get 401 (lifespan passes through)."""
    expected = f"Bearer {api_key}".encode()

    async def guarded(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body",
                            "body": b'{"error": {"message": "missing or wrong bearer key", "code": 401}}'})
                return
        await app(scope, receive, send)
    return guarded


def serve_mcp(agent: Agent, transport: Transport, *, host: str = "127.0.0.1", port: int = 8000,
              api_key: str | None = None, timeout_s: float = 300.0, store: Path | None = None,
              log_level: str = "warning") -> None:
    """Run the MCP server until stopped (stdio: until the client closes stdin; http: Ctrl-C)."""
    sinks = []
    if store is not None:
        from masgraph.rundir.store import RunStore

        sinks.append(RunStore(store, agent.graph.spec, {"serve": {"mcp": transport, "timeout_s": timeout_s}}))
    server = mcp_server(agent, timeout_s, sinks)
    try:
        if transport == "stdio":
            server.run("stdio")
            return
        import uvicorn

        app = server.streamable_http_app(streamable_http_path=PATH, host=host)
        uvicorn.Server(uvicorn.Config(_bearer(app, api_key) if api_key else app, host=host, port=port,
                                      log_level=log_level)).run()
    finally:
        for sink in sinks:
            sink.close({"served": f"mcp {transport}"})
