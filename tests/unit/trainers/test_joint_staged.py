"""`schedule: staged` joint training (trainers/joint.py): the topology learns first on greedy-node rollouts, then the
nodes with the topology held, then both; the loop rolls each step out with the graph its stage asks for."""

from __future__ import annotations

import pytest

from masgraph.graph import GraphBuilder
from masgraph.trainers.config import StagesConfig
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


def test_the_node_stage_takes_the_most_likely_route_with_node_topology_greedy():
    nodes, topology = Part("nodes"), Part("topology")
    greedy = Joint(nodes, topology, "staged", 2, 2, node_topology="greedy")  # type: ignore[arg-type]
    assert [greedy.rollout_topology_at(k) for k in range(6)] == ["sample"] * 2 + ["greedy"] * 2 + ["sample"] * 2
    sampled = Joint(nodes, topology, "staged", 2, 2, node_topology="sample")  # type: ignore[arg-type]
    assert {sampled.rollout_topology_at(k) for k in range(6)} == {"sample"}  # holds the topology, samples its routes
    assert StagesConfig().node_topology == "greedy"  # the default, measured better on both mixed tasks
    simultaneous = Joint(nodes, topology, "simultaneous", node_topology="greedy")  # type: ignore[arg-type]
    assert {simultaneous.rollout_topology_at(k) for k in range(6)} == {"sample"}  # topology learns every step


# ---- the collapse the staged schedule is built against, on a scripted toy ------------------------------------------
# Two routes: `tool` (40 tokens) answers when its node decodes greedily, but its *sampled* node only answers once it
# has learned (from step LEARNS_AT); `direct` (5 tokens) never answers. That is the joint-training failure of
# RESULTS.md: city questions, the search route, a planner sampled at temperature 0.7.

LEARNS_AT = 8


def _toy_episode(policy, query: str, seed: int, step: int, greedy_nodes: bool):
    from masgraph.trace import LLMCall, Step, Trace

    s = policy.sample(query, seed=seed)
    route = s.choice.decisions["choice:start"]
    tokens = 40 if route == "tool" else 5
    call = LLMCall(policy="p", prompt_ids=[1], completion_ids=[7] * tokens, logprobs=[0.0] * tokens, text="t")
    steps = [Step(episode_id=str(seed), index=0, node=route, role="generator", turn=0, llm=[call])]
    pays = route == "tool" and (greedy_nodes or step >= LEARNS_AT)
    return Trace(episode_id=str(seed), item_id=query, query=query, steps=steps, reward=float(pays), topology=s.choice)


def _toy_run(graph, schedule: str, no_signal: str, steps: int = 20) -> list[float]:
    """p(tool) after each step of a Joint whose node part is a stand-in and whose topology part is real HRPO; the
    rollouts decode the nodes greedily exactly when the stage's rollout graph is the graph as written."""
    from masgraph.graph.space import DecisionSpace
    from masgraph.topology.policy import TopologyPolicy
    from masgraph.trainers.config import HRPOConfig
    from masgraph.trainers.hrpo import HRPO

    policy = TopologyPolicy(DecisionSpace(graph))
    hrpo = HRPO(policy, HRPOConfig(group_size=8, lr=0.1, cost_lambda=1.0, no_signal=no_signal))
    nodes = Part("nodes")
    nodes.group_size = 8
    joint = Joint(nodes, hrpo, schedule, topology_steps=6)  # type: ignore[arg-type]
    history = []
    for k in range(steps):
        greedy = joint.rollout_spec_at(graph.spec, k) is graph.spec
        traces = [_toy_episode(policy, f"q{q}", 1000 * k + 10 * q + g, k, greedy) for q in range(2) for g in range(8)]
        joint.train_step(traces, k)
        history.append(policy.probabilities()["choice:start"]["tool"])
    return history


def test_staged_learns_the_route_that_works_before_its_sampled_node_does_and_simultaneous_forgets_it(two_routes):
    simultaneous = _toy_run(two_routes, "simultaneous", "learn")
    skip = _toy_run(two_routes, "simultaneous", "skip")
    staged = _toy_run(two_routes, "staged", "skip")
    assert simultaneous[LEARNS_AT - 1] < 0.2, simultaneous  # cost alone pushed the cheap route (the collapse)
    assert skip[LEARNS_AT - 1] == 0.5  # no signal, no update: the prior stands until the node learns
    assert staged[5] > 0.7 and all(b > a for a, b in zip(staged[:6], staged[1:6])), staged  # judged on greedy
    # nodes, the tool route gains at every step of the topology stage, though its sampled node cannot answer yet
    assert staged[6:] == [staged[5]] * (len(staged) - 6)  # then the node stage holds the topology
    assert staged[LEARNS_AT - 1] > skip[LEARNS_AT - 1] + 0.2 > simultaneous[LEARNS_AT - 1] + 0.4


def test_stages_without_the_staged_schedule_is_a_located_error(root):
    from masgraph.errors import SpecError
    from masgraph.loader import parse_spec

    text = (root / "graphs" / "mixed_router.yaml").read_text()
    staged, stages = "  schedule: staged", "  stages: {topology_steps: 10}"
    assert staged in text and stages in text  # the shipped graph: the measured staged arm
    parse_spec(text.replace(stages, "  stages: {topology_steps: 5}"), "g.yaml")  # staged: any stages
    bad = text.replace(staged, "  schedule: simultaneous").replace(stages, "  stages: {topology_steps: 5}")
    with pytest.raises(SpecError, match=r"train: `stages` sets up `schedule: staged`, but the schedule is "
                                        r"'simultaneous'"):
        parse_spec(bad, "g.yaml")
    # a spec dumped before node_topology's default became greedy (it holds `sample`) still loads
    old = "  stages: {topology_steps: 10, node_steps: null, node_topology: sample}"
    parse_spec(text.replace(staged, "  schedule: simultaneous").replace(stages, old), "g.yaml")
