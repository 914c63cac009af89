"""One definition of "correct" (the task's, recorded with the reward) for run, summary.json, watch and benchmarks;
numbers compared as numbers; failures reported by kind, apart from wrong answers (issue 30)."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from masgraph.agents.registry import register_agent
from masgraph.cli import ProgressBar, accuracy_line
from masgraph.graph import GraphBuilder
from masgraph.node import NodeOutput
from masgraph.runtime.runner import summarize
from masgraph.tasks import BasicArithmetic, Item, MixedRoutes, is_correct
from masgraph.trace import Step, Trace
from masgraph.watch.index import RunIndex
from masgraph.watch.render import status_line

GOLD = {"q-partial": "528", "q-float": "8", "q-exact": "7", "q-slow": "9", "q-boom": "10", "q-format": "11"}
"""Query -> gold answer; the agent below answers each as its name says."""


class Arith(BasicArithmetic):
    """basic_arithmetic's scorer (partial credit) on fixed items."""

    name = "arith-test"

    def generate(self, split, n, seed):
        return [Item(q, q, a, {"entry": {"answer": a}}) for q, a in GOLD.items()][:n]


class Lenient(Arith):
    """A task whose own verdict is not the default one: half marks count as correct."""

    name = "lenient-test"

    def correct(self, item, trace, reward=None):
        return trace.status == "ok" and (self.reward(item, trace) if reward is None else reward) >= 0.5


async def by_query(ctx):
    """Answers each of `GOLD`'s queries as its name says (any other query: "0")."""
    q = ctx.query
    if q == "q-slow":
        await asyncio.sleep(5)  # past the episode timeout
    if q == "q-boom":
        raise RuntimeError("boom")
    answer = {"q-partial": "-528", "q-float": "8.0", "q-exact": "7", "q-format": "11"}.get(q, "0")
    return NodeOutput(text=answer, answer=answer, parse_error="no Answer: line" if q == "q-format" else None)


@pytest.fixture
def graph():
    register_agent("by-query")(by_query)
    return (GraphBuilder("acc").add_policy("p", backend="scripted").add_node("solo", role="custom", agent="by-query")
            .set(limits={"episode_timeout_s": 0.5}).compile())


@pytest.mark.slow
def test_the_number_scorer_reads_8_0_as_8_and_partial_credit_is_not_correct():
    task = BasicArithmetic()
    eight = Item("i", "What is 3 + 5?", "8", {"entry": {"answer": "8"}})
    assert task.score(eight, "8.0") == 1.0 and task.score(eight, " 8 ") == 1.0  # reasoning-gym: 1/3 each
    assert task.score(eight, "8") == 1.0 and task.score(eight, "8.5") < 1.0 and task.score(eight, "80") < 1.0
    neg = Item("j", "What is 500 + 28?", "528", {"entry": {"answer": "528"}})
    trace = Trace(episode_id="e", item_id="j", query=neg.question, answer="-528")
    assert task.reward(neg, trace) == 0.75 and not task.correct(neg, trace)  # reward keeps partial credit
    compare = Item("c", "Which number is larger, 512 or 64?", "512", {"type": "compare"})
    assert MixedRoutes().score(compare, "The larger is 512.0") == 1.0


def test_summary_and_watch_count_the_same_correct_episodes_and_failures_by_kind(graph, runner_for, scripted, run):
    bar = ProgressBar(len(GOLD), stream=io.StringIO())
    result = run(runner_for(graph, scripted(), n=len(GOLD), concurrency=8).run_task(Arith(), sinks=[bar]))
    by_query = {t.query: t for t in result.traces}
    assert {q: t.status for q, t in by_query.items()}["q-slow"] == "timeout"
    assert by_query["q-boom"].status == "error"
    assert by_query["q-partial"].reward == 0.75 and by_query["q-float"].reward == 1.0
    assert [q for q, t in by_query.items() if is_correct(t)] == ["q-float", "q-exact", "q-format"]
    s = result.summary
    assert s["episodes"] == 6 and s["correct"] == 3 and s["accuracy"] == 0.5  # -528 for 528 is not correct
    assert s["finished"] == 4 and s["accuracy_finished"] == 0.75  # the timeout and the error are not wrong answers
    assert s["failures"] == {"timeout": 1, "error": 1, "cancelled": 0, "parse": 1}
    assert s["reward_mean"] == pytest.approx((0.75 + 1 + 1 + 1) / 6)
    assert s["status"] == {"ok": 4, "error": 1, "timeout": 1}  # kept as before for its readers
    stored = json.loads((result.run_dir / "summary.json").read_text())
    assert stored["accuracy_finished"] == 0.75 and stored["failures"] == s["failures"]

    index = RunIndex(result.run_dir)
    index.poll()
    assert index.n_correct == 3 and index.n_scored == 6 and index.n_finished == 4
    assert dict(index.failures) == {"timeout": 1, "error": 1, "parse": 1}
    header = status_line(index).plain
    assert "50% correct (75% of 4 finished)" in header and "failed: timeout 1, error 1, parse 1" in header

    assert bar.correct == 3  # the progress line counts the same episodes
    line = accuracy_line(s)
    assert "accuracy 0.500 (3/6)" in line and "of finished 0.750 (3/4)" in line
    assert "failures timeout 1, error 1, parse 1" in line


def test_a_tasks_own_verdict_is_recorded_and_watch_counts_it(graph, runner_for, scripted, run):
    result = run(runner_for(graph, scripted(), n=3).run_task(Lenient()))  # partial (0.75), float, exact
    assert result.summary["correct"] == 3 and all(t.meta["correct"] for t in result.traces)
    index = RunIndex(result.run_dir)
    index.poll()
    assert index.n_correct == 3 and [r.verdict for r in index.rows] == [True, True, True]


def test_a_trace_without_a_recorded_verdict_needs_full_reward():
    def trace(reward, status="ok", **meta):
        return Trace(episode_id="e", item_id="i", query="q", reward=reward, status=status, meta=meta)

    assert is_correct(trace(1.0)) and not is_correct(trace(0.75)) and not is_correct(trace(None))
    assert is_correct(trace(0.5, correct=True)) and not is_correct(trace(1.0, correct=False))
    assert not is_correct(trace(1.0, status="error", correct=True))
    s = summarize([trace(1.0), trace(0.75), trace(None, status="timeout"), trace(None, status="cancelled")],
                  planned=5)
    assert s["accuracy"] == pytest.approx(1 / 3) and s["accuracy_finished"] == 0.5  # was 2/3 (reward >= 0.5)
    assert s["failures"] == {"timeout": 1, "error": 0, "cancelled": 2, "parse": 0} and s["cancelled"] == 2
    scorer_failed = Trace(episode_id="e", item_id="i", query="q", error="reward failed: KeyError: 'x'",
                          steps=[Step(episode_id="e", index=0, node="n", role="custom", turn=1)])
    assert summarize([scorer_failed])["failures"]["error"] == 1 and summarize([scorer_failed])["finished"] == 0
    assert summarize([], planned=2) == {"episodes": 0, "cancelled": 2,
                                        "failures": {"timeout": 0, "error": 0, "cancelled": 2, "parse": 0}}


class ArithSplit(Arith):
    """`Arith`'s items held out; training asks other questions (the split rule keeps them apart)."""

    name = "arith-split-test"

    def generate(self, split, n, seed):
        if split == "test":
            return super().generate(split, n, seed)
        return [Item(f"t{i}", f"q-train-{i}", "0", {"entry": {"answer": "0"}}) for i in range(n)]


@pytest.mark.slow
def test_training_evaluation_and_the_exported_bundle_count_what_run_counts(tiny, tmp_path):
    """The same six held-out answers (partial credit, 8.0 for 8, a timeout, an error, a parse failure) through a
    training run's evaluation and the bundle exported from it: 3 of 6 correct, as `run`'s summary says above."""
    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec
    from masgraph.serve.bundle import export_bundle
    from masgraph.trainers.loop import TrainLoop

    register_agent("by-query")(by_query)
    text = f"""\
name: acc
policies:
  main: {{model: "{tiny}", adapter: main, trainable: true}}
nodes:
  solo: {{role: custom, agent: by-query, policy: main}}
entry: solo
exit: solo
limits: {{episode_timeout_s: 0.5}}
train: {{steps: 1, queries_per_step: 1, eval_every: 1, eval_n: 6, checkpoint_every: 1,
         flow_grpo: {{group_size: 2}}}}
"""
    (tmp_path / "acc.yaml").write_text(text)
    loop = TrainLoop(compile_spec(parse_spec(text, str(tmp_path / "acc.yaml")), str(tmp_path / "acc.yaml")),
                     ArithSplit(), tmp_path / "run", dtype="float32")
    last = asyncio.run(loop.run())
    assert last["accuracy/test"] == 0.5 and last["accuracy_finished/test"] == 0.75
    assert last["failures/test/timeout"] == 1 and last["failures/test/error"] == 1
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["accuracy/test"] for r in rows] == [0.5, 0.5]  # the untrained evaluation and the step's
    manifest = json.loads((export_bundle(tmp_path / "run", tmp_path / "bundle") / "manifest.json").read_text())
    assert manifest["evaluation"]["accuracy"] == 0.5 and manifest["evaluation"]["step"] == 1
