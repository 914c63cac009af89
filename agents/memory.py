"""Memory node. `mode: summary` curates the action log: keeps the last `memory.max_actions` actions and, with a policy,
replaces the dropped ones by a model-written summary (without one, by a count). The fact-store modes read the query
as a stream of facts ending with a question and keep an episode's fact store: `manager` asks its policy for one
operation per fact (Memory-R1), `append` and `last_k` are the rule-based baselines (masgraph/memory/store.py)."""

from __future__ import annotations

from masgraph.agents.prompting import render
from masgraph.agents.registry import builtin_agent
from masgraph.memory.action_log import ActionLog
from masgraph.memory.store import FactStore, parse_op
from masgraph.node import NodeContext, NodeOutput
from masgraph.trace import MemoryOp


@builtin_agent("memory")
async def memory(ctx: NodeContext) -> NodeOutput:
    if ctx.node_spec.mode != "summary":
        return await fact_store(ctx)
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


def split_stream(query: str) -> tuple[list[str], str]:
    """(facts, question): every non-empty line of the query but the last is a fact; the last is the question (a
    leading `Question:` dropped)."""
    lines = [line.strip() for line in query.splitlines() if line.strip()]
    if not lines:
        return [], ""
    question = lines[-1]
    return lines[:-1], question[len("question:"):].strip() if question.lower().startswith("question:") else question


async def fact_store(ctx: NodeContext) -> NodeOutput:
    """Apply the query's facts to the node's fact store, one operation each; the output (what later nodes read as
    their input) is the store and the question. The store is the episode's own, or with `scope: conversation` the
    one its conversation's earlier episodes left (edited under the conversation's lock, kept only if this step
    finishes). An output with no operation adds the fact and counts as a parse failure of the step; an operation on
    a missing entry adds it too (recorded on the operation, not a format failure)."""
    spec = ctx.node_spec
    facts, question = split_stream(ctx.query)
    if spec.scope == "conversation" and ctx.conversation is not None and ctx.conversations is not None:
        if ctx.turn > 1:  # a loop back here: the episode's facts are in already; read the store
            store, ops, unparsed = ctx.conversations.peek(ctx.node, ctx.conversation), [], []
        else:
            async with ctx.conversations.open(ctx.node, ctx.conversation, ctx.waiting()) as store:
                ops, unparsed = await _edit(ctx, store, facts)
    else:
        store = FactStore()
        ops, unparsed = await _edit(ctx, store, facts)
    error = f"{len(unparsed)} of {len(ops)} outputs had no operation; first: {unparsed[0]}" if unparsed else None
    shown = store.recall(question, spec.recall) if spec.recall else store
    return NodeOutput(text=f"Memory:\n{shown.render()}\nQuestion: {question}", memory_ops=ops, parse_error=error)


async def _edit(ctx: NodeContext, store: FactStore, facts: list[str]) -> tuple[list[MemoryOp], list[str]]:
    """One operation per fact, applied to `store` in order: the manager's (its policy), or the rule's; returns the
    applied operations and the reasons of outputs that had none."""
    spec, ops, unparsed = ctx.node_spec, [], []
    for fact in facts:
        if spec.mode == "manager":
            completion = await ctx.generate(render(ctx, "memory_manager", memory=store.render(), fact=fact))
            try:
                op = parse_op(completion.text, fact)
            except ValueError as exc:
                op = MemoryOp(fact=fact, op="ADD", text=fact, output=completion.text, error=str(exc))
                unparsed.append(str(exc))
                ctx.unparsed(completion, str(exc))
        else:
            op = MemoryOp(fact=fact, op="ADD", text=fact)
        ops.append(store.apply(op))
        if spec.mode == "last_k":
            store.trim(spec.keep)
    return ops, unparsed
