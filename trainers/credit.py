"""Credit below the trajectory: GiGPO's step-level advantage on a graph (arXiv 2505.10978, `gigpo/core_gigpo.py`).

Flow-GRPO broadcasts one outcome advantage to every call of an episode. When the G trajectories of a query pass
through the same state more than once (same node, same input), those steps can be compared with each other: they
saw exactly the same thing, so the difference in what followed is credit for what they did there. GiGPO calls the
set of such steps an anchor-state group. On a graph:

    state of a call    (its query group, its node, the token ids of the call's prompt): the node's rendered input,
                       which holds the query, its inputs and the memory it was shown. A node that calls its
                       model more than once in a step (a memory manager: one call per fact) has one state per
                       call, so each of its decisions is compared with the others taken from the same input
    step return        G_t = gamma^(k) * R, R the trajectory's (shaped) reward and k the steps after t in it (the
                       graph gives no reward before the end; gamma < 1 favours reaching the answer in fewer steps)
    step advantage     A^S = (G_t - mean) / (std + eps) over the anchor group's calls, each counted once; 0 for a
                       call alone in its state or in a group whose returns are all equal (a call's return is its
                       step's)
    combined           A = A^E + w * A^S  (`advantage: episode+step`), A^S alone (`step`), A^E alone (`episode`)

The first step of every trajectory of a query shares its state with all of them (same query, empty memory), so
its A^S equals A^E (with gamma = 1); later steps are compared only with the trajectories that reached the same
memory.

A node's format is credited the same way, per node rather than per state (`format_weight`): within a group, each
call of a node scores -1 when its output failed to parse and 0 otherwise, normalised over that node's calls, so
the push lands on the node that broke its format and on no other. A call failed when it says so
(`LLMCall.parse_error`, set by a node that calls its model several times a step: a memory manager, once per
fact); in a step where no call says so, every call takes the step's `parse_error`. Per call because a step-level
flag cannot move a many-call node: a memory step fails if any of its ~9 calls does, so at a sampling temperature
where one call in ten slips, nearly every step fails alike and the format advantage has no variance.

A call that chose among a closed set of completions can be credited against the alternatives it did not take
(`counterfactual`, masgraph.learn.counterfactual): A^C = R - mean over alternatives a' of R(a'), each R(a') the score
of the episode re-run with a' in the call's place (COMA's counterfactual baseline). With `counterfactual_norm` a
node's A^C are divided by their root mean square over the step's scored calls (Dr.MAS's per-agent normalisation
on this term alone), so its scale no longer depends on how much one decision moves the score.

Pure functions, tested against hand-computed values; `flow_grpo.build_rows` applies them.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterator

from masgraph.learn.counterfactual import META
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.pg_math import normalise

__all__ = ["anchor_groups", "call_failures", "call_state", "counterfactual_advantages", "counterfactual_scales",
           "counterfactual_scores", "counterfactual_values", "format_advantages", "group_steps", "state_key",
           "step_advantages", "step_format_advantages", "step_returns"]


def call_state(node: str, call: LLMCall) -> str | None:
    """The state a call acted in: its node and the token ids of its prompt (None without any)."""
    if not call.prompt_ids:
        return None
    return node + ":" + hashlib.sha256(",".join(map(str, call.prompt_ids)).encode()).hexdigest()[:32]


def state_key(step: Step) -> str | None:
    """The state a step acted in: its first LLM call's (None without one)."""
    return call_state(step.node, step.llm[0]) if step.llm else None


def step_returns(trace: Trace, reward: float, gamma: float = 1.0) -> dict[int, float]:
    """Step index -> gamma^(steps after it) * reward, for every step of the trajectory."""
    n = len(trace.steps)
    return {s.index: reward * gamma ** (n - 1 - k) for k, s in enumerate(trace.steps)}


def group_steps(traces: list[Trace], members: dict[tuple, list[int]], trainable: dict[str, str] | set[str]
                ) -> Iterator[tuple[tuple, int, Step]]:
    """(group key, trajectory, step) for every trainable step of every group (`members`: group key -> trajectory
    indices, as `build_rows` forms them: a query's key holds every node, a (query, node) key that node only)."""
    for key, trajs in members.items():
        for i in trajs:
            for s in traces[i].steps:
                if s.node in trainable and (len(key) == 1 or s.node == key[1]):
                    yield key, i, s


def anchor_groups(traces: list[Trace], members: dict[tuple, list[int]], trainable: dict[str, str] | set[str]
                  ) -> dict[tuple, list[tuple[int, int, int]]]:
    """(group key, state) -> the (trajectory, step index, call index) of every trainable call in that state, over
    the group's trajectories."""
    out: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
    for key, i, s in group_steps(traces, members, trainable):
        for k, call in enumerate(s.llm):
            state = call_state(s.node, call)
            if state is not None:
                out[(key, state)].append((i, s.index, k))
    return dict(out)


def step_advantages(traces: list[Trace], rewards: dict[int, float], members: dict[tuple, list[int]],
                    trainable: dict[str, str] | set[str], gamma: float = 1.0, eps: float = 1e-6
                    ) -> dict[tuple[int, int, int], float]:
    """(trajectory, step index, call index) -> the call's step-level advantage A^S within its anchor-state group (0
    alone)."""
    returns = {i: step_returns(traces[i], rewards[i], gamma) for i in rewards}
    out: dict[tuple[int, int, int], float] = {}
    for calls in anchor_groups(traces, members, trainable).values():
        calls = [c for c in calls if c[0] in returns]
        for c, a in zip(calls, normalise([returns[i][t] for i, t, _ in calls], eps)):
            out[c] = a
    return out


def format_advantages(failed: list[bool], eps: float = 1e-6) -> list[float]:
    """A node's format advantage per step of it in one group: the format reward (-1 when the step's output failed
    to parse, else 0) normalised over those steps (all 0 when they all parsed, or all failed)."""
    return normalise([-float(f) for f in failed], eps)


def call_failures(step: Step) -> list[bool]:
    """Per LLM call of a step, whether its output failed the node's format: the calls' own flags where the node set
    any (`LLMCall.parse_error`), else the step's `parse_error` for every call."""
    if any(c.parse_error is not None for c in step.llm):
        return [c.parse_error is not None for c in step.llm]
    return [step.parse_error is not None] * len(step.llm)


def step_format_advantages(traces: list[Trace], members: dict[tuple, list[int]], trainable: dict[str, str] | set[str],
                           eps: float = 1e-6) -> dict[tuple[int, int, int], float]:
    """(trajectory, step index, call index) -> the call's format advantage among its node's calls in its group
    (`format_advantages` over `call_failures`), for every call of a trainable step."""
    by_node: dict[tuple, list[tuple[int, int, int, bool]]] = defaultdict(list)
    for key, i, s in group_steps(traces, members, trainable):
        for k, failed in enumerate(call_failures(s)):
            by_node[(key, s.node)].append((i, s.index, k, failed))
    out: dict[tuple[int, int, int], float] = {}
    for calls in by_node.values():
        for (i, index, k, _), a in zip(calls, format_advantages([f for *_, f in calls], eps)):
            out[(i, index, k)] = a
    return out


def recorded_scores(trace: Trace) -> dict[tuple[int, int], dict[str, float]]:
    """(step index, call index) -> {variant text, stripped: its score} as the runner recorded them
    (`trace.meta["counterfactual"]`); with probe questions the call's own text is among them."""
    scored: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for step, k, alt, score in trace.meta.get(META, []):
        scored[(step, k)][alt.strip()] = score
    return scored


def counterfactual_values(trace: Trace, alternatives: dict[str, list[str]]) -> dict[tuple[int, int], list[float]]:
    """(step index, call index) -> the episode's score with each of the node's alternatives in the call's place, in
    `alternatives` order (the one the call wrote itself: its own score); only calls whose every variant was scored
    (`trace.meta["counterfactual"]`), of a finished episode."""
    return {ref: q for ref, (_, q) in counterfactual_scores(trace, alternatives).items()}


def counterfactual_scores(trace: Trace, alternatives: dict[str, list[str]]
                          ) -> dict[tuple[int, int], tuple[float, list[float]]]:
    """(step index, call index) -> (the call's own score, `counterfactual_values`' list). The own score is the one
    recorded for the call's own text (with probe questions: its mean over them), else the episode's reward."""
    if trace.status != "ok" or trace.reward is None or not trace.meta.get(META):
        return {}
    scored = recorded_scores(trace)
    out = {}
    for s in trace.steps:
        for k, call in enumerate(s.llm):
            if (s.index, k) not in scored or s.node not in alternatives:
                continue
            own = scored[(s.index, k)].get(call.text.strip(), trace.reward)
            q = [own if alt.strip() == call.text.strip() else scored[(s.index, k)].get(alt.strip())
                 for alt in alternatives[s.node]]
            if all(v is not None for v in q):  # a variant that went unscored leaves the call without a baseline
                out[(s.index, k)] = (own, q)
    return out


def counterfactual_scales(traces: list[Trace], advantages: dict[tuple[int, int, int], float]) -> dict[str, float]:
    """`counterfactual_norm`: node -> 1 / the root mean square of its calls' counterfactual advantages
    (`counterfactual_advantages`' values, zeros included); 1 for a node none of whose decisions mattered."""
    node_of = {(i, s.index): s.node for i, tr in enumerate(traces) for s in tr.steps}
    squares: dict[str, list[float]] = defaultdict(list)
    for (i, step, _), a in advantages.items():
        squares[node_of[(i, step)]].append(a * a)
    return {node: 1.0 / math.sqrt(ms) if (ms := sum(v) / len(v)) > 0 else 1.0 for node, v in squares.items()}


def counterfactual_advantages(traces: list[Trace], alternatives: dict[str, list[str]]
                              ) -> dict[tuple[int, int, int], float]:
    """(trajectory, step index, call index) -> the call's counterfactual advantage (masgraph/counterfactual.py):
    its own score (its episode's reward, or with probe questions its mean over them) less the mean of
    `counterfactual_values` (its scores with each of the node's alternatives in its place)."""
    return {(i, step, k): own - sum(q) / len(q)
            for i, tr in enumerate(traces) for (step, k), (own, q) in counterfactual_scores(tr, alternatives).items()}
