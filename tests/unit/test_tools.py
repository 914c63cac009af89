"""Tools: the calculator never evaluates code, the python sandbox contains snippets, search finds facts."""

from __future__ import annotations

import asyncio
import socket

import pytest

from masgraph.agents.tools.calculator import calculate
from masgraph.agents.tools.python import run_python
from masgraph.agents.tools.registry import TOOL_KINDS, ToolError, build_tools, register_tool
from masgraph.agents.tools.search import Corpus
from masgraph.spec import ToolSpec


@pytest.mark.parametrize("expr,value", [("12 + 7", 19), ("(3+4)*2 =", 14), ("2^10", 1024), ("7 / 2", 3.5),
                                        ("-9 * -9 - 7", 74), ("1,000 + 5", 1005), ("compute 4 / 4 + 8 now", 9)])
def test_calculator_values(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "().__class__", "x + 1", "2 ** 1000", "1 / 0", ""])
def test_calculator_rejects_non_arithmetic(expr):
    with pytest.raises(ToolError):
        calculate(expr)


def test_python_runs_and_prints(run):
    assert run(run_python("print(sum(i * i for i in range(1, 11)))")) == "385"


def test_python_infinite_loop_is_killed(run):
    with pytest.raises(ToolError, match="exceeded 1.0s"):
        run(run_python("while True: pass", timeout_s=1.0))


def test_python_cannot_write_outside_its_temp_dir(run, tmp_path):
    target = tmp_path / "escaped.txt"
    with pytest.raises(ToolError, match="Read-only file system"):
        run(run_python(f"open({str(target)!r}, 'w').write('x')"))
    assert not target.exists()
    assert run(run_python("open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())")) == "ok"


def test_python_has_no_network(run):
    with socket.socket() as srv:  # a listening port on the host is still unreachable from the sandbox
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        with pytest.raises(ToolError, match="unreachable|refused|Network"):
            run(run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"))


def test_python_memory_limit(run):
    with pytest.raises(ToolError, match="MemoryError|signal"):
        run(run_python("x = bytearray(2 * 1024 ** 3)", memory_mb=256))


def test_search_ranks_the_matching_document():
    corpus = Corpus([{"id": "a", "title": "Kalo Mira", "text": "Kalo Mira lives in Rafeport."},
                     {"id": "b", "title": "Rafeport", "text": "Rafeport is in Sadulvor."}])
    assert corpus.search("Rafeport", k=1)[0]["id"] == "b"
    assert corpus.search("Kalo Mira", k=1)[0]["id"] == "a"
    assert corpus.search("nothing here") == []


def test_search_tool_over_shipped_kb(run):
    tools = build_tools({"search": ToolSpec(kind="search")})
    from masgraph.tasks import load_kb
    person = load_kb()["people"][0]
    out = run(tools["search"](person["name"]))
    assert person["city"] in out.splitlines()[0]


def test_custom_typed_tool(run):
    @register_tool
    def add_days(days: int, start: int = 0) -> int:
        """Add days to a start day."""
        return start + days

    assert TOOL_KINDS["add_days"].schema["required"] == ["days"]
    assert TOOL_KINDS["add_days"].schema["properties"]["days"] == {"type": "integer"}
    tools = build_tools({"d": ToolSpec(kind="add_days")})
    assert run(tools["d"]("3")) == "3"
    assert run(tools["d"]('{"days": 2, "start": 5}')) == "7"
    with pytest.raises(ToolError, match="expected int"):
        run(tools["d"]("three"))


def test_tool_timeout_applies(run):
    @register_tool(name="slow_echo")
    async def slow_echo(text: str) -> str:
        """Sleeps."""
        await asyncio.sleep(5)
        return text

    tools = build_tools({"s": ToolSpec(kind="slow_echo", timeout_s=0.1)})
    with pytest.raises(ToolError, match="timed out"):
        run(tools["s"]("x"))
