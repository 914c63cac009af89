"""Branching rollouts (masgraph/branching.py, ARPO's idea): the fork step, the replayed prefix, a runner's groups of
roots and siblings on the scripted backend, and siblings meeting in one anchor-state group at the fork."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from masgraph.backends.scripted import ScriptedBackend
from masgraph.graph import compile_spec
from masgraph.learn.branching import fork_step, replay_prefix
from masgraph.loader import load_spec
from masgraph.tasks import Item, Task
from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.credit import anchor_groups, state_key

SURPRISE = {"planner": -0.1, "executor": -5.0, "verifier": -2.0, "generator": -3.0}


def shaped(runner_for, graph, backend, *, branch_width=0, counterfactual=None, counterfactual_probes=False,
           counterfactual_decisions=0, **config):
    """A runner (`runner_for`) whose runs are shaped as training shapes them (`masgraph.learn.rollouts`)."""
    from masgraph.learn.rollouts import RolloutShape, Shaped

    return Shaped(runner_for(graph, backend, **config),
                  RolloutShape(branch_width, counterfactual or {}, counterfactual_probes, counterfactual_decisions))


class Surprised(ScriptedBackend):
    """The conftest replies, with a first-token log-prob per node: the verifier is the least sure trainable node
    (the executor and generator are less sure still, but not trainable in agentflow.yaml)."""

    async def complete(self, requests):
        out = await super().complete(requests)
        return [c.model_copy(update={"logprobs": [SURPRISE[r.key[1]]] + c.logprobs[1:]}) for r, c in zip(requests, out)]


class Sums(Task):
    name = "sums"

    def generate(self, split, n, seed):
        return [Item(f"q{i}", f"What is 2 + {i}?", str(2 + i)) for i in range(n)]

    def score(self, item, answer):
        return float(answer.strip() == item.answer)


def _step(node: str, turn: int, logprobs: list[float]) -> Step:
    calls = [LLMCall(policy="p", prompt_ids=[1], completion_ids=[2] * len(logprobs), logprobs=logprobs, text="x")]
    return Step(episode_id="e", index=0, node=node, role="planner", turn=turn, llm=calls if logprobs else [])


def test_the_fork_is_the_least_certain_opening_of_a_trainable_node():
    trace = Trace(episode_id="e", item_id="q", query="q", steps=[
        _step("planner", 1, [0.0, -4.0] + [0.0] * 8 + [-50.0]), _step("executor", 1, [-7.0]),
        _step("verifier", 1, [0.0, -1.0]), _step("planner", 2, [0.0, -1.0]), _step("generator", 1, [])])
    # mean surprisal of the opening 10 tokens: planner 0.4 (its 11th token is not counted; its certain first token,
    # a format word, does not hide the uncertain second), verifier 0.5, planner turn 2 0.5 (ties: the earlier)
    assert fork_step(trace, {"planner", "verifier"}) == 2
    assert fork_step(trace, {"planner"}) == 3
    assert fork_step(trace, {"executor"}) == 1
    assert fork_step(trace, {"generator"}) is None and fork_step(trace, set()) is None
    prefix = replay_prefix(trace, 3)
    assert list(prefix) == [("planner", 1, 0), ("executor", 1, 0), ("verifier", 1, 0)]
    assert prefix[("executor", 1, 0)] is trace.steps[1].llm[0]


def test_a_group_is_roots_each_followed_by_siblings_that_replay_up_to_the_fork(root, scripted, runner_for, run):
    graph = compile_spec(load_spec(root / "graphs" / "agentflow.yaml"))
    backend = Surprised(default=scripted()._default)
    runner = shaped(runner_for, graph, backend, n=2, samples=5, branch_width=1, concurrency=8)
    traces = run(runner.run_items(Sums(), Sums().items("train", 2))).traces
    assert [(t.item_id, t.meta["sample"]) for t in traces] == [  # 2 roots per item (5 // 2), the first takes 2
        ("q0", 0), ("q0", 2), ("q0", 3), ("q0", 1), ("q0", 4), ("q1", 0), ("q1", 2), ("q1", 3), ("q1", 1), ("q1", 4)]
    assert all(t.status == "ok" for t in traces)
    roots = {t.episode_id: t for t in traces if "branch" not in t.meta}
    assert len(roots) == 4
    for t in traces:
        if "branch" not in t.meta:
            continue
        parent = roots[t.meta["branch"]["root"]]
        fork = t.meta["branch"]["fork_step"]
        assert parent.item_id == t.item_id and parent.steps[fork].node == "verifier" and fork == 2
        assert [s.llm for s in t.steps[:fork]] == [s.llm for s in parent.steps[:fork]]  # replayed: the same calls
        assert [s.text for s in t.steps[:fork]] == [s.text for s in parent.steps[:fork]]  # and the same outputs
    # the backend decoded the prefix once per root: 4 roots' planner and executor calls, none for the 6 siblings
    nodes = [r.key[1] for r in backend.requests]
    assert nodes.count("planner") == nodes.count("executor") == 4 and nodes.count("verifier") == 10
    # at the fork, a root and its siblings saw the same input: one anchor-state group each
    groups = anchor_groups(traces, {("q0",): list(range(5))}, {"verifier"})
    assert sorted(len(g) for g in groups.values()) == [5]  # the scripted replies make every verifier input alike
    assert len({state_key(t.steps[2]) for t in traces[:5]}) == 1


def test_without_a_step_to_fork_at_siblings_are_independent_samples(root, scripted, runner_for, run):
    spec = load_spec(root / "graphs" / "single.yaml")
    frozen = {k: p.model_copy(update={"trainable": False, "adapter": None}) for k, p in spec.policies.items()}
    graph = compile_spec(spec.model_copy(update={"policies": frozen, "train": None}))  # nothing trainable to fork
    backend = scripted()
    traces = run(shaped(runner_for, graph, backend, n=1, samples=4, branch_width=3).run_items(
        Sums(), Sums().items("train", 1))).traces
    assert [t.meta["sample"] for t in traces] == [0, 1, 2, 3] and not any("branch" in t.meta for t in traces)
    assert len(backend.requests) == 4


@pytest.mark.parametrize("width", [0, 1])
def test_branching_keeps_the_group_size(root, scripted, runner_for, run, width):
    graph = compile_spec(load_spec(root / "graphs" / "agentflow.yaml"))
    traces = run(shaped(runner_for, graph, Surprised(default=scripted()._default), n=3, samples=4, branch_width=width)
                 .run_items(Sums(), Sums().items("train", 3))).traces
    assert [t.item_id for t in traces] == ["q0"] * 4 + ["q1"] * 4 + ["q2"] * 4
    assert sum("branch" in t.meta for t in traces) == (6 if width else 0)


def test_flow_grpo_branch_width_reaches_the_training_rollouts(one_node_graph, tmp_path):
    import asyncio

    from masgraph.rundir.store import read_traces
    from masgraph.tasks import BasicArithmetic
    from masgraph.trainers.loop import TrainLoop

    graph = one_node_graph("group_size: 4, lr: 0.01, branch_width: 1, batching: {zero_variance: keep}")
    loop = TrainLoop(graph, BasicArithmetic(), tmp_path / "run", dtype="float32")
    asyncio.run(loop.run())
    rollouts = [t for t in read_traces(tmp_path / "run") if "evaluation" not in t.meta]  # held-out ones aside
    assert len(rollouts) == 8 and sum("branch" in t.meta for t in rollouts) == 4  # 2 roots + 2 siblings per query
    for t in rollouts:
        if "branch" in t.meta:  # one node: the fork is the entry step, nothing replayed, a fresh sample
            assert t.meta["branch"]["fork_step"] == 0 and t.meta["sample"] >= 2


def test_branching_on_ray_rollout_workers_is_refused_with_the_fix(root, scripted, runner_for, run):
    from masgraph.errors import MasgraphError

    runner = shaped(runner_for, compile_spec(load_spec(root / "graphs" / "agentflow.yaml")), scripted(), n=1,
                    samples=4, branch_width=1)
    runner.runner.engine = SimpleNamespace(in_process=False)  # what Ray rollouts put there: not the driver's engine
    with pytest.raises(MasgraphError, match=r"branching rollouts .* Ray rollouts yet; set branch_width: 0"):
        run(runner.run_items(Sums(), Sums().items("train", 1)))
