"""A training run remembers what it evaluated (issue 57 #11-#13): config.json names the task by a reference that loads
it again (a data file's path, not its name), each evaluation records how many held-out episodes it ran (fewer than
eval_n when the task holds out fewer) and stores them in the run marked as evaluation, so watch lists, filters and
opens them; the exported bundle's re-measure command reads both."""

from __future__ import annotations

import asyncio
import json

import pytest

from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.tasks import TaskSplitWarning, _digest, resolve_task

GRAPH = """\
name: evaluated
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{temperature: 1.0, max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{steps: 1, queries_per_step: 1, eval_every: 1, eval_n: 4, seed: 0, flow_grpo: {{group_size: 2}}}}
"""


class Phases:
    """A progress sink (as the CLI's TrainProgress): the phases the loop announces, with their episode totals."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    def phase(self, name: str, step: int, total: int) -> None:
        self.seen.append((name, step, total))

    def emit(self, event) -> None:
        pass


def _data(tmp_path, n: int):
    """n items none of which the 20 % hash share holds out: the file holds out 1 in 5 all the same."""
    for offset in range(10_000):
        qs = [f"{i + offset} + {i} ?" for i in range(n)]
        if all(_digest(q) % 10_000 >= 2_000 for q in qs):
            path = tmp_path / "arith.jsonl"
            path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in qs))
            return path
    raise AssertionError


@pytest.mark.slow  # a tiny model trains one step: ~5 s
def test_a_training_run_records_the_task_reference_and_stores_its_evaluations(tiny, tmp_path, monkeypatch):
    from masgraph.cli.topology import run_task
    from masgraph.rundir.store import read_traces
    from masgraph.serve.bundle import _evaluation
    from masgraph.trainers.loop import TrainLoop
    from masgraph.watch.index import RunIndex
    from masgraph.watch.table import select

    path = _data(tmp_path, 6)
    monkeypatch.chdir(tmp_path)
    task = resolve_task("data:arith.jsonl")  # as `--task data:arith.jsonl` gives it
    [held] = task.items("test", 4, 0)
    graph = compile_spec(parse_spec(GRAPH.format(model=tiny), "evaluated.yaml"))
    phases = Phases()
    with pytest.warns(TaskSplitWarning, match="holds out 1 item, fewer than train.eval_n 4: each evaluation runs"):
        loop = TrainLoop(graph, task, tmp_path / "run", dtype="float32", sinks=[phases])
    asyncio.run(loop.run())
    assert [total for name, _, total in phases.seen if name == "evaluation"] == [1, 1]  # progress: 0/1, not 0/4
    run = tmp_path / "run"

    config = json.loads((run / "config.json").read_text())["config"]
    assert config["task"] == f"data:{path}"  # not "arith", which no --task loads
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["episodes/test"]) for m in metrics] == [(0, 1.0), (1, 1.0)]  # not eval_n's 4

    stored = list(read_traces(run))
    evals = [t for t in stored if "evaluation" in t.meta]
    assert [(t.meta["evaluation"], t.episode_id.split("-")[0], t.query) for t in evals] == [
        (0, "eval0", held.question), (1, "eval1", held.question)]
    assert len(stored) - len(evals) == 2  # the one query's 2 rollouts

    index = RunIndex(run)
    index.poll()
    rows = select(index.rows, kind="evaluation")
    assert [r.evaluation for r in rows] == [0, 1] and len(select(index.rows, kind="rollouts")) == 2
    assert index.trace(rows[1]).query == held.question  # watch opens it

    measured = _evaluation(run, 1)
    assert measured["n"] == 1 and measured["command"] == f"masgraph run BUNDLE --task data:{path} --n 1 --deterministic"
    monkeypatch.chdir(tmp_path.parent)  # `masgraph topology RUN` from elsewhere loads the same task
    assert run_task(run).items("test", 4, 0) == [held]
