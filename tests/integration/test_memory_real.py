"""The memory manager (issue 27, Memory-R1) on the embedded model: real rollouts of `graphs/memory.yaml` record one
operation per fact, each from its own call; the G samples share their first manager state; one Flow-GRPO update with
step credit per call trains the manager's adapter and nothing else."""

from __future__ import annotations

import pytest

from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.memory.store import parse_op
from masgraph.spec import SamplingSpec
from masgraph.tasks import MemoryUpdates
from masgraph.trainers.credit import call_state
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, build_rows

pytestmark = pytest.mark.integration


def shaped(runner_for, graph, backend, *, branch_width=0, counterfactual=None, counterfactual_probes=False,
           counterfactual_decisions=0, **config):
    """A runner (`runner_for`) whose runs are shaped as training shapes them (`masgraph.learn.rollouts`)."""
    from masgraph.learn.rollouts import RolloutShape, Shaped

    return Shaped(runner_for(graph, backend, **config),
                  RolloutShape(branch_width, counterfactual or {}, counterfactual_probes, counterfactual_decisions))


class AlternatingMemory(MemoryUpdates):
    """Real fact streams, a reward that varies in every group (odd samples win)."""

    name = "alternating_memory"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


def manager_at_t1(root):
    """The memory graph with its manager sampling at T 1.0 (8 tokens), a learner with its adapter, and a backend
    serving the learner's weights."""
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec, WeightSync

    spec = load_spec(root / "graphs" / "memory.yaml")
    policies = dict(spec.policies)
    policies["manager"] = policies["manager"].model_copy(update={"sampling": SamplingSpec(temperature=1.0,
                                                                                          max_tokens=8)})
    learner = HFLearner(dtype="float32")
    learner.add_adapter("memory", LoraConfigSpec())
    backend = HFBackend(learner.weights, max_batch_size=8)
    WeightSync(learner, [backend])()
    return compile_spec(spec.model_copy(update={"policies": policies})), learner, backend


@pytest.mark.slow
def test_one_update_with_call_level_credit_moves_the_manager_only(root, runner_for, run):
    graph, learner, backend = manager_at_t1(root)
    traces = run(runner_for(graph, backend, n=1, samples=4, concurrency=4).run_task(AlternatingMemory())).traces
    assert all(t.status == "ok" for t in traces) and {t.reward for t in traces} == {0.0, 1.0}

    facts = traces[0].query.splitlines()[:-1]
    for t in traces:
        mem = t.steps[0]
        assert [op.fact for op in mem.memory_ops] == facts and len(mem.llm) == len(facts)
        for op, call in zip(mem.memory_ops, mem.llm):
            assert op.output == call.text and call.adapter == "memory"
            try:  # what was applied is what the output says, or the documented fallback with its reason
                assert op.op == parse_op(call.text, op.fact).op or op.error
            except ValueError:
                assert op.op == "ADD" and "no operation" in op.error
    assert len({call_state("memory", t.steps[0].llm[0]) for t in traces}) == 1  # one shared first state

    trainable = {"memory": "memory"}
    rows = build_rows(traces, trainable, FlowGRPOConfig(credit={"advantage": "episode+step"}))
    assert len(rows) == sum(len(t.steps[0].llm) for t in traces)  # every manager call is a row; the reader none
    assert {r.adapter for r in rows} == {"memory"}
    algo = FlowGRPO(learner, trainable, FlowGRPOConfig(lr=2e-3, batching={"micro_batch": 8},
                                                       credit={"advantage": "episode+step"}))
    before = [p.detach().clone() for p in algo.params["memory"]]
    metrics = algo.update(traces)
    assert metrics["rows/trained"] == len(rows) > 0 and metrics["grad_norm/memory"] > 0
    assert any(not p.detach().equal(q) for p, q in zip(algo.params["memory"], before))
    assert learner.version("memory") == 1 and learner.adapters() == ["memory"]


@pytest.mark.slow
def test_counterfactual_credit_scores_every_decision_and_moves_the_manager(root, runner_for, run):
    """Real rollouts of the memory graph on `memory_updates` with counterfactual calls: every manager decision is
    re-scored by the real reader with each operation it did not write, and one update with those advantages (the
    operations not written teacher-forced too, `counterfactual.rows`) trains the manager's adapter."""
    from masgraph.learn.counterfactual import META
    from masgraph.trainers.credit import counterfactual_advantages

    ops = ["Operation: ADD", "Operation: UPDATE", "Operation: DELETE", "Operation: NOOP"]
    graph, learner, backend = manager_at_t1(root)
    runner = shaped(runner_for, graph, backend, n=1, samples=2, concurrency=16, counterfactual={"memory": ops})
    traces = run(runner.run_task(MemoryUpdates())).traces
    assert all(t.status == "ok" for t in traces)
    for t in traces:
        calls = t.steps[0].llm
        want = sum(4 - (c.text.strip() in ops) for c in calls)  # each call: the operations it did not write
        assert len(t.meta[META]) == want and {r for *_, r in t.meta[META]} <= {0.0, 1.0}
    cf = counterfactual_advantages(traces, {"memory": ops})
    assert len(cf) == sum(len(t.steps[0].llm) for t in traces)  # every decision has its advantage
    assert any(a != 0 for a in cf.values())  # and some decision changed the answer

    config = FlowGRPOConfig(lr=2e-3, batching={"micro_batch": 8},
                            counterfactual={"alternatives": {"memory": ops}, "rows": True})
    algo = FlowGRPO(learner, {"memory": "memory"}, config)
    rows = [r for r in build_rows(traces, {"memory": "memory"}, config, algo._encode) if r.advantage != 0]
    assert rows and all(r.adapter == "memory" for r in rows)
    alternatives = [r for r in rows if r.alternative is not None]  # the operations not written, teacher-forced
    assert alternatives and all(r.old_logprobs == [] for r in alternatives)
    stopped = [r for r in alternatives if traces[r.traj].steps[0].llm[r.call].finish_reason == "stop"]
    assert stopped and all(r.completion_ids[-1] == 2 for r in stopped)  # the call's own <|im_end|> ends them
    before = [p.detach().clone() for p in algo.params["memory"]]
    metrics = algo.update(traces)
    assert metrics["rows/trained"] == len(rows) and metrics["grad_norm/memory"] > 0
    assert any(not p.detach().equal(q) for p, q in zip(algo.params["memory"], before))


def test_counterfactual_decisions_scores_a_seeded_draw_of_the_real_managers_decisions(root, runner_for, run):
    """`counterfactual.decisions: 2` on real rollouts: each episode's two drawn decisions (of its five or more) are
    re-scored by the real reader with the operation they did not write, the others not at all, and a second run
    with the same seed draws the same decisions (the draw does not depend on what the manager wrote)."""
    from masgraph.backends.hf import HFBackend
    from masgraph.learn.counterfactual import META
    from masgraph.trainers.credit import counterfactual_advantages

    ops = {"memory": ["Operation: ADD", "Operation: NOOP"]}
    graph = compile_spec(load_spec(root / "graphs" / "memory.yaml"))  # greedy: the same record in both runs
    backend = HFBackend(max_batch_size=8)

    def drawn() -> list[set[tuple[int, int]]]:
        runner = shaped(runner_for, graph, backend, n=1, samples=2, concurrency=8, counterfactual=ops,
                            counterfactual_decisions=2, seed=3)
        traces = run(runner.run_task(MemoryUpdates())).traces
        assert all(t.status == "ok" and len(t.steps[0].llm) >= 5 for t in traces)
        for t in traces:
            refs = {(s, k) for s, k, *_ in t.meta[META]}
            # each drawn call: the operations it did not write (both, when it wrote another or no operation)
            want = sum(2 - (t.steps[0].llm[k].text.strip() in ops["memory"]) for _, k in refs)
            assert len(refs) == 2 and len(t.meta[META]) == want and {r for *_, r in t.meta[META]} <= {0.0, 1.0}
        assert len(counterfactual_advantages(traces, ops)) == 4  # two decisions an episode carry a decision term
        return [{(s, k) for s, k, *_ in t.meta[META]} for t in traces]

    first = drawn()
    assert all(len(refs) == 2 for refs in first) and drawn() == first


@pytest.mark.slow
def test_counterfactual_probes_score_every_decision_on_every_persons_question(root, runner_for, run):
    """With `counterfactual.probes` the real reader is also asked where each other person of the stream lives: every
    manager decision's scores (its own, and each operation it did not write) are means over the item's question and
    its two probes, the own one including the episode's reward; one update on those advantages moves the adapter."""
    from fractions import Fraction

    from masgraph.learn.counterfactual import META
    from masgraph.trainers.credit import counterfactual_advantages

    ops = {"memory": ["Operation: ADD", "Operation: NOOP"]}
    graph, learner, backend = manager_at_t1(root)
    task = MemoryUpdates()
    runner = shaped(runner_for, graph, backend, n=1, samples=2, concurrency=16, counterfactual=ops,
                        counterfactual_probes=True)
    traces = run(runner.run_task(task)).traces
    assert all(t.status == "ok" for t in traces) and len(task.probes(task.items("train", 1)[0])) == 2
    for t in traces:
        scored = {(s, k, alt.strip()): v for s, k, alt, v in t.meta[META]}
        for k, call in enumerate(t.steps[0].llm):
            own = scored[(0, k, call.text.strip())]  # the call's own score, recorded beside the alternatives'
            thirds = Fraction(own).limit_denominator(3) * 3
            assert thirds.denominator == 1 and 0 <= thirds - t.reward <= 2  # its own question's reward + 2 probes
            for alt in ops["memory"]:
                v = scored[(0, k, alt)] if alt != call.text.strip() else own
                assert (Fraction(v).limit_denominator(3) * 3).denominator == 1
    cf = counterfactual_advantages(traces, ops)
    assert len(cf) == sum(len(t.steps[0].llm) for t in traces) and any(a != 0 for a in cf.values())
    config = FlowGRPOConfig(lr=2e-3, batching={"micro_batch": 8},
                            counterfactual={"alternatives": ops, "advantage": "replace", "probes": True, "norm": True})
    # normalised (`counterfactual.norm`): the decisions' advantages have a mean square of 1 (those that are 0 get no
    # row), and each row is its call's A^C over the same factor
    rows = build_rows(traces, {"memory": "memory"}, config)
    assert sum(r.advantage ** 2 for r in rows) == pytest.approx(len(cf))
    ratios = {r.advantage / cf[(r.traj, r.step, r.call)] for r in rows}
    assert max(ratios) == pytest.approx(min(ratios)) and min(ratios) > 0
    algo = FlowGRPO(learner, {"memory": "memory"}, config)
    before = [p.detach().clone() for p in algo.params["memory"]]
    metrics = algo.update(traces)
    assert metrics["rows/trained"] > 0 and metrics["grad_norm/memory"] > 0
    assert any(not p.detach().equal(q) for p, q in zip(algo.params["memory"], before))
