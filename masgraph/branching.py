"""Branching rollouts (ARPO's idea, arXiv 2507.19849): fork an episode where its policy was least sure.

A GRPO group of G independent rollouts spends most of its samples re-deciding what every rollout decides alike.
With branching (`RunConfig.branch_width = w`), a query's group is R = G // (1 + w) root episodes, each followed
by w siblings: a sibling replays its root's LLM calls up to the fork step (the recorded completions, not new
samples: it sees the same prefix) and samples afresh from there. The group keeps G trajectories, so a query's
sampling budget is unchanged (fewer tokens, even: a prefix is decoded once).

    fork step    the step of a trainable node whose first call's opening tokens (the first `OPENING` = 10) had the
                 highest mean surprisal (-log p): where the policy was least sure, as ARPO reads uncertainty
                 from the entropy of the first tokens; not the first token alone, which is a format word
                 ("Sub-goal:", "Operation:") every sample agrees on; the entry step qualifies too
    prefix       every call of the steps before the fork, by (node, turn, call index): the scheduler answers those
                 from the record (`EpisodeInput.replay`) instead of the backend; tools run again (so they must be
                 deterministic, as the shipped ones are)
    recorded     a sibling's `trace.meta["branch"] = {"root": root episode id, "fork_step": index}`

The siblings of one fork reach the fork step with the same rendered input, so step-level credit
(`trainers/credit.py`, `advantage: step | episode+step`) puts them, and the root, in one anchor-state group:
siblings compare with each other where they differ. Pure functions here; `runner.Runner.run_items` runs them.
"""

from __future__ import annotations

from masgraph.scheduler import EpisodeInput
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
