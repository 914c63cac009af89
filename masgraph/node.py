"""What a node body sees (NodeContext) and returns (NodeOutput); agents are async functions between them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from masgraph.memory.action_log import ActionLog
from masgraph.memory.conversations import ConversationStores
from masgraph.spec import GraphSpec
from masgraph.trace import MemoryOp, ToolCall


@dataclass
class NodeOutput:
    """A node's result: text for downstream nodes, a route label for conditional edges, maybe an answer."""

    text: str = ""
    route: str | None = None
    answer: str | None = None
    tool: ToolCall | None = None
    parse_error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    memory_ops: list[MemoryOp] = field(default_factory=list)
    """A memory manager's operations on the episode's fact store (recorded in the step)."""
    no_result: bool = False
    """Set when `text` is not a usable result although nothing failed (e.g. a tool that printed nothing)."""

    @property
    def has_result(self) -> bool:
        """A usable result: not `no_result`, no parse error, no failed tool call, some text (merges rank it first)."""
        failed_tool = self.tool is not None and self.tool.error is not None
        return not (self.no_result or self.parse_error or failed_tool or not self.text.strip())


Generate = Callable[[list[dict[str, str]]], Awaitable[Any]]  # messages -> backends.base.Completion
ToolFn = Callable[[str], Awaitable[str]]


@dataclass
class NodeContext:
    """Everything one node step may read: query, inputs from predecessors, memory, its LLM and tools."""

    node: str
    spec: GraphSpec
    query: str
    turn: int
    inputs: list[tuple[str, NodeOutput]]
    """(source node, its output) for each edge that fired into this node since it last ran, in arrival order
    (a fan-in node waits until none of its branches is still live)."""
    merged: str
    """The inputs merged by the node's declared rule (or the single input's text)."""
    memory: ActionLog
    generate: Generate
    """Call this node's policy with chat messages; the call is recorded in the step."""
    tools: dict[str, ToolFn]
    """The node's tools by name (already bound to their time limits)."""
    tool_descriptions: dict[str, str] = field(default_factory=dict)
    """Every tool of the graph by name -> the description shown to the model."""
    prompt: str | None = None
    """The prompt template this episode's topology gives the node (a `topology.slots` choice); None: its own."""
    conversation: str | None = None
    """The conversation this episode belongs to (its `meta["conversation"]`), if any."""
    conversations: ConversationStores | None = None
    """The engine's conversation memories (a memory node with `scope: conversation` edits its conversation's)."""
    waiting: Callable[[], AbstractContextManager[object]] = nullcontext
    """`with ctx.waiting(): ...` — time inside is not this step's work (its time limit does not run): for a node
    that waits its turn at something shared (a conversation's memory), as its LLM calls' queue waits are not."""
    unparsed: Callable[[Any, str], None] = lambda completion, reason: None
    """`ctx.unparsed(completion, reason)`: the call that returned `completion` (from `generate`) did not follow the
    node's format; recorded on that call (`LLMCall.parse_error`), so a node making several calls a step has its
    format credited per call. The step's own `NodeOutput.parse_error` is still the node's to set. Any other
    object (not a completion this step's `generate` returned) fails the step with an error saying so."""

    @property
    def node_spec(self) -> Any:
        return self.spec.nodes[self.node]


Agent = Callable[[NodeContext], Awaitable[NodeOutput] | NodeOutput]
"""A node body: preferably `async def`; a plain `def` is run in a worker thread by the scheduler."""
