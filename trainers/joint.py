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
- `schedule: staged` (MetaAgent-X's stagewise co-training, with the stages chosen from the problem above): the
  topology first, for `stages.topology_steps` steps, on rollouts whose nodes decode as the graph writes them
  (greedy), exactly as topology-only training; then the nodes, for `stages.node_steps`, with Flow-GRPO on sampled
  nodes and the topology held (not updated; its routes sampled, or with `node_topology: greedy` each query's most
  likely one); then both. Why this removes the failure rather than damping it: the two learners never chase each
  other. While the topology learns, a route's reward is what its nodes do when deployed (the greedy planner finds
  the person 75 % of the time on city questions, the sampled one rarely), so the accuracy signal decides routes,
  not node exploration noise; while the nodes learn, their rewards are not shifted by a routing that moves under them.
  Each stage is the setting in which its algorithm was shown to work alone (topology-only: 89 % of the oracle's
  headroom; Flow-GRPO on a fixed route: +24 to +27 points), so the composition starts from topology-only's result
  and can only add what node training adds on the chosen routes. In the last stage both move; `no_signal: skip`
  keeps a route that its sampled nodes fail on from being pushed out by cost alone.
- `stages.node_topology: greedy` (round 5). Round 4's staged seed 0 lost 39 points of arithmetic to its node
  stage (its checkpoint with the LoRA B matrices zeroed, same topology: 79 % vs 40 %; RESULTS.md): its trained
  planner wrote the few-shot example's city ("Sub-goal: Rafeport") on arithmetic. Its training episodes show the
  credit error behind it: with the topology still sampled in the node stage, a query's group mixes routes (some
  straight to the generator, reward 0, which lowers the baseline), so a planner sample's advantage is mostly the
  luck of the route its episode drew, not what the planner wrote. Holding the topology as deployed (each query its
  most likely route) makes the group differ by the nodes' samples alone: the Flow-GRPO-on-a-fixed-route setting
  that was shown to work, on the routes the topology chose. Measured (round 5, 3 seeds, 15 CPU-min each): 81.0 %
  (81.0 / 81.4 / 80.5) against topology-only's 76.8 %, arithmetic 76–79 % on every seed; on the second task,
  `mixed_skills`, 82.1 % (83.8 / 83.8 / 78.6) against topology-only's 64.4 % and policy-only's 33.3 %. The default
  since then (`sample` stays a knob).
- Measured before being made defaults; not built yet: separate temperatures for what each part explores in the
  simultaneous schedule, and a probability floor per decision option.
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
