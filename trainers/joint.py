"""Joint training: the same rollouts train the topology policy (HRPO) and every trainable node's LoRA (Flow-GRPO),
composed from the two algorithms, because a route's reward depends on nodes that are still learning.

`schedule: simultaneous` updates both every step; `alternate` updates the nodes on even steps and the topology on
odd ones; `staged` learns the topology first on greedy-node rollouts, then the nodes with the topology held (each
query on its most likely route with `stages.node_topology: greedy`), then both, so the two learners never chase
each other. `hrpo.no_signal: skip` keeps a route from being pushed out by cost alone while its nodes still fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from masgraph.events import Sink
from masgraph.runtime.runner import Runner
from masgraph.spec import GraphSpec
from masgraph.tasks import Item, Task
from masgraph.trace import Trace
from masgraph.trainers.algorithm import TrainAlgorithm, TrainContext
from masgraph.trainers.flow_grpo import FlowGRPO
from masgraph.trainers.hrpo import HRPO

__all__ = ["Joint", "stage_of"]

STAGES = ("topology", "nodes", "both")


def stage_of(step: int, schedule: str, topology_steps: int = 0, node_steps: int | None = None) -> str:
    """Which part(s) step `step` (0-based) updates: 'topology', 'nodes' or 'both'. `simultaneous`: both every
    step; `alternate`: nodes on even steps, topology on odd; `staged`: topology for `topology_steps`, then nodes for
    `node_steps` (None: for good), then both."""
    if schedule == "simultaneous":
        return "both"
    if schedule == "alternate":
        return "nodes" if step % 2 == 0 else "topology"
    if schedule != "staged":
        raise ValueError(f"unknown joint schedule {schedule!r}")
    if step < topology_steps:
        return "topology"
    if node_steps is None or step < topology_steps + node_steps:
        return "nodes"
    return "both"


class Joint(TrainAlgorithm):
    """Flow-GRPO on the nodes and HRPO on the topology, from one set of rollouts."""

    def __init__(self, nodes: FlowGRPO, topology: HRPO, schedule: str = "simultaneous", topology_steps: int = 0,
                 node_steps: int | None = None, node_topology: Literal["sample", "greedy"] = "greedy"):
        self.nodes, self.topology, self.schedule = nodes, topology, schedule
        self.topology_steps, self.node_steps, self.node_topology = topology_steps, node_steps, node_topology
        self._last_step = 0
        self.group_size = nodes.group_size
        self.topology.group_size = nodes.group_size  # one set of groups for both
        self.max_extra_rounds = nodes.max_extra_rounds

    @classmethod
    def build(cls, ctx: TrainContext) -> Joint:
        cfg = ctx.config
        return cls(FlowGRPO.build(ctx), HRPO.build(ctx), cfg.schedule, cfg.stages.topology_steps,
                   cfg.stages.node_steps, cfg.stages.node_topology)

    def stage(self, step: int) -> str:
        """'topology', 'nodes' or 'both': what step `step` (0-based) updates."""
        return stage_of(step, self.schedule, self.topology_steps, self.node_steps)

    def rollout_spec(self, spec: GraphSpec) -> GraphSpec:
        return self.nodes.rollout_spec(spec)

    def rollout_spec_at(self, spec: GraphSpec, step: int) -> GraphSpec:
        """Staged: the topology stage rolls the graph out as written (nodes greedy, as topology-only training
        does); every other step samples the trainable nodes (Flow-GRPO's rollout graph)."""
        if self.schedule == "staged" and self.stage(step) == "topology":
            return spec
        return self.rollout_spec(spec)

    def rollout_topology_at(self, step: int) -> Literal["sample", "greedy"]:
        """Staged with `stages.node_topology: greedy`: the node stage takes each query's most likely route."""
        if self.schedule == "staged" and self.stage(step) == "nodes":
            return self.node_topology
        return "sample"

    async def rollouts(self, runner: Runner, task: Task, items: list[Item], sinks: Sequence[Sink]) -> list[Trace]:
        return await self.nodes.rollouts(runner, task, items, sinks)  # shaped for the nodes' credit

    def extra_queries(self, traces: list[Trace], rounds: int) -> int:
        return self.nodes.extra_queries(traces, rounds)

    def train_step(self, traces: list[Trace], step: int) -> dict[str, float]:
        stage, self._last_step = self.stage(step), step
        metrics: dict[str, float] = {"joint/stage": float(STAGES.index(stage))}
        if stage in ("nodes", "both"):
            metrics |= self.nodes.train_step(traces, step)
        if stage in ("topology", "both"):
            metrics |= self.topology.train_step(traces, step)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes.state_dict(), "topology": self.topology.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nodes.load_state_dict(state["nodes"])
        self.topology.load_state_dict(state["topology"])

    def parts(self) -> list[TrainAlgorithm]:
        return [self.nodes, self.topology]

    def credit(self) -> dict[str, list[tuple[int, int, float]]]:
        return self.nodes.credit() if self.stage(self._last_step) in ("nodes", "both") else {}
