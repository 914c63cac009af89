"""Training rollouts shaped for credit: branching (ARPO's forks, `branching.py`) and counterfactual scoring
(COMA-style variants, `counterfactual.py`), run through the generic runner's one extension point, so the runtime
knows nothing of either.

Example:
    >>> shape = RolloutShape(branch_width=1, counterfactual={"memory": ["Operation: ADD", "Operation: NOOP"]})
    >>> traces = (await run_rollouts(runner, task, items, shape)).traces   # `runner.config.samples` per item
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from masgraph.events import Sink
from masgraph.learn import branching, counterfactual
from masgraph.runtime.runner import RunContext, Runner, RunResult
from masgraph.runtime.scheduler import EpisodeInput
from masgraph.tasks import Item, Task
from masgraph.trace import Trace

__all__ = ["RolloutShape", "Shaped", "run_rollouts"]


@dataclass(frozen=True)
class RolloutShape:
    """How a training step's rollouts are shaped beyond items × samples (all off by default)."""

    branch_width: int = 0
    """Branching rollouts (`branching.py`): each item's samples are roots each followed by this many siblings
    forked at the root's least certain trainable step; 0: independent samples."""
    counterfactual: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Counterfactual calls (`counterfactual.py`): node -> the alternative completions of its calls; after the
    episodes every call of those nodes is re-scored with each alternative in its place, recorded on the root's
    `trace.meta["counterfactual"]`. Empty: off."""
    counterfactual_probes: bool = False
    """With `counterfactual`: score each decision on the task's probe questions too (`Task.probes`)."""
    counterfactual_decisions: int = 0
    """With `counterfactual`: score at most this many decisions of each episode (a seeded draw); 0: all."""

    @property
    def plain(self) -> bool:
        return not self.branch_width and not self.counterfactual


async def run_rollouts(runner: Runner, task: Task, items: list[Item], shape: RolloutShape,
                       sinks: Sequence[Sink] = (), store: bool = False) -> RunResult:
    """`runner.run_items` with `shape` applied (a plain run when the shape is plain). Branching and counterfactual
    scoring need the driver's own engine: on Ray rollout workers they are refused with the fix."""
    if shape.plain:
        return await runner.run_items(task, items, sinks, store)
    if shape.branch_width:
        runner.require_driver("branching rollouts (`branch_width`)", "set branch_width: 0, or train without --ray")
    if shape.counterfactual:
        runner.require_driver("counterfactual calls (`counterfactual`)",
                              "leave `counterfactual` empty, or train without --ray")
    return await runner.run_items(task, items, sinks, store, extension=_Extension(shape))


class Shaped:
    """A runner whose `run_items` / `run_task` apply a rollout shape (what a test or benchmark drives like a
    runner)."""

    def __init__(self, runner: Runner, shape: RolloutShape):
        self.runner, self.shape = runner, shape

    async def run_items(self, task: Task, items: list[Item], sinks: Sequence[Sink] = (),
                        store: bool = True) -> RunResult:
        return await run_rollouts(self.runner, task, items, self.shape, sinks, store)

    async def run_task(self, task: Task, sinks: Sequence[Sink] = (), store: bool = True) -> RunResult:
        c = self.runner.config
        return await self.run_items(task, task.items(c.split, c.n, c.seed), sinks, store)


class _Extension:
    """The runner extension (`runner.RunExtension`) that applies a `RolloutShape`."""

    def __init__(self, shape: RolloutShape):
        self.shape = shape

    def starts(self, samples: int) -> int:
        width = self.shape.branch_width
        return max(1, samples // (1 + width)) if width else samples

    async def extend(self, run: RunContext, episodes: list[EpisodeInput], traces: list[Trace]) -> list[Trace]:
        samples = run.runner.config.samples
        roots = self.starts(samples)
        if roots < samples:
            traces, episodes = await _branch(run, episodes, traces, roots, samples)
        if self.shape.counterfactual:
            await _counterfactuals(run, self.shape, episodes, traces)
        return traces


async def _branch(run: RunContext, roots: list[EpisodeInput], traces: list[Trace], per_item: int, samples: int
                  ) -> tuple[list[Trace], list[EpisodeInput]]:
    """Run each root's siblings (`branching.siblings`) so every item has `samples` episodes; returns every trace and
    episode with each item's kept together: a root, then its siblings."""
    nodes = set(run.runner.graph.spec.trainable_adapters())
    extra = samples - per_item
    kids: list[list[EpisodeInput]] = []
    for r, (ep, tr) in enumerate(zip(roots, traces)):
        j = r % per_item  # the root's place among its item's roots: the first ones take the remainder
        width = extra // per_item + (j < extra % per_item)
        first = per_item + j * (extra // per_item) + min(j, extra % per_item)
        kids.append(branching.siblings(ep, tr, nodes, width, first))
    done = iter(await run.scheduler.run([k for ks in kids for k in ks]))
    out_traces, out_eps = [], []
    for ep, tr, ks in zip(roots, traces, kids):
        out_eps += [ep, *ks]
        out_traces += [tr, *(next(done) for _ in ks)]
    return out_traces, out_eps


async def _counterfactuals(run: RunContext, shape: RolloutShape, episodes: list[EpisodeInput],
                           traces: list[Trace]) -> None:
    """Score every decision of the finished episodes (with `counterfactual_decisions`, a draw of them) with each
    alternative in its place (their variants run on a scheduler of their own: scored, not stored or shown) and
    record `[step, call, alternative, score]` on each root's meta. A variant that fails scores 0, as a failed
    episode does. Their greedy calls are memoised: most variants show a frozen reader an input another variant
    already showed it. With `counterfactual_probes`, each variant and each step as made is also asked the item's
    probe questions (`Task.probes`) and a score is the mean over the item's question and its probes; the call's
    own mean is recorded too."""
    cf = counterfactual
    runner, task, by_id = run.runner, run.task, run.items
    alternatives = {node: list(alts) for node, alts in shape.counterfactual.items()}
    seed = runner.config.seed
    # (trace, call ref, completion, episode to score, whether the completion is the call's own)
    todo: list[tuple[Trace, tuple[int, int], str, EpisodeInput, bool]] = []
    probes: dict[str, list[Item]] = {}
    for root, tr in zip(episodes, traces):
        only = cf.sampled(tr, alternatives, shape.counterfactual_decisions, key=f"{seed}/{root.item_id}/{root.sample}")
        todo += [(tr, ref, alt, ep, False) for ref, alt, ep in cf.variants(root, tr, alternatives, only)]
        if shape.counterfactual_probes:
            if root.item_id not in probes:
                probes[root.item_id] = task.probes(by_id[root.item_id])
            made = dict(cf.as_made(root, tr, alternatives, only))
            todo += [(tr, (step.index, k), call.text, made[step.index], True) for step in tr.steps
                     if step.index in made for k, call in enumerate(step.llm)
                     if only is None or (step.index, k) in only]
    if not todo:
        return
    runs: list[tuple[int, EpisodeInput]] = []  # (index in todo, an episode to score)
    for i, (_, _, _, ep, own) in enumerate(todo):
        if not own:  # the item's own question (the call's own completion: the trace's reward says it)
            runs.append((i, ep))
        runs += [(i, cf.asked(ep, p.id, p.question, p.answer)) for p in probes.get(ep.item_id, [])]
    scoring = {**by_id, **{p.id: p for ps in probes.values() for p in ps}}
    sched = runner.engine.scheduler((), runner.scorer(task, scoring), concurrency=runner.config.concurrency,
                                    seed=seed, memo_greedy=True)
    done = await sched.run([ep for _, ep in runs])
    scores = [[tr.reward or 0.0] if own else [] for tr, *_, own in todo]
    for (i, _), out in zip(runs, done):
        scores[i].append(out.reward if out.status == "ok" and out.reward is not None else 0.0)
    for tr in traces:
        tr.meta[cf.META] = []
    for (tr, (step, call), completion, _, _), got in zip(todo, scores):
        tr.meta[cf.META].append([step, call, completion, sum(got) / len(got)])
