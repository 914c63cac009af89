"""Counterfactual calls: the variants of a finished episode with one decision (a call of a node that chooses among a
closed set of completions) replaced by each alternative, so a decision can be credited against the ones it did not
take (COMA's baseline, A = Q(s, a) - mean over a' of Q(s, a'), unbiased and non-zero where a group scored alike).

A variant replays the record up to and including the decision's step (`EpisodeInput.replay`) and runs the rest
afresh with the root's seeds; with probe questions (`Task.probes`) Q is the mean over the item's question and its
probes. A root's `trace.meta["counterfactual"]` holds `[step index, call index, completion, score]` per variant.
Pure functions; `rollouts.py` runs the variants, `trainers/credit.py` turns their scores into advantages.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from masgraph.runtime.scheduler import EpisodeInput
from masgraph.trace import LLMCall, Trace

__all__ = ["META", "CallRef", "as_made", "asked", "forced", "sampled", "variants"]

META = "counterfactual"
"""The root trace's meta key that holds its variants' scores."""

CallRef = tuple[int, int]
"""(step index, call index within the step) of a decision in a trace."""


def sampled(trace: Trace, alternatives: Mapping[str, Sequence[str]], k: int, key: str) -> set[CallRef] | None:
    """At most `k` of `trace`'s decisions (calls of a node in `alternatives`), drawn uniformly without replacement by
    a generator seeded with `key` (the same draw in every process and on resume); None: all of them (`k` is 0, or
    the episode has no more than `k`). Why: an episode's scoring costs an episode per decision and alternative, so
    long episodes would make a step's cost grow with their length; a uniform draw keeps each scored decision's
    estimate as it was, and the others get no counterfactual term (as an unscored call)."""
    refs = [(step.index, c) for step in trace.steps if step.node in alternatives for c in range(len(step.llm))]
    if k <= 0 or len(refs) <= k:
        return None
    return set(random.Random(key).sample(refs, k))


def variants(root: EpisodeInput, trace: Trace, alternatives: Mapping[str, Sequence[str]],
             only: Collection[CallRef] | None = None) -> list[tuple[CallRef, str, EpisodeInput]]:
    """One variant per decision of `trace` (a call of a node in `alternatives`; with `only`, those among them) and
    alternative that differs from what the call wrote; none for an episode that did not finish (its reward is not
    a return to compare with)."""
    if trace.status != "ok" or trace.reward is None:
        return []
    out = []
    for pos, step in enumerate(trace.steps):
        if step.node not in alternatives or not step.llm:
            continue
        before = _record(trace, pos)
        for k, call in enumerate(step.llm):
            if only is not None and (step.index, k) not in only:
                continue
            for alt in alternatives[step.node]:
                if alt.strip() == call.text.strip():
                    continue
                replay = {**before, (step.node, step.turn, k): forced(call, alt)}
                meta = {**root.meta, META: {"root": trace.episode_id, "step": step.index, "call": k}}
                out.append(((step.index, k), alt, EpisodeInput(root.item_id, root.query, root.sample, meta,
                                                              root.topology, root.choice, replay=replay)))
    return out


def forced(call: LLMCall, text: str) -> LLMCall:
    """`call` as if it had written `text` (no tokens: it is replayed, never trained on)."""
    return call.model_copy(update={"text": text, "completion_ids": [], "logprobs": [], "parse_error": None,
                                   "finish_reason": "stop"})


def as_made(root: EpisodeInput, trace: Trace, alternatives: Mapping[str, Sequence[str]],
            only: Collection[CallRef] | None = None) -> list[tuple[int, EpisodeInput]]:
    """(step index, episode input) per step of `trace` with decisions (calls of a node in `alternatives`; with
    `only`, a step with one among them): the episode replayed as recorded up to and including that step, the later
    nodes run afresh, so that its score with another question is the decisions' own Q beside their variants'; none
    for an episode that did not finish."""
    if trace.status != "ok" or trace.reward is None:
        return []
    steps = None if only is None else {step for step, _ in only}
    return [(step.index, replace(root, meta={**root.meta, META: {"root": trace.episode_id, "step": step.index}},
                                 replay=_record(trace, pos)))
            for pos, step in enumerate(trace.steps)
            if step.node in alternatives and step.llm and (steps is None or step.index in steps)]


def asked(episode: EpisodeInput, item_id: str, query: str, gold: str) -> EpisodeInput:
    """`episode` (a variant, or the episode as made) with another question in the query's place: a probe item's id,
    query and answer; the replayed record stays (the decisions before the question must not read it)."""
    return replace(episode, item_id=item_id, query=query, meta={**episode.meta, "gold": gold})


def _record(trace: Trace, pos: int) -> dict[tuple[str, int, int], LLMCall]:
    """Every call of `trace`'s steps up to and including position `pos`, keyed as `EpisodeInput.replay` is."""
    return {(s.node, s.turn, k): call for s in trace.steps[:pos + 1] for k, call in enumerate(s.llm)}
