"""The one seam between the training loop and an RL algorithm.

The loop (`trainers/loop.py`) owns what every algorithm needs done the same way: the learner and its adapters,
serving them to rollouts, the topology policy rollouts sample from, the data cursor, the time budget, evaluation,
checkpoints and events. An algorithm owns only what makes it that algorithm: how rollouts sample, whether a step
wants more queries, the update made from a step's groups, and the state an exact resume needs. The loop never
names an algorithm; it builds the one the `train:` section's `algorithm:` registers (`Registry.algorithms`), so a
new algorithm is one new file plus its registration (see tests/unit/trainers/test_algorithm_seam.py for a tiny one).

A composite (joint training) returns its members from `parts()`; the checkpoint writes each part's state to the
part's own `state_file`, so the files of a joint run are those of its two parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from masgraph.events import Sink
from masgraph.graph import Graph
from masgraph.learn.learner import Learner
from masgraph.runtime.runner import Runner
from masgraph.spec import GraphSpec
from masgraph.tasks import Item, Task
from masgraph.topology.policy import TopologyPolicy
from masgraph.trace import Trace

__all__ = ["TrainAlgorithm", "TrainContext", "query_groups"]


@dataclass
class TrainContext:
    """What the loop hands an algorithm to build on."""

    graph: Graph
    config: Any
    """The graph's `train:` section (the algorithm's own model, e.g. `JointTrainSpec`)."""
    learner: Learner
    """Owns the LoRA adapters (already attached for every trainable policy) and computes logprobs."""
    trainable: dict[str, str]
    """Trainable node -> its adapter."""
    topology: TopologyPolicy | None
    """The policy rollouts sample topologies from (None: the graph has no `topology:` section)."""


class TrainAlgorithm(ABC):
    """A training algorithm as the loop drives it: build, (optionally) reshape the rollout graph, update from each
    step's groups of episodes, save and restore its state."""

    trains_adapters: ClassVar[bool] = True
    """Whether it updates LoRA adapters (the graph must then have trainable policies; the learner loads their base
    model). A topology-only algorithm sets False."""
    state_file: ClassVar[str] = ""
    """Its file in a checkpoint directory (`parts()` of a composite each have their own)."""

    group_size: int
    """Episodes per training query (the group its advantages compare within)."""

    @classmethod
    @abstractmethod
    def build(cls, ctx: TrainContext) -> TrainAlgorithm:
        """The algorithm for this graph and `train:` section."""

    def rollout_spec(self, spec: GraphSpec) -> GraphSpec:
        """The graph as training rolls it out (e.g. trainable policies at a sampling temperature); as written by
        default. Evaluation always uses the graph as written."""
        return spec

    def rollout_spec_at(self, spec: GraphSpec, step: int) -> GraphSpec:
        """The graph as step `step` (0-based) rolls it out: `rollout_spec(spec)` at every step by default. A staged
        algorithm explores differently per stage (e.g. greedy nodes while only the topology learns); the loop keeps
        one runner per distinct graph returned."""
        return self.rollout_spec(spec)

    def rollout_topology_at(self, step: int) -> Literal["sample", "greedy"]:
        """How step `step` (0-based) picks each episode's topology on a graph with a `topology:` section: `sample`
        from the topology policy (what topology learning explores; the default), or `greedy`, its most likely
        route per query (as deployed: e.g. while only the nodes learn, so a query's group differs by its nodes'
        samples alone, not by the route each sample drew)."""
        return "sample"

    async def rollouts(self, runner: Runner, task: Task, items: list[Item], sinks: Sequence[Sink]) -> list[Trace]:
        """A step's episodes of `items` (the runner's `samples` = `group_size` consecutive per item), not stored.
        Default: the runner's plain items × samples; an algorithm that shapes its rollouts (Flow-GRPO: branching,
        counterfactual scoring) runs them through `masgraph.learn.rollouts` here."""
        return (await runner.run_items(task, items, sinks=sinks, store=False)).traces

    def extra_queries(self, traces: list[Trace], rounds: int) -> int:
        """How many more queries this step wants rolled out before its update (after `rounds` extra rounds so far),
        e.g. to replace groups that carry no signal; 0 by default."""
        return 0

    max_extra_rounds: int = 0
    """Upper bound of the extra rounds `extra_queries` may ask for per step (sizes the training data)."""

    @abstractmethod
    def train_step(self, traces: list[Trace], step: int) -> dict[str, float]:
        """Update from step `step`'s episodes (`group_size` consecutive traces per query); returns metrics. Adapters
        it changed get a new version on the learner (the loop then publishes them)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs beyond the adapter weights (optimizer moments, baselines, ...); tensors,
        numbers, strings, lists and dicts only (checkpoints are loaded with `weights_only=True`)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; raise KeyError / TypeError / ValueError / RuntimeError when it does not fit."""

    def parts(self) -> list[TrainAlgorithm]:
        """The algorithms whose states a checkpoint holds: itself, or a composite's members."""
        return [self]

    def credit(self) -> dict[str, list[tuple[int, int, float]]]:
        """The last `train_step`'s advantage per LLM call it trained on: episode id -> (step index, call index,
        advantage); the loop records them (`events.Credited`) for `masgraph watch`. Default: none."""
        return {}


def query_groups(traces: list[Trace], group_size: int) -> list[list[Trace]]:
    """A step's traces cut into its queries' groups (the runner keeps each query's samples consecutive)."""
    return [traces[i:i + group_size] for i in range(0, len(traces), group_size)]
