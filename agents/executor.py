"""Executor: turns the planner's sub-goal into a concrete tool call, runs it and logs it in memory.

With a policy the model writes the tool input; without one the sub-goal itself is the input. A tool
error (bad input, crash, timeout) is recorded in the step and the memory, and the episode goes on; such an
output, or one that printed nothing, is marked as no result so that a fan-in merge ranks real results first."""

from __future__ import annotations

import time

from masgraph.agents.formats import parse_tool_input
from masgraph.agents.prompting import render
from masgraph.agents.registry import builtin_agent
from masgraph.agents.tools.registry import ToolError, describe
from masgraph.memory.action_log import Action
from masgraph.node import NodeContext, NodeOutput
from masgraph.trace import ToolCall

# What the python tool (agents/tools/python.py) returns when the snippet printed nothing: not a result.
NO_OUTPUT = "(no output; print() the result)"


@builtin_agent("executor")
async def executor(ctx: NodeContext) -> NodeOutput:
    plan = next((out.data for _, out in ctx.inputs if "sub_goal" in out.data), {})
    sub_goal = plan.get("sub_goal") or ctx.query
    tool = plan.get("tool") if plan.get("tool") in ctx.tools else next(iter(ctx.tools))
    parse_error = None
    if ctx.node_spec.policy is not None:
        completion = await ctx.generate(render(ctx, "executor", tool=tool, sub_goal=sub_goal,
                                               tool_description=describe(ctx.tool_descriptions, [tool])))
        tool_input, parse_error = parse_tool_input(completion.text, tool)
    else:
        tool_input = sub_goal
    t0 = time.perf_counter()
    output = error = None
    try:
        output = await ctx.tools[tool](tool_input)
    except Exception as exc:  # the tool's failure is data for the planner, not a crash of the run
        error = str(exc) if isinstance(exc, ToolError) else f"{type(exc).__name__}: {exc}"
    call = ToolCall(tool=tool, input=tool_input, output=output, error=error, duration_s=time.perf_counter() - t0)
    ctx.memory.append(Action(ctx.node, sub_goal, tool, tool_input, output, error))
    return NodeOutput(text=output if error is None else f"Error: {error}", route="error" if error else "ok",
                      tool=call, parse_error=parse_error, data={"sub_goal": sub_goal, "tool": tool},
                      no_result=error is None and output.strip() in ("", NO_OUTPUT))
