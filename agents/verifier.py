"""Verifier: reads the memory and decides `stop` (it answers the query) or `continue`."""

from __future__ import annotations

from masgraph.agents.formats import parse_verdict
from masgraph.agents.prompting import render
from masgraph.agents.registry import builtin_agent
from masgraph.node import NodeContext, NodeOutput


@builtin_agent("verifier")
async def verifier(ctx: NodeContext) -> NodeOutput:
    completion = await ctx.generate(render(ctx, "verifier"))
    verdict, error = parse_verdict(completion.text)
    return NodeOutput(text=completion.text, route=verdict, parse_error=error)
