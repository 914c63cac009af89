"""Memory node: curates the action log — keeps the last `memory.max_actions` actions and, with a policy,
replaces the dropped ones by a model-written summary (without one, by a count)."""

from __future__ import annotations

from masgraph.agents.prompting import render
from masgraph.agents.registry import builtin_agent
from masgraph.memory.action_log import ActionLog
from masgraph.node import NodeContext, NodeOutput


@builtin_agent("memory")
async def memory(ctx: NodeContext) -> NodeOutput:
    log, keep = ctx.memory, ctx.spec.memory.max_actions
    dropped = log.actions[:-keep] if len(log.actions) > keep else []
    summary = None
    if dropped:
        if ctx.node_spec.policy is not None:
            old = ActionLog(max_actions=len(dropped), max_result_chars=log.max_result_chars, actions=dropped)
            completion = await ctx.generate(render(ctx, "memory", memory=old.render()))
            log.shown |= old.shown  # the summary read them
            summary = completion.text.strip()
        else:
            summary = f"{len(dropped)} earlier step(s) compacted"
        log.compact(keep, summary)
    return NodeOutput(text=ctx.merged or log.render(), data=next((o.data for _, o in ctx.inputs), {}))
