"""Tool kind `mcp`: one tool of an MCP server (a command started over stdio, or a streamable-HTTP URL), called
through the official `mcp` SDK (the `mcp` extra, imported only when a graph uses the kind).

Each server is connected once per process, on a thread of its own (so calls may come from any event loop), and its
tools are listed then: the graph tool's prompt shows the server tool's description and arguments. Arguments are
checked against the tool's JSON schema before the call; a server error, a crash or a hang (the tool's `timeout_s`)
fails that step with the reason, never the run, and a server that died is started again on the next call.

    tools:
      add: {kind: mcp, options: {command: [python, server.py], tool: add}}
      search: {kind: mcp, timeout_s: 30,
               options: {url: "https://example.com/mcp", headers_env: {Authorization: SEARCH_AUTH}, tool: search}}
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import threading
from typing import Any

from pydantic import Field, model_validator

from masgraph.agents.tools.registry import BUILTIN_TOOLS, ToolError, ToolKind, ToolOptions
from masgraph.errors import MasgraphError
from masgraph.node import ToolFn

CONNECTION_CLOSED = -32000
"""The SDK's error code for a connection that ended (the server exited)."""


class McpOptions(ToolOptions):
    """Where the MCP server is and which of its tools this graph tool calls."""

    command: list[str] | None = None
    """Start the server with this command and talk over its stdin/stdout, e.g. `[python, server.py]`."""
    url: str | None = None
    """Or a running server's streamable-HTTP endpoint, e.g. `http://127.0.0.1:8000/mcp`."""
    headers_env: dict[str, str] = Field(default_factory=dict)
    """HTTP headers whose values come from environment variables (header -> variable name), so that a token never
    sits in the graph file: `{Authorization: MY_SERVER_AUTH}`."""
    cwd: str | None = None
    """Working directory of a `command` server (default: the current one)."""
    pass_env: list[str] = Field(default_factory=list)
    """Environment variables a `command` server gets from this process (it starts with the SDK's minimal
    environment: HOME, PATH, USER, ...), e.g. `[GITHUB_TOKEN]`: names here, values never in the graph file."""
    tool: str
    """The server's tool this graph tool calls (`masgraph validate --check-tools` lists them)."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """How long starting or reaching the server and listing its tools may take."""

    @model_validator(mode="after")
    def _one_server(self) -> McpOptions:
        if (self.command is None) == (self.url is None):
            raise ValueError("give the server as one of `command: [program, args...]` (stdio) or `url:` "
                             "(streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("`command` is empty; give the program and its arguments")
        if self.headers_env and self.url is None:
            raise ValueError("`headers_env` needs a `url:` server (a stdio server takes no headers)")
        if self.pass_env and self.url is not None:
            raise ValueError("`pass_env` is for a `command:` server; an HTTP server takes `headers_env`")
        return self


def _label(o: McpOptions) -> str:
    return o.url or " ".join(o.command or [])


class McpServer:
    """One MCP server's connection, owned by a task on a private event loop thread: tools listed at connect,
    `call` awaitable from any loop (a cancelled caller cancels the request)."""

    def __init__(self, options: McpOptions):
        self.options, self.label = options, _label(options)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"mcp {self.label}", daemon=True).start()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        try:
            self.tools: dict[str, Any] = asyncio.run_coroutine_threadsafe(
                self._connect(), self.loop).result(options.connect_timeout_s + 5)
        except Exception as exc:
            self.close()
            raise MasgraphError(f"MCP server `{self.label}` did not start: {_reason(exc)}") from None

    def _transport(self) -> Any:
        from mcp import StdioServerParameters, stdio_client

        o = self.options
        if o.url is None:
            missing = [v for v in o.pass_env if v not in os.environ]
            if missing:
                raise MasgraphError(f"environment variable(s) {', '.join(missing)} not set (pass_env)")
            from mcp.client.stdio import get_default_environment

            env = get_default_environment() | {v: os.environ[v] for v in o.pass_env}
            params = StdioServerParameters(command=o.command[0], args=o.command[1:], cwd=o.cwd, env=env)
            return stdio_client(params, errlog=_errlog())
        missing = [v for v in o.headers_env.values() if v not in os.environ]
        if missing:
            raise MasgraphError(f"environment variable(s) {', '.join(missing)} not set (headers_env)")
        if not o.headers_env:
            return o.url
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = {h: os.environ[v] for h, v in o.headers_env.items()}
        return streamable_http_client(o.url, http_client=httpx2.AsyncClient(headers=headers, timeout=30))

    async def _connect(self) -> dict[str, Any]:
        ready: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._owner = self.loop.create_task(self._own(ready))
        async with asyncio.timeout(self.options.connect_timeout_s):
            return await ready

    async def _own(self, ready: asyncio.Future) -> None:
        """Enters and leaves the SDK's client in one task (its cancel scopes need that); lives until `close`."""
        from mcp import Client

        stop = asyncio.Event()
        try:
            async with Client(self._transport()) as client:
                tools, cursor = {}, None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools |= {t.name: t for t in page.tools}
                    if not (cursor := page.next_cursor):
                        break
                self._client, self._stop = client, stop
                ready.set_result(tools)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
        finally:
            if self._stop is stop:  # (a session started since is not this one's to clear)
                self._client = None

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        from mcp import MCPError

        if self._client is None:  # it died: start it again (one caller does; the others wait for it)
            self._reconnecting = getattr(self, "_reconnecting", None) or asyncio.Lock()
            async with self._reconnecting:
                if self._client is None:
                    await self._connect()
        client = self._client
        try:
            return await client.call_tool(name, arguments)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED and self._client is client:
                self._client = None  # the next call reconnects
                self._stop.set()  # and this session's task leaves it
            raise

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The server tool's `CallToolResult` (awaited from any event loop)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._call(name, arguments), self.loop))

    def close(self, timeout: float = 5.0) -> None:
        """Leave the session (a stdio server's process ends) and stop the thread."""
        async def stop() -> None:
            if self._stop is not None:
                self._stop.set()
            owner = getattr(self, "_owner", None)
            if owner is not None:
                await asyncio.wait([owner], timeout=timeout)
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout + 1)
            except Exception:
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)


_SERVERS: dict[tuple, McpServer] = {}
_LOCK = threading.Lock()


def server(options: McpOptions) -> McpServer:
    """The process's connection to this server (started, and its tools listed, on first use)."""
    key = (os.getpid(), options.url, tuple(options.command or ()), options.cwd,
           tuple(sorted(options.headers_env.items())), tuple(sorted(options.pass_env)))
    with _LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = McpServer(options)
        return _SERVERS[key]


@atexit.register
def close_all() -> None:
    """Close every server this process started (their stdio processes end with the session)."""
    with _LOCK:
        for s in _SERVERS.values():
            s.close(timeout=2.0)
        _SERVERS.clear()


def _errlog() -> Any:
    """Where a stdio server's stderr goes: ours when it is a real file (not a notebook's or pytest's stand-in)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):
            continue
    return open(os.devnull, "w")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _reason(exc.exceptions[0])
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _listed(s: McpServer, name: str) -> Any:
    if name not in s.tools:
        listed = "; ".join(f"{t.name} ({(t.description or '').strip().splitlines()[0] if t.description else '-'})"
                           for t in s.tools.values())
        raise MasgraphError(f"MCP server `{s.label}` has no tool {name!r}; its tools: {listed}")
    return s.tools[name]


def arguments(raw: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The model's input as the tool's arguments: a JSON object, or (for a tool with one parameter) the text as
    that parameter; checked against the JSON schema."""
    import jsonschema

    text = raw.strip()
    props = schema.get("properties") or {}
    try:
        args = json.loads(text) if text.startswith("{") else None
    except json.JSONDecodeError as exc:
        raise ToolError(f"the input is not valid JSON ({exc.msg}); write the arguments as one JSON object") from None
    if args is None:
        if len(props) != 1:
            raise ToolError(f"write the arguments as a JSON object: {signature(schema)}")
        (name, prop), = props.items()
        kind = prop.get("type")
        try:
            args = {name: int(text) if kind == "integer" else float(text) if kind == "number"
                    else text.lower() in ("true", "1", "yes") if kind == "boolean" else text}
        except ValueError:
            raise ToolError(f"{name!r} takes a {kind}, not {text!r}") from None
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(args))
    if error is not None:
        where = "/".join(map(str, error.absolute_path))
        raise ToolError(f"arguments do not match the tool's schema: {(where + ': ') if where else ''}{error.message}")
    return args


def signature(schema: dict[str, Any]) -> str:
    """A tool's arguments in one line for a prompt: `{"a": integer, "b?": string}` (`?`: optional)."""
    required = set(schema.get("required") or ())
    props = schema.get("properties") or {}
    return "{" + ", ".join(f'"{k}{"" if k in required else "?"}": {v.get("type", "any")}'
                           for k, v in props.items()) + "}"


def result_text(result: Any) -> str:
    """A `CallToolResult` as the step's text: its text content (structured content as JSON when it has none)."""
    parts = [getattr(c, "text", None) or f"[{c.type}]" for c in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    return "\n".join(parts)


def _factory(options: McpOptions) -> ToolFn:
    s = server(options)
    tool = _listed(s, options.tool)
    schema = tool.input_schema or {"type": "object"}

    async def call(raw: str) -> str:
        args = arguments(raw, schema)
        try:
            result = await s.call(options.tool, args)
        except (ToolError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the server failed or went away: this step's error, not the run's
            raise ToolError(f"MCP server `{s.label}`: {_reason(exc)}") from None
        text = result_text(result)
        if result.is_error:
            raise ToolError(f"{options.tool} failed: {text}")
        return text
    return call


def _describe(options: McpOptions) -> str:
    tool = _listed(server(options), options.tool)
    return f"{tool.description or tool.name} Input: JSON {signature(tool.input_schema or {})}"


BUILTIN_TOOLS["mcp"] = ToolKind("mcp", "a tool of an MCP server (options: command or url, and tool)", _factory,
                                {"type": "object"}, McpOptions, describe=_describe)
