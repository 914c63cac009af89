"""Joint training: the same rollouts train the topology policy (HRPO) and every trainable node's LoRA
(Flow-GRPO), composed from the two algorithms (each keeps its own state file in a checkpoint).

`schedule: simultaneous` updates both after every step; `alternate` updates the node policies on even steps and
the topology on odd ones, so each learns against the other held fixed. Both see the step's groups of
`flow_grpo.group_size` episodes per query.

The credit-assignment problem of doing both at once. A route's reward depends on how well its nodes do now, and
they are still learning: early on, the route that will work best (planner -> search -> generator on a lookup
question) may fail every time only because the planner's sampled search queries miss. In such a group every
route scores 0, so the group-relative outcome advantage is 0 and HRPO's cost terms (λ·tokens in the outcome, the
action-wise token and rationality terms) are the only signal left: they push the cheapest route, and the topology
forgets the route that works before its node has learned (measured: −15 and −16 points against topology-only,
every city question routed straight to the generator on one seed of each round; RESULTS.md).

What follows from that, in the order it is built:
- `hrpo.no_signal: skip` (landed): a group with no task-reward signal teaches the topology nothing, as Flow-GRPO
  already skips zero-variance groups (DAPO's dynamic sampling). A route then keeps its prior probability until
  some group shows it working or failing against another route. Unit test: tests/unit/test_hrpo_no_signal.py
  (a route that pays only once its node has learned collapses with `learn` and is learned at once with `skip`).
  The default stays `learn` until the joint benchmark (≥ 3 seeds, both tasks) is re-run with it.
- Next, measured before being made defaults: separate temperatures for what each part explores (the topology
  scored on episodes whose nodes decode near-greedily, so a route is judged by what its nodes can do, not by
  their exploration noise), and a probability floor per decision option (no route collapses below ε before it has
  been tried with the current node policies).
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
