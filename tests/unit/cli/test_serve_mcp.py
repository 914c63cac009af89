"""`masgraph serve BUNDLE --mcp`: the agent as an MCP tool `ask(question) -> {answer, trace_id}`, called by the `mcp`
SDK's client over stdio (the client starts the command) and over streamable HTTP (with a bearer key); the trace id
names the episode in the server's trace store. A tiny random model answers (the words do not matter here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from masgraph.rundir.read import read_traces

GRAPH = """\
name: asker
policies:
  main: {{model: "{model}", device: cpu, sampling: {{max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
"""


@pytest.fixture()
def graph_file(tiny, tmp_path):
    path = tmp_path / "asker.yaml"
    path.write_text(GRAPH.format(model=tiny))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


async def _ask(client) -> dict:
    """The tool's listing, one answered call and one failed call (an empty question), as seen by the client."""
    [tool] = (await client.list_tools()).tools
    assert tool.name == "ask" and tool.input_schema["required"] == ["question"]
    ok = await client.call_tool("ask", {"question": "What is 2 + 3?"})
    assert not ok.is_error, ok.content
    bad = await client.call_tool("ask", {"question": "  "})
    assert bad.is_error and "the question is empty" in bad.content[0].text
    return ok.structured_content


@pytest.mark.slow  # starts `masgraph serve` (a model load) in a subprocess
def test_stdio_mcp_client_asks_the_served_bundle(graph_file, tmp_path, run):
    from mcp import Client, StdioServerParameters

    from masgraph.serve.bundle import export_bundle

    bundle = export_bundle(graph_file, tmp_path / "agent")  # `masgraph export GRAPH --out agent/`
    runs = tmp_path / "runs"
    params = StdioServerParameters(command=sys.executable, args=["-m", "masgraph.cli", "serve", str(bundle),
                                                                 "--mcp", "--runs-dir", str(runs)], env=_env())

    async def session():
        async with Client(params) as client:
            return await _ask(client)

    reply = run(session())
    assert isinstance(reply["answer"], str) and reply["trace_id"]
    [store] = runs.iterdir()
    assert reply["trace_id"] in {t.episode_id for t in read_traces(store)}  # the id names a stored episode


@pytest.mark.slow  # starts `masgraph serve` (a model load) in a subprocess
def test_http_mcp_client_asks_with_the_bearer_key(graph_file, tmp_path, free_port, run):
    import httpx2
    from mcp import Client, MCPError
    from mcp.client.streamable_http import streamable_http_client

    port, log = free_port(), open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", str(graph_file), "--mcp", "http",
                             "--port", str(port), "--api-key", "k3y", "--no-store"], env=_env(), stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.3)

        async def session(key: str):
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"})
            async with Client(streamable_http_client(url, http_client=http)) as client:
                return await _ask(client)

        reply = run(session("k3y"))
        assert isinstance(reply["answer"], str) and reply["trace_id"]
        with pytest.raises(BaseExceptionGroup) as refused:  # the SDK's client cannot start a session
            run(session("wrong"))
        assert refused.group_contains(MCPError)
        wrong = urllib.request.Request(url, data=b"{}", method="POST", headers={"Authorization": "Bearer wrong"})
        with pytest.raises(urllib.error.HTTPError) as status:
            urllib.request.urlopen(wrong, timeout=10)
        assert status.value.code == 401
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
