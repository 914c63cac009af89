"""Generator: the final answer from the query, the memory and any merged inputs."""

from __future__ import annotations

from masgraph.agents.formats import parse_answer
from masgraph.agents.prompting import render
from masgraph.agents.registry import builtin_agent
from masgraph.node import NodeContext, NodeOutput


@builtin_agent("generator")
async def generator(ctx: NodeContext) -> NodeOutput:
    template = "generator_merge" if len(ctx.inputs) > 1 else "generator"
    completion = await ctx.generate(render(ctx, template))
    answer, error = parse_answer(completion.text)
    return NodeOutput(text=completion.text, answer=answer, parse_error=error, route="answer")
