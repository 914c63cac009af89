"""`schedule: staged` joint training (trainers/joint.py): the topology learns first on greedy-node rollouts, then the
nodes with the topology held, then both; the loop rolls each step out with the graph its stage asks for."""

from __future__ import annotations

import pytest

from masgraph.graph import GraphBuilder
from masgraph.trainers.joint import Joint, stage_of


@pytest.mark.parametrize("schedule,topology_steps,node_steps,expected", [
    ("simultaneous", 0, None, ["both"] * 5),
    ("alternate", 0, None, ["nodes", "topology", "nodes", "topology", "nodes"]),
    ("staged", 2, 2, ["topology", "topology", "nodes", "nodes", "both"]),
    ("staged", 2, None, ["topology", "topology", "nodes", "nodes", "nodes"]),
    ("staged", 0, 1, ["nodes", "both", "both", "both", "both"]),
    ("staged", 3, 0, ["topology", "topology", "topology", "both", "both"]),
])
def test_stage_of_each_step(schedule, topology_steps, node_steps, expected):
    assert [stage_of(k, schedule, topology_steps, node_steps) for k in range(5)] == expected


def test_stage_of_refuses_an_unknown_schedule():
    with pytest.raises(ValueError, match="unknown joint schedule"):
        stage_of(0, "sometimes")


class Part:
    """Records the steps it was asked to update on."""

    group_size, max_extra_rounds = 4, 0

    def __init__(self, name: str):
        self.name, self.steps = name, []

    def train_step(self, traces, step):
        self.steps.append(step)
        return {f"{self.name}/updated": 1.0}

    def rollout_spec(self, spec):
        return spec.model_copy(update={"name": spec.name + "-sampled"})


def _joint(schedule: str, topology_steps: int = 2, node_steps: int | None = 2) -> tuple[Joint, Part, Part]:
    nodes, topology = Part("nodes"), Part("topology")
    return Joint(nodes, topology, schedule, topology_steps, node_steps), nodes, topology  # type: ignore[arg-type]


def test_staged_updates_one_part_per_stage_and_says_which():
    joint, nodes, topology = _joint("staged")
    metrics = [joint.train_step([], k) for k in range(6)]
    assert topology.steps == [0, 1, 4, 5] and nodes.steps == [2, 3, 4, 5]
    assert [m["joint/stage"] for m in metrics] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert "nodes/updated" not in metrics[0] and "topology/updated" not in metrics[2]


def test_the_topology_stage_rolls_out_the_graph_as_written_and_the_others_sample():
    b = GraphBuilder("g")
    b.add_policy("p", backend="scripted")
    b.add_node("answer", role="generator", policy="p")
    spec = b.set(entry="answer", exit="answer").compile().spec
    staged, _, _ = _joint("staged")
    assert staged.rollout_spec_at(spec, 0) is spec and staged.rollout_spec_at(spec, 1) is spec
    assert staged.rollout_spec_at(spec, 2).name == "g-sampled" and staged.rollout_spec_at(spec, 4).name == "g-sampled"
    simultaneous, _, _ = _joint("simultaneous")
    assert simultaneous.rollout_spec_at(spec, 0).name == "g-sampled"  # unchanged: every step samples the nodes
