"""Tool kind `mcp`: a graph whose executors call the tools of an MCP server written here with the SDK's MCPServer
(mcp 2's name for FastMCP), over stdio and over streamable HTTP. A tool that raises, one that hangs past its
`timeout_s` and a server that dies each fail only their step; the trace holds every call."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from masgraph.agents.tools.mcp_tool import arguments, signature
from masgraph.agents.tools.registry import ToolError
from masgraph.backends.scripted import ScriptedBackend
from masgraph.errors import MasgraphError
from masgraph.graph import GraphBuilder
from masgraph.runtime.engine import Engine

SERVER = '''
import asyncio, os, sys
from mcp.server.mcpserver import Context, MCPServer

mcp = MCPServer("test-tools", log_level="CRITICAL")

@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@mcp.tool()
def boom(text: str) -> str:
    """Always fails."""
    raise ValueError("boom: " + text)

@mcp.tool()
async def slow(seconds: float) -> str:
    """Sleeps, then answers."""
    await asyncio.sleep(seconds)
    return "awake"

@mcp.tool()
def die() -> str:
    """Ends the server process."""
    os._exit(3)

@mcp.tool()
def token() -> str:
    """The MCP_TEST_TOKEN this server was given."""
    return os.environ.get("MCP_TEST_TOKEN", "unset")

@mcp.tool()
def whoami(ctx: Context) -> str:
    """The Authorization header this call came with."""
    request = ctx.request_context.request  # the HTTP request (None over stdio)
    return request.headers.get("authorization", "none") if request is not None else "stdio"

if __name__ == "__main__":
    if len(sys.argv) > 1:
        mcp.run("streamable-http", port=int(sys.argv[1]))
    else:
        mcp.run()
'''

INPUTS = {"add": 'Input: {"a": 2, "b": 3}', "boom": 'Input: {"text": "x"}', "slow": "Input: 30", "die": "Input: {}",
          "whoami": "Input: {}", "token": "Input: {}"}


def reply(request) -> str:
    """The executor's input for the tool its prompt names (`Tool: NAME.`)."""
    text = request.messages[-1]["content"]
    return next(v for k, v in INPUTS.items() if f"Tool: {k}." in text)


def graph(server: dict, nodes: list[tuple[str, str]]):
    """Executors in a row, node i calling server tool `nodes[i][1]` (each through a graph tool of its own)."""
    g = GraphBuilder("mcp").add_policy("p", backend="scripted")
    for name, tool in nodes:
        g.add_tool(tool, "mcp", timeout_s=3 if tool == "slow" else 20, options={**server, "tool": tool})
        g.add_node(name, role="executor", policy="p", tools=[tool])
    for (a, _), (b, _) in zip(nodes, nodes[1:]):
        g.add_edge(a, b)
    return g.set(exit=nodes[-1][0]).compile()


def episode(g, run):
    backend = ScriptedBackend(default=reply)
    trace = run(Engine(g, backends={"scripted": backend}).episode("What is 2 + 3?"))
    return trace, backend


def calls(trace) -> dict[str, tuple]:
    return {s.node: (s.tool.input, s.tool.output, s.tool.error) for s in trace.steps}


@pytest.fixture(scope="module")
def server_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(SERVER)
    return path


@pytest.mark.slow  # starts an MCP server process (stdio)
def test_stdio_server_tools_run_fail_time_out_and_die_only_in_their_steps(server_file, run, monkeypatch):
    nodes = [("s1", "add"), ("s2", "boom"), ("s3", "slow"), ("s4", "die"), ("s5", "add"), ("s6", "token")]
    monkeypatch.setenv("MCP_TEST_TOKEN", "t0ken")
    g = graph({"command": [sys.executable, str(server_file)], "pass_env": ["MCP_TEST_TOKEN"]}, nodes)
    trace, backend = episode(g, run)
    assert trace.status == "ok" and [s.node for s in trace.steps] == [n for n, _ in nodes]
    got = calls(trace)
    assert got["s1"] == ('{"a": 2, "b": 3}', "5", None)
    assert got["s2"][2] == "boom failed: Error executing tool boom"
    assert got["s3"][:2] == ("30", None) and "slow timed out after 3.0s" in got["s3"][2]
    assert got["s4"][2].startswith("MCP server `") and "Connection closed" in got["s4"][2]
    assert got["s5"] == ('{"a": 2, "b": 3}', "5", None)  # the dead server was started again
    assert got["s6"][1:] == ("t0ken", None)  # pass_env reached the server
    assert all(s.tool.duration_s > 0 for s in trace.steps)
    first_prompt = backend.requests[0].messages[0]["content"]  # the server's description and arguments
    assert 'add: Add two integers. Input: JSON {"a": integer, "b": integer}' in first_prompt


def _serve_http(server_file, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(server_file), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None, "the MCP server exited"
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the MCP server did not listen")


@pytest.mark.slow  # starts an MCP server process (streamable HTTP)
def test_http_server_tools_with_headers_from_the_environment(server_file, free_port, run, monkeypatch):
    port = free_port()
    proc = _serve_http(server_file, port)
    try:
        monkeypatch.setenv("MCP_TEST_AUTH", "Bearer s3cret")
        server = {"url": f"http://127.0.0.1:{port}/mcp", "headers_env": {"Authorization": "MCP_TEST_AUTH"}}
        trace, _ = episode(graph(server, [("s1", "add"), ("s2", "boom"), ("s3", "slow"), ("s4", "whoami")]), run)
        got = calls(trace)
        assert trace.status == "ok" and got["s1"][1:] == ("5", None)
        assert got["s2"][2] == "boom failed: Error executing tool boom"
        assert "slow timed out after 3.0s" in got["s3"][2]
        assert got["s4"][1:] == ("Bearer s3cret", None)  # the header came from the environment
        assert "s3cret" not in json.dumps(graph(server, [("s1", "add")]).spec.model_dump())  # not in the graph
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_does_not_start_is_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "nothing-here")
    g = graph({"command": [sys.executable, missing], "connect_timeout_s": 20}, [("s1", "add")])
    with pytest.raises(MasgraphError, match="MCP server `.*nothing-here` did not start"):
        Engine(g, backends={"scripted": ScriptedBackend(default="x")})


def test_options_name_one_server_and_headers_come_from_set_variables(monkeypatch):
    with pytest.raises(Exception, match="one of `command"):
        GraphBuilder("x").add_policy("p", backend="scripted").add_tool("t", "mcp", options={"tool": "a"}) \
            .add_node("n", role="executor", policy="p", tools=["t"]).compile()
    monkeypatch.delenv("MCP_UNSET_TOKEN", raising=False)
    g = graph({"url": "http://127.0.0.1:9/mcp", "headers_env": {"Authorization": "MCP_UNSET_TOKEN"}}, [("s1", "add")])
    with pytest.raises(MasgraphError, match="environment variable.s. MCP_UNSET_TOKEN not set"):
        Engine(g, backends={"scripted": ScriptedBackend(default="x")})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}


def test_arguments_are_checked_against_the_schema_before_the_call():
    assert arguments('{"a": 1, "b": 2}', SCHEMA) == {"a": 1, "b": 2}
    assert arguments("7", {"type": "object", "properties": {"n": {"type": "integer"}}}) == {"n": 7}
    with pytest.raises(ToolError, match="a: 'x' is not of type 'integer'"):
        arguments('{"a": "x"}', SCHEMA)
    with pytest.raises(ToolError, match="'a' is a required property"):
        arguments('{"b": 1}', SCHEMA)
    with pytest.raises(ToolError, match='write the arguments as a JSON object: {"a": integer, "b\\?": integer}'):
        arguments("1 2", SCHEMA)
    assert signature(SCHEMA) == '{"a": integer, "b?": integer}'


@pytest.mark.slow  # starts an MCP server process (stdio)
def test_validate_check_tools_lists_what_the_model_sees_and_the_servers_tools(server_file, tmp_path, capsys):
    from masgraph.cli import main

    path = tmp_path / "g.yaml"
    command = json.dumps([sys.executable, str(server_file)])
    path.write_text(f"name: v\npolicies:\n  p: {{backend: scripted}}\ntools:\n"
                    f"  add: {{kind: mcp, options: {{command: {command}, tool: add}}}}\n"
                    f"  nope: {{kind: mcp, options: {{command: {command}, tool: nope}}}}\n"
                    "nodes:\n  a: {role: executor, policy: p, tools: [add, nope]}\nentry: a\nexit: a\n")
    assert main(["validate", str(path), "--check-tools"]) == 1
    out, err = capsys.readouterr()
    assert 'tools.add (mcp): Add two integers. Input: JSON {"a": integer, "b": integer}' in out, err
    assert "tools.nope: MCP server" in err and "has no tool 'nope'; its tools: add (Add two integers.); boom" in err
