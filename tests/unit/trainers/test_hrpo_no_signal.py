"""`hrpo.no_signal: skip` (trainers/hrpo.py): a group whose episodes all got the same task reward teaches the topology
nothing. Without it, a route that fails only because its node has not learned yet is pushed out by the token cost
alone before it ever pays; the scripted toy below is that situation (the joint-training collapse of RESULTS.md)."""

from __future__ import annotations

import pytest

from masgraph.graph.space import DecisionSpace
from masgraph.topology.policy import TopologyPolicy
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.config import HRPOConfig
from masgraph.trainers.hrpo import HRPO
from masgraph.trainers.hrpo_math import has_signal

LEARNS_AT = 8  # the step from which the expensive route's node has learned: from then on it pays


@pytest.mark.parametrize("rewards,signal", [([0.0, 0.0, 0.0], False), ([1.0, 1.0], False), ([0.0, 1.0], True),
                                            ([None, 0.0], False), ([None, 0.5], True), ([1.0], False)])
def test_has_signal_compares_task_rewards_a_failure_scoring_0(rewards, signal):
    assert has_signal(rewards) is signal


def _episode(policy: TopologyPolicy, query: str, seed: int, step: int) -> Trace:
    """The `tool` route costs 40 tokens and pays only once its node has learned (step >= LEARNS_AT); `direct` costs
    5 tokens and never pays."""
    s = policy.sample(query, seed=seed)
    route = s.choice.decisions["choice:start"]
    tokens = 40 if route == "tool" else 5
    call = LLMCall(policy="p", prompt_ids=[1], completion_ids=[7] * tokens, logprobs=[0.0] * tokens, text="t")
    steps = [Step(episode_id=str(seed), index=0, node=route, role="generator", turn=0, llm=[call])]
    reward = float(route == "tool" and step >= LEARNS_AT)
    return Trace(episode_id=str(seed), item_id=query, query=query, steps=steps, reward=reward, topology=s.choice)


def _train(graph, no_signal: str, steps: int = 24) -> list[float]:
    policy = TopologyPolicy(DecisionSpace(graph))
    hrpo = HRPO(policy, HRPOConfig(group_size=8, lr=0.1, cost_lambda=1.0, no_signal=no_signal))
    history = []
    for k in range(steps):
        groups = [[_episode(policy, f"q{q}", 1000 * k + 10 * q + g, k) for g in range(8)] for q in range(2)]
        metrics = hrpo.update(groups)
        if no_signal == "learn" or k < LEARNS_AT:  # later, a group that sampled one route only has no signal too
            assert metrics["topology/skipped_groups"] == (2.0 if no_signal == "skip" else 0.0)
        history.append(policy.probabilities()["choice:start"]["tool"])
    return history


def test_a_route_that_pays_once_its_node_has_learned_survives_with_skip_and_collapses_without(two_routes):
    learn, skip = _train(two_routes, "learn"), _train(two_routes, "skip")
    # before the node learns, no route pays: `learn` follows the token cost alone and all but drops the tool route
    assert learn[LEARNS_AT - 1] < 0.2, learn
    assert skip[LEARNS_AT - 1] == 0.5  # nothing to learn from: the prior stands, exactly
    # once it pays, the route that survived is learned at once; the collapsed one has to climb back first
    assert skip[-1] > 0.9, skip
    assert skip[LEARNS_AT + 4] > learn[LEARNS_AT + 4] + 0.2, (skip, learn)
