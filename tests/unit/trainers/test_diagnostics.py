"""The training-health metrics every step records (trainers/diagnostics.py), against hand-computed values."""

from __future__ import annotations

import pytest

from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.diagnostics import (
    decision_agreement,
    no_signal_fraction,
    parse_failures,
    reward_by_type,
    sampled_entropy,
    step_diagnostics,
)


def _call(logprobs: list[float], temperature: float | None = 1.0, text: str = "x") -> LLMCall:
    return LLMCall(policy="p", prompt_ids=[1], completion_ids=[2] * len(logprobs), logprobs=logprobs, text=text,
                   temperature=temperature)


def _trace(item: str, reward: float | None, status: str = "ok", kind: str | None = None,
           calls: dict[str, list[LLMCall]] | None = None) -> Trace:
    steps = [Step(episode_id="e", index=i, node=node, role="planner", turn=0, llm=llm)
             for i, (node, llm) in enumerate((calls or {}).items())]
    return Trace(episode_id=f"{item}-{reward}", item_id=item, query="q", reward=reward, status=status, steps=steps,
                 meta={"type": kind} if kind else {})


def test_no_signal_is_the_share_of_queries_whose_episodes_all_scored_alike():
    traces = [_trace("a", 1.0), _trace("a", 0.0),            # signal
              _trace("b", 1.0), _trace("b", 1.0),            # all solved: none
              _trace("c", 0.0), _trace("c", None, "timeout"),  # a failure scores 0 like the miss: none
              _trace("d", 0.5), _trace("d", 0.0, "error")]   # signal
    assert no_signal_fraction(traces) == 0.5
    assert no_signal_fraction([]) == 0.0


def test_sampled_entropy_is_the_mean_surprisal_of_sampled_tokens_per_node():
    traces = [_trace("a", 1.0, calls={"planner": [_call([-1.0, -3.0]), _call([-2.0])],
                                      "verifier": [_call([-0.5], temperature=0)]}),   # greedy: left out
              _trace("a", 0.0, calls={"planner": [_call([-0.0])], "executor": [_call([-4.0])]})]
    # planner: (1 + 3 + 2 + 0) / 4 tokens; executor is not trained; verifier only decoded greedily
    assert sampled_entropy(traces, {"planner", "verifier"}) == {"planner": pytest.approx(1.5)}


def test_decision_agreement_is_the_share_of_a_querys_samples_that_decided_alike_per_call():
    def manager(*outputs: str, temperature: float = 1.0) -> dict:
        return {"memory": [_call([-1.0], temperature, text=o) for o in outputs]}

    traces = [_trace("a", 1.0, calls=manager("Operation: ADD\nmore", "Operation: ADD")),
              _trace("a", 0.0, calls=manager("\nOperation: ADD", "Operation: NOOP")),
              _trace("a", 0.0, calls=manager("Operation: UPDATE", "Operation: ADD")),
              _trace("b", 1.0, calls=manager("Operation: NOOP")),  # one sample of b: nothing to compare
              _trace("c", 1.0, calls=manager("ADD", temperature=0)),  # greedy calls: left out
              _trace("c", 1.0, calls=manager("NOOP", temperature=0))]
    # query a, call 0: ADD, ADD, UPDATE (first lines) -> 2/3; call 1: ADD, NOOP, ADD -> 2/3
    assert decision_agreement(traces, {"memory"}) == {"memory": pytest.approx(2 / 3)}
    collapsed = [_trace("a", r, calls=manager("Operation: ADD", "Operation: ADD")) for r in (1.0, 0.0)]
    assert decision_agreement(collapsed, {"memory"}) == {"memory": 1.0}
    assert decision_agreement(traces, {"planner"}) == {}
    # a manager's decision is the operation the runtime applied: unparseable text that fell back to ADD is an ADD
    from masgraph.trace import MemoryOp

    applied = [_trace("a", 1.0, calls=manager(text)) for text in ("Operation: ADD", "New fact: garbage", "ADD")]
    for t in applied:
        t.steps[0].memory_ops = [MemoryOp(fact="f", op="ADD", target=3, output=t.steps[0].llm[0].text)]
    assert decision_agreement(applied, {"memory"}) == {"memory": 1.0}


def test_reward_by_type_averages_per_item_type_and_is_empty_for_untyped_items():
    traces = [_trace("a", 1.0, kind="math"), _trace("a", 0.0, kind="math"), _trace("b", 1.0, kind="city"),
              _trace("b", None, "timeout", kind="city"), _trace("c", 1.0)]
    assert reward_by_type(traces) == {"city": 0.5, "math": 0.5}
    assert reward_by_type([_trace("c", 1.0)]) == {}


def test_step_diagnostics_names_the_metrics():
    traces = [_trace("a", 1.0, kind="math", calls={"planner": [_call([-2.0])]}),
              _trace("a", 0.0, kind="math", calls={"planner": [_call([-2.0], text="y")]})]
    assert step_diagnostics(traces, {"planner"}) == {"groups/no_signal": 0.0, "entropy/planner": 2.0,
                                                     "agree/planner": 0.5, "parse/planner": 0.0,
                                                     "reward/type/math": 0.5}


def test_parse_failures_per_node_that_ran():
    traces = [_trace("a", 1.0, calls={"planner": [_call([-1.0])], "verifier": [_call([-1.0])]}),
              _trace("a", 1.0, calls={"planner": [_call([-1.0])], "verifier": [_call([-1.0])]}),
              _trace("b", 0.0, calls={"verifier": [_call([-1.0])], "executor": [_call([-1.0])]})]
    traces[0].steps[1].parse_error = traces[2].steps[0].parse_error = "no verdict found; continuing"
    traces[2].steps[1].parse_error = "not trained: not counted"
    # verifier: 2 of 3 steps; planner: 0 of 2; the executor is not trainable; a node that never ran is absent
    assert parse_failures(traces, {"planner", "verifier", "generator"}) == {"planner": 0.0, "verifier": 2 / 3}


def test_the_training_view_plots_them():
    from masgraph.watch.render import plot_keys

    metrics = [{"step": 1, "reward/mean": 0.5, "groups/no_signal": 0.25, "entropy/planner": 1.2,
                "agree/planner": 0.9, "parse/verifier": 0.5, "reward/type/city": 0.0, "reward/type/math": 1.0,
                "note": "text is not plotted"}]
    assert plot_keys(metrics) == ["reward/mean", "groups/no_signal", "agree/planner", "entropy/planner",
                                  "parse/verifier", "reward/type/city", "reward/type/math"]
