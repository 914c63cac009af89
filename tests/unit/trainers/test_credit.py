"""Step-level credit (trainers/credit.py, GiGPO on a graph): anchor-state groups, step returns and advantages, and
how `flow_grpo.build_rows` combines them with the episode advantage, against hand-computed values."""

from __future__ import annotations

import pytest

from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.credit import anchor_groups, state_key, step_advantages, step_returns
from masgraph.trainers.flow_grpo import FlowGRPOConfig, build_rows


def credit(**knobs) -> FlowGRPOConfig:
    """Flow-GRPO's knobs with `knobs` under `credit:`."""
    return FlowGRPOConfig(credit=knobs)


def _step(index: int, node: str, prompt: list[int] | None) -> Step:
    llm = [] if prompt is None else [LLMCall(policy=node, adapter=node, prompt_ids=prompt, completion_ids=[9],
                                             logprobs=[-0.5], text="x", temperature=1.0)]
    return Step(episode_id="e", index=index, node=node, role="planner", turn=1, llm=llm)


def _two_hop(item: str, reward: float, second: list[int]) -> Trace:
    """planner (same input in every trajectory) -> executor (untrained) -> planner (input = what it found)."""
    steps = [_step(0, "planner", [1, 2]), _step(1, "executor", None), _step(2, "planner", second)]
    return Trace(episode_id=f"{item}-{reward}-{second}", item_id=item, query="q", steps=steps, reward=reward)


@pytest.fixture
def traces() -> list[Trace]:
    # trajectories 0 and 1 found the same thing ([1, 2, 7]); 2 and 3 another ([1, 2, 8]); rewards 1, 0, 1, 1
    return [_two_hop("q1", 1.0, [1, 2, 7]), _two_hop("q1", 0.0, [1, 2, 7]), _two_hop("q1", 1.0, [1, 2, 8]),
            _two_hop("q1", 1.0, [1, 2, 8])]


def test_state_is_the_node_and_its_prompt():
    assert state_key(_step(0, "planner", [1, 2])) == state_key(_step(5, "planner", [1, 2]))
    assert state_key(_step(0, "planner", [1, 2])) != state_key(_step(0, "verifier", [1, 2]))
    assert state_key(_step(0, "planner", [1, 2])) != state_key(_step(0, "planner", [1, 2, 3]))
    assert state_key(_step(0, "executor", None)) is None


def test_step_returns_discount_by_the_steps_after():
    trace = _two_hop("q", 1.0, [1])
    assert step_returns(trace, 1.0) == {0: 1.0, 1: 1.0, 2: 1.0}
    assert step_returns(trace, 1.0, gamma=0.5) == {0: 0.25, 1: 0.5, 2: 1.0}


def test_anchor_groups_and_step_advantages(traces):
    groups = anchor_groups(traces, {("q1",): [0, 1, 2, 3]}, {"planner"})
    assert sorted(len(v) for v in groups.values()) == [2, 2, 4]  # first steps; [1,2,7]; [1,2,8]
    adv = step_advantages(traces, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}, {("q1",): [0, 1, 2, 3]}, {"planner"}, eps=0.0)
    # first steps: returns [1, 0, 1, 1], mean 0.75, unbiased std 0.5 -> [0.5, -1.5, 0.5, 0.5] (= the episode's)
    assert [adv[(i, 0, 0)] for i in range(4)] == pytest.approx([0.5, -1.5, 0.5, 0.5])
    # second steps: [1, 0] in state [1,2,7] -> +-0.7071; [1, 1] in state [1,2,8] -> 0, 0
    assert [adv[(i, 2, 0)] for i in range(4)] == pytest.approx([0.70710678, -0.70710678, 0.0, 0.0])


def test_build_rows_episode_step_and_both(traces):
    trainable = {"planner": "p"}
    by = lambda rows: {(r.traj, r.node, len(r.prompt_ids)): r.advantage for r in rows}  # noqa: E731
    episode = by(build_rows(traces, trainable, credit(adv_eps=0.0)))
    assert episode[(1, "planner", 2)] == episode[(1, "planner", 3)] == pytest.approx(-1.5)  # broadcast
    both = by(build_rows(traces, trainable, credit(adv_eps=0.0, advantage="episode+step", step_weight=1.0)))
    assert both[(0, "planner", 2)] == pytest.approx(0.5 + 0.5)
    assert both[(0, "planner", 3)] == pytest.approx(0.5 + 0.70710678)
    assert both[(1, "planner", 3)] == pytest.approx(-1.5 - 0.70710678)
    assert both[(2, "planner", 3)] == pytest.approx(0.5)
    half = by(build_rows(traces, trainable, credit(adv_eps=0.0, advantage="episode+step", step_weight=0.5)))
    assert half[(1, "planner", 3)] == pytest.approx(-1.5 - 0.35355339)
    step = build_rows(traces, trainable, credit(adv_eps=0.0, advantage="step", step_weight=0.5))
    # step alone: the weight does not scale it; steps whose anchor group has no signal push nothing and are left out
    assert {(r.traj, len(r.prompt_ids)): round(r.advantage, 4) for r in step} == {
        (0, 2): 0.5, (1, 2): -1.5, (2, 2): 0.5, (3, 2): 0.5, (0, 3): 0.7071, (1, 3): -0.7071}


def test_a_flat_group_gives_no_step_signal_with_gamma_1_but_does_with_fewer_steps_discounted():
    short = Trace(episode_id="s", item_id="q", query="q", reward=1.0, steps=[_step(0, "planner", [1, 2])])
    long = _two_hop("q", 1.0, [1, 2, 7])
    assert build_rows([short, long], {"planner": "p"}, credit(advantage="step")) == []
    rows = build_rows([short, long], {"planner": "p"}, credit(advantage="step", step_gamma=0.5, adv_eps=0.0))
    # the first planner steps share a state: returns 1 (answered at once) vs 0.25 (two steps later) -> +-0.7071
    assert [(r.traj, round(r.advantage, 4)) for r in rows if len(r.prompt_ids) == 2] == [(0, 0.7071), (1, -0.7071)]
