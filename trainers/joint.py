"""Joint training: the same rollouts train the topology policy (HRPO) and every trainable node's LoRA
(Flow-GRPO), composed from the two algorithms (each keeps its own state file in a checkpoint).

`schedule: simultaneous` updates both after every step; `alternate` updates the node policies on even steps and
the topology on odd ones, so each learns against the other held fixed. Both see the step's groups of
`flow_grpo.group_size` episodes per query.
"""

from __future__ import annotations

from typing import Any

from masgraph.spec import GraphSpec
from masgraph.trace import Trace
from masgraph.trainers.algorithm import TrainAlgorithm, TrainContext
from masgraph.trainers.flow_grpo import FlowGRPO
from masgraph.trainers.hrpo import HRPO

__all__ = ["Joint"]


class Joint(TrainAlgorithm):
    """Flow-GRPO on the nodes and HRPO on the topology, from one set of rollouts."""

    def __init__(self, nodes: FlowGRPO, topology: HRPO, schedule: str = "simultaneous"):
        self.nodes, self.topology, self.schedule = nodes, topology, schedule
        self.group_size = nodes.group_size
        self.topology.group_size = nodes.group_size  # one set of groups for both
        self.max_extra_rounds = nodes.max_extra_rounds

    @classmethod
    def build(cls, ctx: TrainContext) -> Joint:
        return cls(FlowGRPO.build(ctx), HRPO.build(ctx), ctx.config.schedule)

    def rollout_spec(self, spec: GraphSpec) -> GraphSpec:
        return self.nodes.rollout_spec(spec)

    def extra_queries(self, traces: list[Trace], rounds: int) -> int:
        return self.nodes.extra_queries(traces, rounds)

    def train_step(self, traces: list[Trace], step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.schedule == "simultaneous" or step % 2 == 0:
            metrics |= self.nodes.train_step(traces, step)
        if self.schedule == "simultaneous" or step % 2 == 1:
            metrics |= self.topology.train_step(traces, step)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes.state_dict(), "topology": self.topology.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nodes.load_state_dict(state["nodes"])
        self.topology.load_state_dict(state["topology"])

    def parts(self) -> list[TrainAlgorithm]:
        return [self.nodes, self.topology]
