"""What a training step's metrics show about the health of learning, whatever the algorithm: signals that warn
before held-out accuracy falls.

    groups/no_signal      share of queries whose episodes all scored alike: a group-relative advantage has
                          nothing to push with (a collapsed policy, or a task solved or hopeless at this stage)
    entropy/<node>        mean surprisal -log p of the tokens a trainable node sampled, under the distribution
                          it sampled from (the recorded logprobs): an unbiased estimate of that distribution's
                          entropy per token; falling towards 0 is entropy collapse (DAPO's warning sign)
    reward/type/<type>    mean reward per item type, for tasks whose items are typed (`meta["type"]`): one
                          type gaining while another loses (reward hacking one route) shows here first
    agree/<node>          how alike a query's samples decided at a trainable node: per query and call, the share of
                          sampled calls whose decision (what the runtime applied where it records it, else the
                          output's first line) is the most common one, averaged; 1.0 is a decision that no longer
                          explores, even while the text around it still varies
    parse/<node>          share of a trainable node's steps whose output failed to parse: a node drifting off
                          its format where the outcome does not punish it shows here before held-out accuracy falls

Pure functions of the step's traces, tested against hand-computed values.
"""

from __future__ import annotations

from collections import defaultdict

from masgraph.trace import Trace

__all__ = ["decision_agreement", "no_signal_fraction", "parse_failures", "reward_by_type", "sampled_entropy",
           "step_diagnostics"]


def _reward(trace: Trace) -> float:
    """The episode's reward as training sees it (a failed or unscored episode scores 0)."""
    return trace.reward if trace.status == "ok" and trace.reward is not None else 0.0


def no_signal_fraction(traces: list[Trace]) -> float:
    """The share of the step's queries (grouped by item) whose episodes all scored the same."""
    groups: dict[str, set[float]] = defaultdict(set)
    for t in traces:
        groups[t.item_id].add(_reward(t))
    return sum(len(r) < 2 for r in groups.values()) / len(groups) if groups else 0.0


def sampled_entropy(traces: list[Trace], nodes: set[str] | frozenset[str]) -> dict[str, float]:
    """Per node of `nodes`: mean -logprob over every token its sampled (temperature > 0) calls produced. Greedy
    calls are left out (their logprobs are of the raw softmax, not of a distribution that was sampled)."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for t in traces:
        for step in t.steps:
            if step.node not in nodes:
                continue
            for call in step.llm:
                if call.temperature == 0 or not call.logprobs:
                    continue
                total[step.node] -= sum(call.logprobs)
                count[step.node] += len(call.logprobs)
    return {n: total[n] / count[n] for n in sorted(count)}


def decision_agreement(traces: list[Trace], nodes: set[str] | frozenset[str]) -> dict[str, float]:
    """Per node of `nodes`: over each (query, turn, call index) that two or more sampled calls reached, the share of
    them whose decision is the most common one; the mean of those shares. A call's decision is the memory operation
    applied from it (op and entry) when its step records one per call, else its output's first non-empty line."""
    firsts: dict[tuple[str, str, int, int], list[str]] = defaultdict(list)
    for t in traces:
        for step in t.steps:
            if step.node not in nodes:
                continue
            ops = step.memory_ops if len(step.memory_ops) == len(step.llm) else None
            for k, call in enumerate(step.llm):
                if call.temperature != 0:
                    decided = (f"{ops[k].op} {ops[k].target}" if ops else
                               next((line.strip() for line in call.text.splitlines() if line.strip()), ""))
                    firsts[(step.node, t.item_id, step.turn, k)].append(decided)
    shares: dict[str, list[float]] = defaultdict(list)
    for (node, *_), lines in firsts.items():
        if len(lines) > 1:
            shares[node].append(max(lines.count(x) for x in set(lines)) / len(lines))
    return {n: sum(v) / len(v) for n, v in sorted(shares.items())}


def reward_by_type(traces: list[Trace]) -> dict[str, float]:
    """Mean reward per item type (`trace.meta["type"]`); empty when the task's items carry no type."""
    by: dict[str, list[float]] = defaultdict(list)
    for t in traces:
        if "type" in t.meta:
            by[str(t.meta["type"])].append(_reward(t))
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def parse_failures(traces: list[Trace], nodes: set[str] | frozenset[str]) -> dict[str, float]:
    """Per node of `nodes` that ran: the share of its steps whose output failed to parse."""
    failed: dict[str, int] = defaultdict(int)
    ran: dict[str, int] = defaultdict(int)
    for t in traces:
        for step in t.steps:
            if step.node in nodes:
                ran[step.node] += 1
                failed[step.node] += step.parse_error is not None
    return {n: failed[n] / ran[n] for n in sorted(ran)}


def step_diagnostics(traces: list[Trace], trainable: set[str] | frozenset[str]) -> dict[str, float]:
    """The five, as `metrics.jsonl` keys."""
    return ({"groups/no_signal": no_signal_fraction(traces)}
            | {f"entropy/{n}": h for n, h in sampled_entropy(traces, trainable).items()}
            | {f"agree/{n}": a for n, a in decision_agreement(traces, trainable).items()}
            | {f"parse/{n}": f for n, f in parse_failures(traces, trainable).items()}
            | {f"reward/type/{k}": r for k, r in reward_by_type(traces).items()})
