"""The output formats' lenient parsers: the canonical form, accepted variants, and documented fallbacks."""

from __future__ import annotations

import pytest

from masgraph.agents.formats import parse_answer, parse_plan, parse_tool_input, parse_verdict

TOOLS = ["calculator", "search", "python"]


@pytest.mark.parametrize("text,tool,ok", [
    ("Sub-goal: 2 + 3\nTool: calculator", "calculator", True),
    ("**Sub-goal:** find X\n**Tool Name:** Search", "search", True),
    ("Sub-goal: done\nTool: none", None, True),
    ("I will use the python tool", "python", False),
    ("no idea", "calculator", False),
])
def test_parse_plan(text, tool, ok):
    goal, got, err = parse_plan(text, TOOLS)
    assert got == tool and (err is None) == ok and goal


@pytest.mark.parametrize("text,tool,value", [
    ("Input: 12 + 7", "calculator", "12 + 7"),
    ('{"tool": "search", "input": "Kalo Mira"}', "search", "Kalo Mira"),
    ("calculator(3 * 4)", "calculator", "3 * 4"),
    ("```python\nprint(1)\n```", "python", "print(1)"),
    ("Expression = 5*5", "calculator", "5*5"),
])
def test_parse_tool_input(text, tool, value):
    assert parse_tool_input(text, tool) == (value, None)


def test_parse_tool_input_fallback():
    value, err = parse_tool_input("\n12 * 3\nthat is it", "calculator")
    assert value == "12 * 3" and err


@pytest.mark.parametrize("text,verdict,ok", [
    ("Conclusion: STOP", "stop", True), ("conclusion: continue", "continue", True),
    ("Verdict - the memory is sufficient, we are done", "stop", False),
    ("We need more information.", "continue", False), ("???", "continue", False),
])
def test_parse_verdict(text, verdict, ok):
    got, err = parse_verdict(text)
    assert got == verdict and (err is None) == ok


@pytest.mark.parametrize("text,answer,ok", [
    ("Answer: 19", "19", True), ("<answer>Paris</answer>", "Paris", True), ("so \\boxed{42}", "42", True),
    ("Final answer: 7", "7", True), ("Thus the answer is 12.", "12", True), ("thinking...\n19", "19", False),
])
def test_parse_answer(text, answer, ok):
    got, err = parse_answer(text)
    assert got == answer and (err is None) == ok
