"""Step-level credit (trainers/credit.py) on real rollouts of the embedded model: the G samples of a query share
their first planner state (same prompt token ids), so with gamma 1 a first step's anchor advantage is its
episode's, and `episode+step` doubles it there; one Flow-GRPO update with it moves the planner's adapter."""

from __future__ import annotations

import pytest

from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.spec import SamplingSpec
from masgraph.tasks import Lookup
from masgraph.trainers.credit import state_key
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, build_rows

pytestmark = pytest.mark.integration


def shaped(runner_for, graph, backend, *, branch_width=0, counterfactual=None, counterfactual_probes=False,
           counterfactual_decisions=0, **config):
    """A runner (`runner_for`) whose runs are shaped as training shapes them (`masgraph.learn.rollouts`)."""
    from masgraph.learn.rollouts import RolloutShape, Shaped

    return Shaped(runner_for(graph, backend, **config),
                  RolloutShape(branch_width, counterfactual or {}, counterfactual_probes, counterfactual_decisions))


class AlternatingLookup(Lookup):
    """Real two-hop questions, a reward that varies in every group (odd samples win)."""

    name = "alternating_lookup"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


@pytest.mark.slow
def test_episode_plus_step_credit_on_real_rollouts_moves_the_planner(root, runner_for, run):
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec, WeightSync

    spec = load_spec(root / "graphs" / "agentflow.yaml")
    policies = dict(spec.policies)
    policies["planner"] = policies["planner"].model_copy(update={"sampling": SamplingSpec(temperature=1.0,
                                                                                          max_tokens=16)})
    graph = compile_spec(spec.model_copy(update={"policies": policies, "limits": spec.limits.model_copy(
        update={"max_turns": 2})}))
    learner = HFLearner(dtype="float32")
    learner.add_adapter("planner", LoraConfigSpec())
    backend = HFBackend(learner.weights, max_batch_size=8)
    WeightSync(learner, [backend])()
    traces = run(runner_for(graph, backend, n=1, samples=4, concurrency=4).run_task(AlternatingLookup())).traces
    assert all(t.status == "ok" for t in traces) and {t.reward for t in traces} == {0.0, 1.0}

    trainable = {"planner": "planner"}
    firsts = {state_key(t.steps[0]) for t in traces}
    assert len(firsts) == 1 and traces[0].steps[0].node == "planner"  # one shared first state
    episode = build_rows(traces, trainable, FlowGRPOConfig())
    both = build_rows(traces, trainable, FlowGRPOConfig(credit={"advantage": "episode+step"}))
    def first(rows):  # the rows of each trajectory's first planner call
        return {r.traj: r.advantage for r in rows if r.prompt_ids == traces[r.traj].steps[0].llm[0].prompt_ids}

    e, b = first(episode), first(both)
    assert e.keys() == b.keys() == {0, 1, 2, 3}
    assert all(b[i] == pytest.approx(2 * e[i]) for i in e)  # A^S = A^E in the shared first state

    algo = FlowGRPO(learner, trainable, FlowGRPOConfig(lr=2e-3, batching={"micro_batch": 4},
                                                       credit={"advantage": "episode+step"}))
    before = [p.detach().clone() for p in algo.params["planner"]]
    metrics = algo.update(traces)
    assert metrics["rows/trained"] == len(both) > 0 and metrics["grad_norm/planner"] > 0
    assert any(not p.detach().equal(q) for p, q in zip(algo.params["planner"], before))
    assert learner.version("planner") == 1


@pytest.mark.slow
def test_branched_siblings_share_the_roots_prefix_and_meet_it_at_the_fork(root, runner_for, run):
    """Branching (masgraph/branching.py) on real rollouts: each sibling's calls before the fork are its root's
    recorded calls, the fork step's input is the root's (one anchor-state group), and one update moves the
    adapters of the trainable nodes."""
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec, WeightSync

    spec = load_spec(root / "graphs" / "agentflow.yaml")
    hot = SamplingSpec(temperature=1.0, max_tokens=16)
    policies = {k: p.model_copy(update={"sampling": hot}) if p.trainable else p for k, p in spec.policies.items()}
    graph = compile_spec(spec.model_copy(update={"policies": policies, "limits": spec.limits.model_copy(
        update={"max_turns": 2})}))
    learner = HFLearner(dtype="float32")
    for adapter in ("planner", "verifier"):
        learner.add_adapter(adapter, LoraConfigSpec())
    backend = HFBackend(learner.weights, max_batch_size=8)
    WeightSync(learner, [backend])()
    traces = run(shaped(runner_for, graph, backend, n=1, samples=4, concurrency=4, branch_width=1)
                 .run_task(AlternatingLookup())).traces
    assert [t.meta["sample"] for t in traces] == [0, 2, 1, 3] and all(t.status == "ok" for t in traces)
    roots = {t.episode_id: t for t in traces if "branch" not in t.meta}
    for t in traces:
        if "branch" in t.meta:
            parent, fork = roots[t.meta["branch"]["root"]], t.meta["branch"]["fork_step"]
            assert parent.steps[fork].node in ("planner", "verifier")
            assert [s.llm for s in t.steps[:fork]] == [s.llm for s in parent.steps[:fork]]
            assert state_key(t.steps[fork]) == state_key(parent.steps[fork])  # the same input at the fork
    trainable = {"planner": "planner", "verifier": "verifier"}
    algo = FlowGRPO(learner, trainable, FlowGRPOConfig(lr=2e-3, batching={"micro_batch": 4},
                                                       credit={"advantage": "episode+step"}))
    before = {a: [p.detach().clone() for p in ps] for a, ps in algo.params.items()}
    metrics = algo.update(traces)
    assert metrics["rows/trained"] > 0
    moved = {a for a, ps in algo.params.items() if any(not p.detach().equal(q) for p, q in zip(ps, before[a]))}
    assert moved and moved <= {"planner", "verifier"}
