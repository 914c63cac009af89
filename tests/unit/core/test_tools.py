"""Tools: the calculator never evaluates code, the python sandbox contains snippets, search finds facts."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import socket

import pytest
from hypothesis import given, settings, strategies

from masgraph.agents.tools.calculator import calculate
from masgraph.agents.tools.python import run_python
from masgraph.agents.tools.registry import ToolError, build_tools, register_tool
from masgraph.agents.tools.search import Corpus
from masgraph.errors import MasgraphError
from masgraph.registry import default_registry
from masgraph.spec import ToolSpec


@pytest.mark.parametrize("expr,value", [("12 + 7", 19), ("(3+4)*2 =", 14), ("2^10", 1024), ("7 / 2", 3.5),
                                        ("-9 * -9 - 7", 74), ("1,000 + 5", 1005), ("compute 4 / 4 + 8 now", 9)])
def test_calculator_values(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "().__class__", "x + 1", "2 ** 1000", "1 / 0", ""])
def test_calculator_rejects_non_arithmetic(expr):
    with pytest.raises(ToolError):
        calculate(expr)


@pytest.mark.parametrize("expr", ["compute 12 + 7 please", "12 + 7 =", "What is 12 + 7?", "Calculate: 12+7", "١٢ + ٧"])
def test_calculator_tolerates_prose_around_one_expression(expr):
    assert calculate(expr) == 19


@pytest.mark.parametrize("expr,why", [("1000!", "unexpected '!'"), ("2 + 3; import os", "unexpected ';'"),
                                      ("3 apples + 4 pears", "several expressions"),
                                      ("what is x + 1", "lacks an operand"), ("compute(3+4)", "'compute'"),
                                      ("12 + 7 +", "invalid syntax"), ("1e308*10", "out of range"),
                                      ("1e300 ** 2", "out of range"), ("1e999", "out of range"),
                                      ("(-8) ** 0.5", "complex"),
                                      ("9" * 5000, "number too large: more than 4300 digits"),
                                      ("(" * 300 + "1" + ")" * 300, "nested"), ("-" * 100_000 + "1", "nested")])
def test_calculator_rejects_glued_or_several_expressions_with_a_reason(expr, why):
    with pytest.raises(ToolError, match=re.escape(why)):
        calculate(expr)


@settings(max_examples=300, deadline=None)
@given(strategies.text() | strategies.from_regex(r"[-+*/%().0-9e ^,=!;x]{0,40}", fullmatch=True))
def test_calculator_gives_a_number_or_a_tool_error(text):
    try:
        value = calculate(text)
    except ToolError:
        return
    assert isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.parametrize("expr", ["9" * 4000, "-" + "9" * 400, "9" * 400 + " / 7", "what is " + "9" * 4000 + " + 1"])
def test_calculator_says_a_huge_number_is_too_large(run, expr):
    """HEAD: OverflowError (int too large to convert to float) from the range check, not a ToolError."""
    calculator = build_tools({"calc": ToolSpec(kind="calculator")})["calc"]
    with pytest.raises(ToolError, match=r"^number too large: \d+ digits, out of range \(max 1e\+30\)$"):
        run(calculator(expr))


def test_tool_error_is_a_user_facing_error():
    assert issubclass(ToolError, MasgraphError)


def test_python_runs_and_prints(run):
    assert run(run_python("print(sum(i * i for i in range(1, 11)))")) == "385"


@pytest.mark.parametrize("code,shown", [("-9 * -9 - 7", "74"), ("print('a')\nx = 2\nx ** 10", "a\n1024"),
                                        ("import math\nmath.sqrt(16)", "4.0"), ("'hi'", "'hi'"),
                                        ("for i in range(2):\n    i", "(no output; print() the result)"),
                                        ("None", "(no output; print() the result)")])
@pytest.mark.slow
def test_python_shows_the_last_expression_like_a_notebook_cell(run, code, shown):
    assert run(run_python(code)) == shown


def test_python_traceback_points_at_the_snippet(run):
    with pytest.raises(ToolError, match=r'(?s)File "snippet.py", line 2.*ZeroDivisionError') as info:
        run(run_python("x = 1\nx / 0"))
    assert "<module>" in str(info.value) and "main()" not in str(info.value)


@pytest.mark.slow
def test_python_infinite_loop_is_killed(run):
    with pytest.raises(ToolError, match="exceeded 1.0s"):
        run(run_python("while True: pass", timeout_s=1.0))


def test_python_cannot_write_outside_its_temp_dir(run, tmp_path):
    target = tmp_path / "escaped.txt"
    with pytest.raises(ToolError, match="Read-only file system|No such file"):
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

    assert default_registry().tools["add_days"].schema["required"] == ["days"]
    assert default_registry().tools["add_days"].schema["properties"]["days"] == {"type": "integer"}
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


SEARCH_GRAPH = ("name: s\npolicies:\n  main: {backend: scripted}\ntools:\n"
                "  search: {kind: search, options: {corpus: %s}}\n"
                "nodes:\n  answer: {role: generator, policy: main}\nentry: answer\nexit: answer\n")


def _corpus_problem(corpus: str) -> str:
    """The located problem compiling a graph whose search tool names `corpus` ('' when it compiles)."""
    from masgraph.errors import SpecError
    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec

    try:
        compile_spec(parse_spec(SEARCH_GRAPH % json.dumps(corpus), "g.yaml"), "g.yaml", check_models=False)
    except SpecError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("content, why", [
    (None, "cannot read search corpus {path}: No such file or directory"),
    ("dir", "search corpus {path} is not a regular file"),
    ("fifo", "search corpus {path} is not a regular file"),  # not opened: it would block
    (b'{"id": "a", "text": "ok"}\n{"id": "b", "text": \n', "search corpus {path} line 2 is not JSON"),
    (b'{"id": "a", "text": "ok"}\n\n["a list"]\n', "search corpus {path} line 3 is not an object with a string"),
    (b'{"id": "a", "text": "caf\xe9"}\n', "search corpus {path} is not UTF-8 text"),
])
def test_a_bad_search_corpus_is_a_located_spec_error_at_compile(tmp_path, content, why):
    """HEAD: the graph compiled, and every search call of the run failed (or raised KeyError) at run time."""
    path = tmp_path / "corpus.jsonl"
    if content == "dir":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content)
    problem = _corpus_problem(str(path))
    assert problem.startswith("g.yaml:5:36: tools.search.options.corpus: " + why.format(path=path)), problem
    assert "drop `corpus:` for the shipped knowledge base" in problem


def test_a_good_search_corpus_compiles_and_is_searched(tmp_path, run):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"id": "a", "title": "Kalo Mira", "text": "Kalo Mira lives in Rafeport."}\n')
    assert _corpus_problem(str(path)) == ""
    tool = build_tools({"search": ToolSpec(kind="search", options={"corpus": str(path)})})["search"]
    assert run(tool("Kalo Mira")) == "[Kalo Mira] Kalo Mira lives in Rafeport."


def test_a_corpus_gone_after_compile_is_an_error_when_tools_are_built(tmp_path):
    with pytest.raises(MasgraphError, match="tools.search.options: corpus: cannot read search corpus"):
        build_tools({"search": ToolSpec(kind="search", options={"corpus": str(tmp_path / "gone.jsonl")})})
