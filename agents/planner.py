"""Planner: the next sub-goal and the tool to use, from the query, the tools and the memory."""

from __future__ import annotations

from masgraph.agents.formats import parse_plan
from masgraph.agents.prompting import node_tools, render
from masgraph.agents.registry import builtin_agent
from masgraph.agents.tools.registry import describe
from masgraph.node import NodeContext, NodeOutput


@builtin_agent("planner")
async def planner(ctx: NodeContext) -> NodeOutput:
    tools = node_tools(ctx)
    completion = await ctx.generate(render(ctx, "planner", tools=describe(ctx.tool_descriptions, tools)))
    goal, tool, error = parse_plan(completion.text, tools)
    return NodeOutput(text=f"Sub-goal: {goal}\nTool: {tool or 'none'}", route=tool or "answer",
                      parse_error=error, data={"sub_goal": goal, "tool": tool})
