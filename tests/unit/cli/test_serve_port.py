"""Issue 30, finding 9: `masgraph serve` on a port in use loaded the model (18 s), printed 'serving ... at', then
uvicorn logged [Errno 98] and the command exited 3 with no `error:` line, leaving an empty runs/*-serve-* dir."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PLUGIN = """
import os, socket
from masgraph.agents import register_agent
from masgraph.node import NodeOutput

if os.environ.get("TAKE_PORT"):  # another process takes the port while the graph loads (after serve's check)
    TAKEN = socket.socket()
    TAKEN.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    TAKEN.bind(("127.0.0.1", int(os.environ["TAKE_PORT"])))
    TAKEN.listen()

@register_agent("echo")
async def echo(ctx):
    return NodeOutput(text=ctx.query, answer=ctx.query)
"""

GRAPH = ("name: echo\nplugins: [echo_agent.py]\nnodes:\n  answer: {role: custom, agent: echo}\n"
         "entry: answer\nexit: answer\n")


def _serve(tmp_path: Path, port: int, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "echo_agent.py").write_text(PLUGIN)
    (tmp_path / "g.yaml").write_text(GRAPH)
    return subprocess.run([sys.executable, "-m", "masgraph.cli", "serve", "g.yaml", "--port", str(port),
                           "--runs-dir", "runs"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _runs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "runs").iterdir()) if (tmp_path / "runs").is_dir() else []


@pytest.mark.slow
def test_serve_on_a_port_in_use_is_one_error_line_before_anything_loads(tmp_path, free_port):
    port = free_port()
    with _listening(port):
        t0 = time.perf_counter()
        p = _serve(tmp_path, port)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.splitlines() == [p.stderr.splitlines()[0]] and p.stderr.startswith(
        f"error: cannot serve at 127.0.0.1:{port}: Address already in use (another process is listening there); "
        "pick another --port"), p.stderr  # nothing loaded, nothing served
    assert _runs(tmp_path) == [] and time.perf_counter() - t0 < 60


@pytest.mark.slow
def test_a_port_taken_while_the_graph_loads_is_an_error_line_and_leaves_no_run_dir(tmp_path, free_port):
    port = free_port()
    p = _serve(tmp_path, port, TAKE_PORT=str(port))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.splitlines()[-1].startswith(f"error: the server could not start at http://127.0.0.1:{port} "
                                                "(uvicorn's message above; pick another --port"), p.stderr
    assert "Errno 98" in p.stderr and "Traceback" not in p.stderr
    assert _runs(tmp_path) == []  # the trace dir of a server that never started goes
