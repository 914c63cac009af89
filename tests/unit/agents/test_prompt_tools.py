"""Issue 30 #5: a node's prompt names only the tools the node has, and a plan naming another tool says so.

The planner's and executor's few-shot examples showed `Tool: search` in graphs without a search tool, and the
model copied it; the parse note then claimed no tool was named."""

from __future__ import annotations

import asyncio
import hashlib
import json
from types import SimpleNamespace

import pytest

from masgraph.agents.executor import executor
from masgraph.agents.formats import parse_plan
from masgraph.agents.planner import planner
from masgraph.agents.prompting import render
from masgraph.memory.action_log import ActionLog
from masgraph.node import NodeContext, NodeOutput

DESCRIPTIONS = {"calculator": "evaluates arithmetic", "search": "looks up a fact", "python": "runs a Python snippet"}

# sha256 of the rendered messages (json, sorted keys) for nodes holding every tool their examples use, as
# rendered before the fix: graphs/agentflow.yaml and the other shipped graphs' recorded results stay valid.
TODAY = {
    ("planner", ("calculator", "search", "python")):
        "79297ed7b6e3ef6ea9e3485b95927df323fb40e1a45e1ebd431258e26b20dfd9",
    ("planner", ("calculator", "search")):
        "79297ed7b6e3ef6ea9e3485b95927df323fb40e1a45e1ebd431258e26b20dfd9",
    ("executor", ("calculator", "search", "python")):
        "e13c6b2524ea7e81a73cf139fa1467f51b4f8997f1e73d55e35dd50e9e869aad",
    ("executor", ("calculator", "search")):
        "e13c6b2524ea7e81a73cf139fa1467f51b4f8997f1e73d55e35dd50e9e869aad",
    ("verifier", ("calculator", "search", "python")):
        "e0d7d9d7d92f31fa7b9c2e1d8ad94dd8c1be3a3b1d497c5910664a7921f85a37",
    ("generator", ("calculator", "search", "python")):
        "6f1cb63f56044d9c9a2752e0f9af2a10229bc99db03f339855f12776ea5aa60d",
}


def _ctx(role: str, tools: list[str], replies: list[str] | None = None, inputs=()) -> NodeContext:
    """A one-node context whose node has `tools` (the graph has the same ones) and a scripted policy."""
    prompts: list[list[dict[str, str]]] = []
    replies = list(replies or ["Sub-goal: x\nTool: none"])

    async def generate(messages):
        prompts.append(messages)
        return SimpleNamespace(text=replies.pop(0))

    async def run_tool(text: str) -> str:
        return f"ran {text}"

    node = SimpleNamespace(tools=list(tools), prompt=None, policy="p")
    spec = SimpleNamespace(nodes={role: node}, tools={t: {} for t in tools})
    ctx = NodeContext(node=role, spec=spec, query="What is 6 * 7?", turn=1, inputs=list(inputs), merged="",
                      memory=ActionLog(), generate=generate, tools={t: run_tool for t in tools},
                      tool_descriptions={t: DESCRIPTIONS[t] for t in tools})
    ctx.prompts = prompts  # type: ignore[attr-defined]
    return ctx


def _digest(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def _text(messages: list[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages).lower()


def test_calculator_only_planner_prompt_never_mentions_search():
    ctx = _ctx("planner", ["calculator"])
    asyncio.run(planner(ctx))
    [messages] = ctx.prompts
    text = _text(messages)
    assert "search" not in text and "kalo mira" not in text
    assert "tool: calculator" in text  # the calculator example is still shown
    assert "- calculator: evaluates arithmetic" in messages[0]["content"]


def test_calculator_only_executor_prompt_never_mentions_search():
    plan = NodeOutput(text="", data={"sub_goal": "6 * 7", "tool": "calculator"})
    ctx = _ctx("executor", ["calculator"], ["Input: 6 * 7"], inputs=[("planner", plan)])
    out = asyncio.run(executor(ctx))
    assert out.tool.input == "6 * 7" and out.parse_error is None
    text = _text(ctx.prompts[0])
    assert "search" not in text and "tool: calculator. sub-goal: 17 * 23 + 5" in text


@pytest.mark.parametrize("role", ["verifier", "generator"])
def test_calculator_only_graph_memory_examples_never_mention_search(role):
    text = _text(render(_ctx(role, ["calculator"]), role))
    assert "search" not in text and "tool: calculator" in text


def test_search_only_executor_keeps_just_the_search_example():
    text = _text(render(_ctx("executor", ["search"]), "executor", tool="search", sub_goal="x", tool_description=""))
    assert "tool: search. sub-goal: find where kalo mira lives" in text and "calculator" not in text


@pytest.mark.parametrize("role", ["planner", "executor"])
def test_python_only_node_gets_a_python_example_instead_of_none(role):
    values = {"tools": "- python"} if role == "planner" else {"tool": "python", "sub_goal": "x", "tool_description": ""}
    messages = render(_ctx(role, ["python"]), role, **values)
    text = _text(messages)
    assert "search" not in text and "calculator" not in text
    # the executor also sees code that counts letters (len), which a calculator cannot do (mixed_skills' letters)
    examples = 2 if role == "executor" else 1
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * examples + ["user"]
    assert "tool: python" in text  # the python tool prints a trailing expression's value, as a notebook does
    assert ('input: len("rafeport")' in text) == (role == "executor")


@pytest.mark.parametrize("role,tools", list(TODAY))
def test_nodes_with_every_example_tool_render_byte_identical_to_before(role, tools):
    values = {"planner": {"tools": "- calculator: a\n- search: b"},
              "executor": {"tool": "search", "sub_goal": "find X", "tool_description": "search: b"}}.get(role, {})
    assert _digest(render(_ctx(role, list(tools)), role, **values)) == TODAY[(role, tools)]


def test_plan_naming_an_undeclared_tool_says_which_and_what_exists():
    goal, tool, err = parse_plan("Sub-goal: Kalo Mira\nTool: search", ["calculator"])
    assert tool == "calculator" and err == "named 'search', which this node does not have (tools: calculator); " \
                                          "used calculator"
    goal, tool, err = parse_plan("Sub-goal: add with the python tool\nTool: search", ["calculator", "python"])
    assert tool == "python" and "named 'search'" in err and "(tools: calculator, python)" in err


def test_plan_naming_no_tool_keeps_its_note():
    assert parse_plan("hmm, I am not sure", ["calculator"])[2] == "no tool named; fell back to the first tool"


def test_planner_step_records_the_undeclared_tool_note():
    ctx = _ctx("planner", ["calculator"], ["Sub-goal: Kalo Mira\nTool: search"])
    out = asyncio.run(planner(ctx))
    assert out.route == "calculator"
    assert "named 'search'" in out.parse_error and "(tools: calculator)" in out.parse_error


def test_fallback_example_only_when_no_other_tool_example_fits():
    text = _text(render(_ctx("planner", ["calculator", "python"]), "planner", tools=""))
    assert "tool: calculator" in text and "tool: python" not in text and "search" not in text
