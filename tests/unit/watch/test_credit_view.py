"""Issue 27: the advantage each training row was pushed by is recorded (`credit` lines in events.jsonl, one per
episode per step) and shown per call in `masgraph watch`'s episode view."""

from __future__ import annotations

import asyncio

import pytest

from masgraph.rundir.store import read_jsonl
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.loop import TrainLoop
from masgraph.watch.index import RunIndex
from masgraph.watch.render import step_text


class OddSamplesWin(BasicArithmetic):
    name = "odd_samples_win"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


def test_a_training_step_records_each_calls_advantage_and_the_episode_view_shows_it(one_node_graph, tmp_path):
    graph = one_node_graph("group_size: 4, lr: 0.01, credit: {advantage: episode+step}")
    loop = TrainLoop(graph, OddSamplesWin(), tmp_path / "run", dtype="float32")
    last = asyncio.run(loop.run())
    credits = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e.get("kind") == "credit"]
    assert len(credits) == 8 == last["rows/trained"]  # 2 queries x 4 samples, one call each: every call was a row
    # rewards 0,1,0,1 in each group: episode advantage -+0.866, the shared first state doubles it (w = 1)
    assert sorted({round(a, 3) for e in credits for _, _, a in e["calls"]}) == [-1.732, 1.732]
    assert all(e["step"] == 1 and [c[:2] for c in e["calls"]] == [[0, 0]] for e in credits)

    index = RunIndex(tmp_path / "run")
    index.poll()
    row = next(r for r in index.rows if r.id == credits[0]["episode_id"])
    [step] = index.trace(row).steps
    shown = step_text(step, credit=index.credits[row.id]).plain
    assert f"advantage {credits[0]['calls'][0][2]:+.2f}" in shown
    assert "advantage" not in step_text(step).plain  # a run without credit lines shows none
    assert index.credits[row.id] == {(0, 0): pytest.approx(credits[0]["calls"][0][2])}
