"""Branching rollouts (ARPO, arXiv 2507.19849): fork an episode where its policy was least sure, so a group spends its
samples where they differ instead of re-deciding what every rollout decides alike.

With `branch_width = w`, a query's group of G is G // (1 + w) roots each followed by w siblings that replay the
root's calls (`EpisodeInput.replay`) up to the fork step, the trainable step whose first call's opening `OPENING`
tokens had the highest mean surprisal, and sample afresh from there; a sibling records
`trace.meta["branch"] = {"root": id, "fork_step": index}`. Siblings meet at the fork with the same input, so
step-level credit (`trainers/credit.py`) compares them there. Pure functions; `rollouts.py` runs them.
"""

from __future__ import annotations

from masgraph.runtime.scheduler import EpisodeInput
from masgraph.trace import LLMCall, Trace

__all__ = ["OPENING", "fork_step", "replay_prefix", "siblings"]

OPENING = 10
"""How many of a call's first sampled tokens measure its uncertainty."""


def fork_step(trace: Trace, nodes: set[str]) -> int | None:
    """Position in `trace.steps` of the step of one of `nodes` whose first call's opening tokens had the highest mean
    surprisal (the earliest of equals); None when no step of theirs sampled a token."""
    best, where = -1.0, None
    for i, step in enumerate(trace.steps):
        if step.node in nodes and step.llm and step.llm[0].logprobs:
            opening = step.llm[0].logprobs[:OPENING]
            surprisal = -sum(opening) / len(opening)
            if surprisal > best:
                best, where = surprisal, i
    return where


def replay_prefix(trace: Trace, fork: int) -> dict[tuple[str, int, int], LLMCall]:
    """The calls of the steps before position `fork`, by (node, turn, call index within the step)."""
    return {(s.node, s.turn, k): call for s in trace.steps[:fork] for k, call in enumerate(s.llm)}


def siblings(root: EpisodeInput, trace: Trace, nodes: set[str], width: int, first_sample: int) -> list[EpisodeInput]:
    """`width` episodes that replay `trace` (the finished `root`) up to its fork step and sample from there (sample
    indices from `first_sample`: their own seeds). When the root failed or has no step to fork at, they are
    independent samples of the query (the group keeps its size)."""
    fork = fork_step(trace, nodes)
    if fork is None or trace.status != "ok":
        return [EpisodeInput(root.item_id, root.query, first_sample + j, dict(root.meta), root.topology, root.choice)
                for j in range(width)]
    prefix = replay_prefix(trace, fork)
    meta = {**root.meta, "branch": {"root": trace.episode_id, "fork_step": fork}}
    return [EpisodeInput(root.item_id, root.query, first_sample + j, meta, root.topology, root.choice,
                         replay=prefix) for j in range(width)]
