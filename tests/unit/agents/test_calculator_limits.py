"""Issue 58 #18: the calculator tool reads at most MAX_CHARS (a 10 MB expression cost 9.4 s of CPU before its
error) and never evaluates Python code around a number (`lambda: 1` gave 1)."""

from __future__ import annotations

import time

import pytest

from masgraph.agents.tools.registry import ToolError, build_tools
from masgraph.spec import ToolSpec


@pytest.fixture
def calculator():
    return build_tools({"calc": ToolSpec(kind="calculator")})["calc"]


@pytest.mark.parametrize("code, kind", [("lambda: 1", "Lambda"), ("lambda x: 12 + 7", "Lambda"),
                                        ("(lambda: 1)()", "Lambda"), ("1 if 2 else 3", "IfExp"),
                                        ("(12).real", "Attribute"), ("[1][0]", "Subscript")])
def test_python_code_is_refused_not_evaluated(run, calculator, code, kind):
    with pytest.raises(ToolError, match=f"is Python code \\({kind}\\), not an arithmetic expression"):
        run(calculator(code))
    assert run(calculator("what is 12 + 7")) == "19"  # prose around one expression still reads


def test_a_10_mb_expression_is_refused_at_once(run, calculator):
    start = time.process_time()
    with pytest.raises(ToolError, match=r"expression too long: 10000001 characters \(max 150000\)"):
        run(calculator("1+" * 5_000_000 + "1"))
    assert time.process_time() - start < 0.5  # HEAD: 9.4 s (26 s on a busy machine) before its error
