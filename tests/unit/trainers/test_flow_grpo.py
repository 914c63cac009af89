"""Flow-GRPO math against hand-computed values, and the rows it builds from real Trace objects."""

from __future__ import annotations

import math
import random

import pytest
import torch

from masgraph.errors import MasgraphError
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.flow_grpo import (
    FlowGRPO,
    FlowGRPOConfig,
    aggregate,
    build_rows,
    format_advantages,
    group_advantages,
    informative_queries,
    kl_k3,
    logprob_temperature,
    mini_batches,
    ppo_clip_loss,
    row_weights,
    step_format_advantages,
    surprisal_bonus,
    trajectory_rewards,
)


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    assert adv.tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254])  # std = sqrt(1/3)
    assert group_advantages(torch.tensor([1.0])).tolist() == [0.0]


@pytest.mark.parametrize("ratio,adv,expected", [
    (1.5, 1.0, -1.3),   # above 1 + eps_high: clipped
    (1.5, -1.0, 1.5),   # negative advantage: the unclipped (worse) term wins
    (0.5, 1.0, -0.5),   # below 1 - eps_low with A > 0: unclipped is smaller
    (0.5, -1.0, 0.8),   # below 1 - eps_low with A < 0: clipped at 0.8
    (1.1, 2.0, -2.2),   # inside the trust region
])
def test_ppo_clip_asymmetric(ratio, adv, expected):
    loss = ppo_clip_loss(torch.tensor([math.log(ratio)]), torch.tensor([0.0]), torch.tensor(adv), 0.2, 0.3)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("ratio,adv,expected", [
    (5.0, -1.0, 3.0),   # A < 0, ratio past c = 3: capped at -c A (the plain clip gives 5.0)
    (2.0, -1.0, 2.0),   # A < 0, ratio under c: the plain clip's -rho A
    (5.0, 1.0, -1.3),   # A > 0: the plain clip, whatever c
    (0.5, -2.0, 1.6),   # A < 0 below 1 - eps_low: the plain clip's 0.8 * 2
])
def test_dual_clip_caps_a_negative_advantage_tokens_loss(ratio, adv, expected):
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    loss = ppo_clip_loss(logp, torch.tensor([0.0]), torch.tensor(adv), 0.2, 0.3, dual_clip=3.0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.sum().backward()
    clipped = (adv > 0 and ratio > 1.3) or (adv < 0 and ratio < 0.8)  # outside the plain trust region
    capped = adv < 0 and ratio > 3.0
    assert (logp.grad.item() == 0.0) == (clipped or capped)  # a capped token pushes nothing, as a clipped one


def test_the_dual_clip_knob_reaches_the_update_loss():
    from types import SimpleNamespace

    from masgraph.trainers.flow_grpo import FlowGRPO, Row

    row = Row(traj=0, node="n", adapter="a", prompt_ids=[1], completion_ids=[2, 3], old_logprobs=[-3.0, -1.0],
              advantage=-1.0, policy_version=0)
    logp = torch.tensor([-3.0 + math.log(10.0), -1.0])  # the first token's ratio is 10, the second's 1

    def loss(**knobs):
        totals = dict.fromkeys(("clip", "approx_kl", "kl", "pg"), 0.0)
        cfg = FlowGRPOConfig(ppo={"kl_coef": 0.0, **knobs})
        return FlowGRPO._token_loss(SimpleNamespace(config=cfg), row, logp, logp, totals).tolist()

    assert loss() == pytest.approx([10.0, 1.0]) and loss(dual_clip=3.0) == pytest.approx([3.0, 1.0])
    with pytest.raises(ValueError, match="greater than 1"):
        FlowGRPOConfig(ppo={"dual_clip": 1.0})  # c <= 1 would cap tokens inside the trust region


def test_kl_k3_hand_computed():
    got = kl_k3(torch.tensor([math.log(0.5), math.log(0.3)]), torch.tensor([math.log(0.25), math.log(0.3)]))
    assert got.tolist() == pytest.approx([0.5 - math.log(0.5) - 1, 0.0], abs=1e-6)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_aggregation_modes():
    losses = [torch.tensor([1.0, 1.0]), torch.tensor([3.0]), torch.tensor([0.0, 0.0, 0.0, 4.0])]
    trajs = [0, 0, 1]
    assert aggregate(losses, trajs, "token-mean").item() == pytest.approx(9 / 7)
    assert aggregate(losses, trajs, "nested").item() == pytest.approx(1.5)  # mean(mean(1, 3), mean(0,0,0,4))


def test_row_weights_by_hand():
    # rows of 2, 1 and 4 tokens; the first two in trajectory 0, the third in trajectory 1
    assert row_weights([2, 1, 4], [0, 0, 1], "token-mean") == pytest.approx([1 / 7] * 3)
    # nested: 1 / (2 trajectories x rows in the trajectory x tokens in the row)
    assert row_weights([2, 1, 4], [0, 0, 1], "nested") == pytest.approx([1 / 8, 1 / 4, 1 / 8])
    with pytest.raises(MasgraphError, match="unknown loss aggregation 'sum'; use 'token-mean' or 'nested'"):
        row_weights([1], [0], "sum")


def test_mini_batches_partition_the_rows_seeded():
    batches = mini_batches(10, 3, random.Random(7))
    assert sorted(i for b in batches for i in b) == list(range(10)) and [len(b) for b in batches] == [3, 3, 4]
    assert all(b == sorted(b) for b in batches)
    assert batches == mini_batches(10, 3, random.Random(7)) != mini_batches(10, 3, random.Random(8))
    assert mini_batches(2, 4, random.Random(0)) in ([[0], [1]], [[1], [0]])  # never an empty mini-batch
    assert mini_batches(5, 1, random.Random(0)) == [[0, 1, 2, 3, 4]]  # one mini-batch: the rows in order


def test_logprob_temperature_of_a_call():
    call = LLMCall(policy="p", prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], text="x", temperature=0.5)
    config = FlowGRPOConfig(temperature=0.7)
    assert logprob_temperature(call, config) == 0.5  # the call's own, not the trainer's
    assert logprob_temperature(call.model_copy(update={"temperature": 0.0}), config) == 1.0  # greedy: raw logits
    assert logprob_temperature(call.model_copy(update={"temperature": None}), config) == 0.7  # recorded before


def _trace(item: str, reward: float | None, calls: dict[str, int], status: str = "ok", ep: str = "") -> Trace:
    steps = []
    for node, n in calls.items():
        for k in range(n):
            call = LLMCall(policy=node, adapter=node, prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                           logprobs=[-0.1, -0.2, -0.3], text="x", policy_version=2)
            steps.append(Step(episode_id=ep, index=len(steps), node=node, role="planner", turn=k + 1, llm=[call]))
    return Trace(episode_id=ep or f"{item}-{reward}-{len(steps)}", item_id=item, query="q", steps=steps,
                 reward=reward, status=status)


def test_rows_broadcast_reward_and_count_each_trajectory_once():
    traces = [_trace("q1", 1.0, {"planner": 3, "verifier": 1}), _trace("q1", 0.0, {"planner": 1}),
              _trace("q2", 1.0, {"planner": 1}), _trace("q2", 1.0, {"planner": 2})]  # q2: zero variance
    rows = build_rows(traces, {"planner": "planner", "verifier": "verifier"}, FlowGRPOConfig(credit={"adv_eps": 0.0}))
    assert [(r.traj, r.node) for r in rows] == [(0, "planner")] * 3 + [(0, "verifier"), (1, "planner")]
    # per trajectory, not per turn-row: [1, 0] -> +-0.7071 (per-row stats would give mean 0.8)
    assert [r.advantage for r in rows] == pytest.approx([0.70710678] * 4 + [-0.70710678])
    assert rows[0].old_logprobs == [-0.1, -0.2, -0.3] and rows[0].policy_version == 2
    assert rows[0].temperature == 1.0  # as the calls were sampled (their temperature, else the trainer's)
    kept = build_rows(traces, {"planner": "planner"}, FlowGRPOConfig(batching={"zero_variance": "keep"}))
    assert [r.advantage for r in kept if r.traj >= 2] == [0.0, 0.0, 0.0]


def test_rows_grouped_by_query_and_node():
    traces = [_trace("q1", 1.0, {"planner": 1, "verifier": 1}), _trace("q1", 0.0, {"planner": 1})]
    rows = build_rows(traces, {"planner": "p", "verifier": "v"}, FlowGRPOConfig(credit={"group_by": "query_node"}))
    # the verifier group has a single trajectory: no signal, skipped
    assert [(r.traj, r.node) for r in rows] == [(0, "planner"), (1, "planner")]


def test_stragglers_drop_or_zero():
    traces = [_trace("q1", 1.0, {"planner": 1}), _trace("q1", None, {"planner": 1}, status="timeout"),
              _trace("q1", 0.5, {"planner": 1})]
    dropped = build_rows(traces, {"planner": "p"}, FlowGRPOConfig(credit={"adv_eps": 0.0}))
    assert [r.traj for r in dropped] == [0, 2] and dropped[0].advantage == pytest.approx(0.70710678)
    zeroed = build_rows(traces, {"planner": "p"},
                        FlowGRPOConfig(batching={"stragglers": "zero"}, credit={"adv_eps": 0.0}))
    assert [r.traj for r in zeroed] == [0, 1, 2] and zeroed[1].advantage == pytest.approx(-1.0)


def test_parse_penalty_shapes_the_trajectory_reward():
    clean, sloppy = _trace("q1", 1.0, {"planner": 2}), _trace("q1", 1.0, {"planner": 2})
    sloppy.steps[1].parse_error = "no 'Tool:' line"
    traces = [clean, sloppy]
    assert trajectory_rewards(traces, FlowGRPOConfig()) == {0: 1.0, 1: 1.0}  # outcome only: a flat group
    assert trajectory_rewards(traces, FlowGRPOConfig(credit={"parse_penalty": 0.5})) == {0: 1.0, 1: 0.5}
    assert informative_queries(traces, FlowGRPOConfig(credit={"parse_penalty": 0.5})) == {"q1"}


def test_format_advantages_hand_computed():
    # format rewards [-1, 0, 0, 0]: mean -0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    assert format_advantages([True, False, False, False], eps=0.0) == pytest.approx([-1.5, 0.5, 0.5, 0.5])
    assert format_advantages([False, False]) == [0.0, 0.0] and format_advantages([True, True]) == [0.0, 0.0]


def test_format_weight_pushes_only_the_node_that_broke_its_format():
    """The verifier's unparseable verdict does not change the outcome (a flat group: no outcome signal); with
    credit.format_weight its own rows get the format advantage, the planner's none."""
    traces = [_trace("q1", 1.0, {"planner": 1, "verifier": 1}) for _ in range(4)]
    traces[0].steps[1].parse_error = "no verdict found; continuing"
    assert build_rows(traces, {"planner": "p", "verifier": "v"}, FlowGRPOConfig(credit={"adv_eps": 0.0})) == []
    rows = build_rows(traces, {"planner": "p", "verifier": "v"},
                      FlowGRPOConfig(credit={"adv_eps": 0.0, "format_weight": 0.2}))
    assert [(r.traj, r.node) for r in rows] == [(0, "verifier"), (1, "verifier"), (2, "verifier"), (3, "verifier")]
    assert [r.advantage for r in rows] == pytest.approx([-0.3, 0.1, 0.1, 0.1])  # 0.2 x [-1.5, 0.5, 0.5, 0.5]
    # with an outcome signal the two add: outcome [1, 0, 0, 0] -> [1.5, -0.5, -0.5, -0.5] for every node's rows
    traces[1].reward = traces[2].reward = traces[3].reward = 0.0
    rows = build_rows(traces, {"planner": "p", "verifier": "v"},
                      FlowGRPOConfig(credit={"adv_eps": 0.0, "format_weight": 0.2}))
    got = {(r.traj, r.node): r.advantage for r in rows}
    assert got[(0, "planner")] == pytest.approx(1.5) and got[(0, "verifier")] == pytest.approx(1.5 - 0.3)
    assert got[(1, "planner")] == pytest.approx(-0.5) and got[(1, "verifier")] == pytest.approx(-0.5 + 0.1)


def test_surprisal_bonus_hand_computed():
    # beta * -log p: a token sampled at p = 0.5 gains 0.1 * 0.6931; a certain one (log p = 0) nothing
    got = surprisal_bonus(torch.tensor([math.log(0.5), 0.0, math.log(0.01)]), 0.1)
    assert got.tolist() == pytest.approx([0.0693147, 0.0, 0.4605170])


def test_entropy_bonus_keeps_the_rows_of_a_flat_group():
    traces = [_trace("q1", 1.0, {"memory": 2}) for _ in range(3)]  # every episode alike: no outcome signal
    assert build_rows(traces, {"memory": "m"}, FlowGRPOConfig()) == []
    rows = build_rows(traces, {"memory": "m"}, FlowGRPOConfig(credit={"entropy_bonus": 0.1}))
    assert len(rows) == 6 and {r.advantage for r in rows} == {0.0}  # the bonus is per token, added in the update


def test_entropy_bonus_raises_a_rarely_sampled_choice_in_a_group_with_no_outcome_signal(categorical):
    """Seven episodes sampled the common token, one the rare token 2; all scored alike. Without the bonus the update
    has no rows and changes nothing; with it token 2's probability rises and the common token's falls (no KL term,
    so the bonus is the only push)."""
    def traces(learner):
        lp = torch.log_softmax(learner.logits.detach(), -1).tolist()
        out = []
        for tok in [0] * 7 + [2]:
            call = LLMCall(policy="m", adapter="m", prompt_ids=[9], completion_ids=[tok], logprobs=[lp[tok]], text="x",
                           policy_version=0)
            out.append(Trace(episode_id=f"e{len(out)}", item_id="q", query="q", reward=1.0,
                             steps=[Step(episode_id=f"e{len(out)}", index=0, node="memory", role="memory", turn=1,
                                         llm=[call])]))
        return out

    plain = categorical()
    before = plain.probs()
    metrics = FlowGRPO(plain, {"memory": "m"}, FlowGRPOConfig(lr=0.1, ppo={"kl_coef": 0.0})).update(traces(plain))
    assert metrics["rows/trained"] == 0 and plain.probs() == before
    bonus = categorical()
    cfg = FlowGRPOConfig(lr=0.1, ppo={"kl_coef": 0.0}, credit={"entropy_bonus": 0.5})
    metrics = FlowGRPO(bonus, {"memory": "m"}, cfg).update(traces(bonus))
    after = bonus.probs()
    assert metrics["rows/trained"] == 8 and bonus.versions["m"] == 1
    assert after[2] > 1.15 * before[2] and after[0] < before[0] - 0.005
    assert after[1] == pytest.approx(after[3])  # the unsampled tokens move together


def test_format_groups_follow_group_by():
    traces = [_trace("q1", 1.0, {"verifier": 2}), _trace("q1", 1.0, {"verifier": 1}),
              _trace("q2", 1.0, {"verifier": 1})]
    traces[0].steps[0].parse_error = "x"
    fmt = step_format_advantages(traces, {("q1",): [0, 1], ("q2",): [2]}, {"verifier": "v"}, eps=0.0)
    # q1's three verifier steps [fail, ok, ok] -> [-1.1547, 0.5774, 0.5774]; q2 alone: 0
    assert [fmt[(0, 0, 0)], fmt[(0, 1, 0)], fmt[(1, 0, 0)], fmt[(2, 0, 0)]] == pytest.approx([-1.1547005, 0.5773503,
                                                                                              0.5773503, 0.0])
    by_node = build_rows(traces, {"verifier": "v"},
                         FlowGRPOConfig(credit={"group_by": "query_node", "format_weight": 1.0, "adv_eps": 0.0}))
    assert [round(r.advantage, 4) for r in by_node] == [-1.1547, 0.5774, 0.5774]


def test_informative_queries_and_resample_drops_zero_variance_rows():
    traces = [_trace("q1", 1.0, {"planner": 1}), _trace("q1", 0.0, {"planner": 1}),
              _trace("q2", 1.0, {"planner": 1}), _trace("q2", 1.0, {"planner": 1}),
              _trace("q3", 0.0, {"planner": 1}), _trace("q3", None, {"planner": 1}, status="error")]
    assert informative_queries(traces, FlowGRPOConfig()) == {"q1"}
    # a failed episode scored 0 does not make q3 informative (its other reward is 0 too)
    assert informative_queries(traces, FlowGRPOConfig(batching={"stragglers": "zero"})) == {"q1"}
    traces.append(_trace("q2", None, {"planner": 1}, status="timeout"))
    assert informative_queries(traces, FlowGRPOConfig(batching={"stragglers": "zero"})) == {"q1", "q2"}
    rows = build_rows(traces, {"planner": "p"}, FlowGRPOConfig(batching={"zero_variance": "resample"}))
    assert {r.traj for r in rows} == {0, 1}  # like skip: the loop replaces such groups with fresh queries
