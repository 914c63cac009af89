"""GraphSpec: the one pydantic model behind YAML graphs, the Python builder and the editor schema."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from masgraph.device import DEVICE_PATTERN
from masgraph.errors import one_of, shorten

SCHEMA_VERSION = 1


class MovedKeysWarning(FutureWarning):
    """Keys of a graph file that moved (same meaning, new place) or that nothing reads: the file still loads, and
    the warning names each key's new place (the loader adds its file:line)."""

    def __init__(self, moves: list[tuple[str, str]], dropped: str = "", where: dict[str, str] | None = None):
        self.moves, self.dropped, self.where = moves, dropped, where or {}
        """(old key path, new key path; "" for a key nothing reads, `dropped` saying why), and old path -> file:line."""
        super().__init__("\n  ".join(
            ["keys of the graph file moved (it loads as before; write the new keys):"]
            + [f"{self.where.get(old, '') + ': ' if old in self.where else ''}`{old}` "
               + (f"moved to `{new}`" if new else f"is not read ({dropped}): delete it") for old, new in moves]))

    def under(self, prefix: str, where: dict[str, str] | None = None) -> MovedKeysWarning:
        """The same moves with their paths under `prefix` (e.g. `train.`)."""
        return MovedKeysWarning([(prefix + o, prefix + n if n else "") for o, n in self.moves], self.dropped, where)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class SamplingSpec(_Strict):
    """How a policy samples; one set per policy."""

    temperature: float = Field(0.0, ge=0.0, le=5.0)
    """0 means greedy decoding."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_tokens: int = Field(96, ge=1, le=8192)
    """Most new tokens per call."""


class PolicySpec(_Strict):
    """A named model endpoint that nodes call: backend + model + optional LoRA adapter + sampling."""

    backend: str = "hf"
    """A registered backend: `hf` runs transformers in-process (token ids + logprobs), `vllm` a vLLM server (token
    ids + logprobs; started here, or attached by `api_base`), `litellm` calls any API or OpenAI-compatible server
    (text + the token counts it reports), `scripted` replays canned replies (tests, from Python)."""
    model: str = "smollm2-135m"
    """Model name: `smollm2-135m` (embedded default), a local HF directory, or a litellm model string."""
    adapter: str | None = None
    """Name of this policy's LoRA adapter on the shared base model (hf backend)."""
    trainable: bool = False
    """Whether RL trainers update this policy (needs a backend that returns token ids and logprobs)."""
    api_base: str | None = None
    """Base URL of an OpenAI-compatible server (litellm backend), or of a running vLLM server to attach to (vllm
    backend; without it masgraph starts one)."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """Sampling parameters."""
    device: str = Field("auto", json_schema_extra={"pattern": DEVICE_PATTERN})
    """Where an in-process (hf) model runs: `auto` (the GPU when torch sees one, else the CPU), `cpu`, `cuda`,
    `cuda:N`. `--device` on run/train/serve overrides it for every hf policy."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The local model's weight dtype (hf, vllm): `auto` takes the faster of bf16 and fp32 on this machine (measured
    once and cached); pin it where results must repeat across machines. A resumed training run keeps the dtype its
    checkpoint records."""

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not re.fullmatch(DEVICE_PATTERN, v):
            raise ValueError(f"device {shorten(v)!r} is not a device: use auto, cpu, cuda or cuda:N (e.g. cuda:1)")
        return v


class ToolSpec(_Strict):
    """A tool instance: a registered tool kind plus its options."""

    kind: str
    """Registered tool kind: `calculator`, `python`, `search`, or a name passed to `register_tool`."""
    description: str | None = None
    """Override of the tool's description shown to the model."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit for one call; a call past it fails that step, not the run."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Tool-specific options (e.g. `memory_mb` for python, `corpus` for search)."""


class MemoryConfig(_Strict):
    """The episode's evolving action log (AgentFlow memory), serialised into prompts."""

    kind: Literal["action_log"] = "action_log"
    """Memory implementation."""
    max_actions: int = Field(6, ge=1)
    """Only the last N actions are serialised into prompts (older ones are summarised by count)."""
    max_result_chars: int = Field(300, ge=16)
    """Tool results longer than this are truncated (head and tail kept) when serialised."""


class _NodeBase(_Strict):
    agent: str | None = None
    """Registered agent implementation (default: the role's own)."""
    policy: str | None = None
    """Name of the policy (in `policies`) this node calls."""
    prompt: str | None = None
    """Prompt template file name under agents/prompts (default: the agent's own)."""
    timeout_s: float = Field(120.0, gt=0)
    """Limit on one attempt of the node's step, in work: agent code and tools in full, an LLM call's share of its
    batch, not the time it waits in masgraph's queue (masgraph/workclock.py); a wall-clock ceiling of 10x (at
    least 600 s) backs it."""
    retries: int = Field(0, ge=0, le=10)
    """Extra attempts after a failed step (exception or timeout)."""
    merge: Literal["concat", "vote", "first"] | None = None
    """How inputs from parallel predecessors are merged (required on fan-in nodes)."""

    needs_policy: ClassVar[bool] = False
    """Whether a node of this role must name a policy."""

    def routes(self, spec: GraphSpec) -> set[str] | None:
        """The route labels this role's built-in agent emits (checked against edges' `when`); None = unknown."""
        return set()


class PlannerSpec(_NodeBase):
    """Chooses the next sub-goal and tool from the query, the tools and the memory."""

    role: Literal["planner"] = "planner"
    tools: list[str] | None = None
    """Tools the planner may choose from (default: all tools of the graph)."""

    needs_policy: ClassVar[bool] = True

    def routes(self, spec: GraphSpec) -> set[str] | None:
        return set(self.tools or spec.tools) | {"answer"}


class ExecutorSpec(_NodeBase):
    """Turns the planner's sub-goal into a concrete tool call, runs it and logs the result."""

    role: Literal["executor"] = "executor"
    tools: list[str] = Field(min_length=1)
    """Tools this executor may call."""

    def routes(self, spec: GraphSpec) -> set[str] | None:
        return {"ok", "error"}


class VerifierSpec(_NodeBase):
    """Reads the memory and says `stop` or `continue` (its route label)."""

    role: Literal["verifier"] = "verifier"
    needs_policy: ClassVar[bool] = True

    def routes(self, spec: GraphSpec) -> set[str] | None:
        return {"stop", "continue"}


class GeneratorSpec(_NodeBase):
    """Writes the final answer from the query and the memory."""

    role: Literal["generator"] = "generator"
    needs_policy: ClassVar[bool] = True

    def routes(self, spec: GraphSpec) -> set[str] | None:
        return {"answer"}


class MemoryNodeSpec(_NodeBase):
    """A memory node. `mode: summary` curates the action log (deterministic truncation, or an LLM summary when given
    a policy). The other modes read the query as a stream of facts, one per line, ending with the question (its
    last line), and keep a per-episode fact store (masgraph/memory/store.py) that later nodes read as their input:
    `manager` asks its policy for one operation per fact (ADD / UPDATE n / DELETE n / NOOP; train it like any
    node), `append` adds every fact, `last_k` adds every fact and keeps the newest `keep`."""

    role: Literal["memory"] = "memory"
    mode: Literal["summary", "manager", "append", "last_k"] = "summary"
    """What the node keeps: the action log (`summary`) or a fact store edited by a policy (`manager`) or a rule."""
    keep: int = Field(5, ge=1)
    """`last_k`: how many of the newest entries are kept."""
    recall: int | None = Field(None, ge=1)
    """Fact-store modes: show later nodes only the `recall` entries that share the most words with the question
    (None: every entry)."""
    scope: Literal["episode", "conversation"] = "episode"
    """Fact-store modes: whose store it is. `episode`: a fresh store per episode. `conversation`: one store per
    conversation, kept across its episodes (masgraph/memory/conversations.py): each episode adds its facts to what
    the conversation's earlier ones left. An episode names its conversation in `meta["conversation"]` (`masgraph
    serve`: the request's `masgraph.conversation`); one that names none (e.g. training rollouts) gets a fresh
    store."""

    @property
    def needs_policy(self) -> bool:  # type: ignore[override]
        return self.mode == "manager"

    @model_validator(mode="after")
    def _scope_needs_a_store(self) -> MemoryNodeSpec:
        if self.scope == "conversation" and self.mode == "summary":
            raise ValueError("scope: conversation keeps a fact store across episodes, but mode: summary keeps none; "
                             "use mode: manager, append or last_k, or drop scope")
        return self


class CustomSpec(_NodeBase):
    """A user agent registered by name with `masgraph.agents.register_agent`."""

    role: Literal["custom"] = "custom"
    tools: list[str] = Field(default_factory=list)
    """Tools the agent may use."""

    def routes(self, spec: GraphSpec) -> set[str] | None:
        return None


NodeSpec = Annotated[
    PlannerSpec | ExecutorSpec | VerifierSpec | GeneratorSpec | MemoryNodeSpec | CustomSpec,
    Field(discriminator="role"),
]

ROLES: dict[str, type[_NodeBase]] = {
    cls.model_fields["role"].default: cls
    for cls in (PlannerSpec, ExecutorSpec, VerifierSpec, GeneratorSpec, MemoryNodeSpec, CustomSpec)}
"""The node roles (the one list): role name -> its spec model, which says whether it needs a policy and which
routes its built-in agent emits. Agents implementing the roles are registered separately (the Registry)."""


class EdgeSpec(_Strict):
    """A directed edge; with `when` it fires only if the source's route label equals it."""

    source: str
    """Source node name."""
    target: str
    """Target node name."""
    when: str | None = None
    """Route label of the source (e.g. a verifier's `stop` / `continue`)."""


class EdgeRef(_Strict):
    """Names one edge of `edges:` by its ends (`when` tells apart parallel edges between the same nodes)."""

    source: str
    """Source node name."""
    target: str
    """Target node name."""
    when: str | None = None
    """The edge's route label, when several edges join the same two nodes."""


class TopologySpec(_Strict):
    """What a topology policy decides per episode: which gated nodes and edges are in, and where each choice
    node routes. Everything not named here is fixed. Every sampled topology is a valid graph: choices that
    would break it (exit unreachable, an unbounded cycle, a route with no edge) are masked out."""

    nodes: list[str] = Field(default_factory=list)
    """Node gates: each of these nodes may be left out of an episode (with every edge touching it)."""
    edges: list[EdgeRef] = Field(default_factory=list)
    """Edge gates: each of these edges may be left out of an episode."""
    choices: dict[str, list[str]] = Field(default_factory=dict)
    """Routing choices: node -> two or more of its successors; each episode keeps exactly one of the node's edges
    to them (the others are left out)."""
    slots: dict[str, list[str]] = Field(default_factory=dict)
    """Prompt slots: node -> two or more prompt templates; each episode's node runs with one of them."""
    condition: Literal["none", "query"] = "none"
    """`query`: decision probabilities depend on the query through a learned linear head on query features
    (zero-initialised, so training starts from the unconditioned prior)."""
    features: Literal["hashed"] = "hashed"
    """Query features for `condition: query`: `hashed` = character n-gram counts hashed into 256 buckets."""


class Limits(_Strict):
    """Bounds that keep every episode finite."""

    max_turns: int | None = Field(None, ge=1, le=1000)
    """Most passes through any cycle per episode; required when the graph has a cycle."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Limit on the episode, in work (counted at the rate of its busiest running node; see `timeout_s`), with a
    wall-clock ceiling of 10x (at least 600 s)."""
    max_steps: int = Field(200, ge=1)
    """Most node steps per episode (a last-resort bound)."""


class GraphSpec(_Strict):
    """A multi-agent graph: policies, tools, memory, nodes, edges and limits.

    Example:
        >>> spec = GraphSpec.model_validate({
        ...     "name": "direct", "policies": {"main": {"backend": "scripted"}},
        ...     "nodes": {"answer": {"role": "generator", "policy": "main"}},
        ...     "entry": "answer", "exit": "answer"})
        >>> spec.nodes["answer"].role
        'generator'
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Graph name (letters, digits, `_`, `-`, `.`)."""
    description: str = ""
    """One line on what the graph does."""
    policies: dict[str, PolicySpec] = Field(default_factory=dict)
    """Named policies nodes refer to."""
    tools: dict[str, ToolSpec] = Field(default_factory=dict)
    """Named tool instances."""
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """The episode memory."""
    nodes: dict[str, NodeSpec]
    """Nodes by name."""
    edges: list[EdgeSpec] = Field(default_factory=list)
    """Directed edges."""
    entry: str
    """The node each episode starts at."""
    exit: str
    """The node whose step ends the episode (normally a generator)."""
    limits: Limits = Field(default_factory=Limits)
    """Episode bounds."""
    topology: TopologySpec | None = None
    """Learnable topology (node gates, edge gates, routing choices) for topology training; omitted = fixed graph."""
    plugins: list[str] = Field(default_factory=list)
    """Python modules that register the custom agents and tools this graph uses: a dotted module name, or a
    `.py` file relative to the graph file; imported when the graph compiles (so a server or worker that loads
    the graph loads them too)."""
    train: Any = None
    """Training settings for `masgraph train`: a mapping keyed by `algorithm:` (default `flow_grpo`), validated by
    that algorithm's config model (registered by `masgraph.trainers`; `masgraph schema` lists the knobs)."""

    def trainable_adapters(self) -> dict[str, str]:
        """Node -> LoRA adapter name, for every node whose policy is trainable (what training updates)."""
        return {n: self.policies[s.policy].adapter for n, s in self.nodes.items()
                if s.policy is not None and self.policies[s.policy].trainable}

    @model_validator(mode="after")
    def _check_references(self) -> GraphSpec:
        names = set(self.nodes)
        if not names:
            raise ValueError("`nodes` is empty: declare at least one node")
        for key in ("entry", "exit"):
            if (node := getattr(self, key)) not in names:
                raise ValueError(f"{key} {shorten(node)!r} is not a node; {node_fix(node, names)}")
        for i, e in enumerate(self.edges):
            for end in ("source", "target"):
                if (node := getattr(e, end)) not in names:
                    raise ValueError(f"edges[{i}].{end} {shorten(node)!r} is not a node; {node_fix(node, names)}")
        for name, node in self.nodes.items():
            if node.policy is None and node.needs_policy:
                what = f"{node.role} with mode: {node.mode}" if node.role == "memory" else node.role
                raise ValueError(f"nodes.{name}: a {what} needs `policy:` (one of {one_of(self.policies)})")
            if node.policy is not None and node.policy not in self.policies:
                raise ValueError(
                    f"nodes.{name}.policy {shorten(node.policy)!r} is not declared; add it under `policies:` "
                    f"or use one of {one_of(self.policies)}"
                )
            if node.role == "custom" and not node.agent:
                raise ValueError(f"nodes.{name}: a custom node needs `agent:` (a name registered with register_agent)")
            for tool in getattr(node, "tools", None) or []:
                if tool not in self.tools:
                    raise ValueError(
                        f"nodes.{name}.tools: {shorten(tool)!r} is not declared; add it under `tools:` "
                        f"or use one of {one_of(self.tools)}"
                    )
        if self.topology is not None:
            _check_topology(self)
        return self


def node_fix(name: str, names: Any) -> str:
    """The fix for a node name that is not a node: 'did you mean X?' for a misspelling (as for a misspelt key),
    else the nodes there are."""
    close = difflib.get_close_matches(name, sorted(names), n=1) if isinstance(name, str) and len(name) <= 100 else []
    return f"did you mean {close[0]!r}?" if close else f"use one of {one_of(names)}"


def edge_indexes(spec: GraphSpec, ref: EdgeRef) -> list[int]:
    """Indexes in `spec.edges` of the edges `ref` names (all parallel ones when it gives no `when`)."""
    return [i for i, e in enumerate(spec.edges) if e.source == ref.source and e.target == ref.target
            and (ref.when is None or e.when == ref.when)]


def _check_topology(spec: GraphSpec) -> None:
    """References of the `topology:` section: gated nodes exist (not entry or exit), each gated edge names exactly
    one edge, each choice names two or more successors of an existing node, and no edge is decided twice."""
    topo, names = spec.topology, set(spec.nodes)
    assert topo is not None
    if not (topo.nodes or topo.edges or topo.choices or topo.slots):
        raise ValueError("topology: declares nothing to learn; list gated `nodes:`, `edges:`, `choices:` or "
                         "`slots:`, or remove the section")
    for node, prompts in topo.slots.items():
        if node not in names:
            raise ValueError(f"topology.slots.{shorten(node)}: {shorten(node)!r} is not a node; "
                             f"{node_fix(node, names)}")
        if len(prompts) < 2 or len(set(prompts)) != len(prompts):
            raise ValueError(f"topology.slots.{shorten(node)}: list two or more different prompt templates "
                             f"(got {prompts})")
    seen: set[str] = set()
    for i, n in enumerate(topo.nodes):
        if n not in names:
            raise ValueError(f"topology.nodes[{i}] {shorten(n)!r} is not a node; {node_fix(n, names)}")
        if n in (spec.entry, spec.exit):
            raise ValueError(f"topology.nodes[{i}] {n!r} is the graph's {'entry' if n == spec.entry else 'exit'}, "
                             "which every episode needs; gate another node")
        if n in seen:
            raise ValueError(f"topology.nodes[{i}] {n!r} is listed twice")
        seen.add(n)
    decided: dict[int, str] = {}
    for i, ref in enumerate(topo.edges):
        found = edge_indexes(spec, ref)
        label = f"{ref.source} -> {ref.target}" + (f" (when: {ref.when})" if ref.when else "")
        if not found:
            raise ValueError(f"topology.edges[{i}]: there is no edge {shorten(label)!r} in `edges:`; gate an "
                             "existing edge")
        if len(found) > 1:
            raise ValueError(f"topology.edges[{i}]: {len(found)} edges join {ref.source!r} to {ref.target!r}"
                             + (f" with when: {ref.when}" if ref.when else "") + "; give `when:` to say which one "
                             "is gated (or make the parallel edges differ)")
        if ref.source == spec.exit:
            raise ValueError(f"topology.edges[{i}]: edge {label!r} leaves the exit, which ends the episode: it never "
                             "runs; gate another edge")
        if found[0] in decided:
            raise ValueError(f"topology.edges[{i}]: edge {label!r} is already decided by {decided[found[0]]}")
        decided[found[0]] = f"topology.edges[{i}]"
    for node, targets in topo.choices.items():
        where = f"topology.choices.{shorten(node)}"
        if node not in names:
            raise ValueError(f"{where}: {shorten(node)!r} is not a node; {node_fix(node, names)}")
        if node == spec.exit:
            raise ValueError(f"{where}: {node!r} is the exit, which ends the episode: its edges never run; "
                             "put the choice on a node before it")
        if len(targets) < 2 or len(set(targets)) != len(targets):
            raise ValueError(f"{where}: list two or more different successors of {node!r} (got {targets})")
        for t in targets:
            found = edge_indexes(spec, EdgeRef(source=node, target=t))
            if not found:
                succ = sorted({e.target for e in spec.edges if e.source == node})
                raise ValueError(f"{where}: {shorten(t)!r} is not a successor of {node!r}; add the edge "
                                 f"{node} -> {shorten(t)}" + (f" or use one of {one_of(succ)}" if succ else
                                                              f" ({node!r} has no outgoing edges yet)"))
            for j in found:
                if j in decided:
                    raise ValueError(f"{where}: edge {node} -> {t} is already decided by {decided[j]}")
                decided[j] = where
