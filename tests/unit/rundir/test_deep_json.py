"""A JSON line nested 100k deep (issue 58 #7) is a bad line to every reader of a run directory, as a cut line is:
skipped and counted, never a RecursionError traceback (HEAD: watch, plot, train --resume and read_traces)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from masgraph.cli import main
from masgraph.rundir.layout import EVENTS, INDEX, METRICS
from masgraph.rundir.read import follow, read_json, read_jsonl, read_traces
from masgraph.trainers.checkpoints import truncate_metrics
from masgraph.watch.index import RunIndex

RECORDED = Path(__file__).parents[2] / "data" / "recorded" / "agentflow-run"
DEEP = b"[" * 100_000 + b"]" * 100_000 + b"\n"
STEPS = [{"step": s, "reward/mean": s / 10} for s in range(1, 4)]


def _deep_run(tmp_path: Path) -> Path:
    """The recorded run (6 episodes) with a deep line at the end of events.jsonl (the index holds offsets into it)
    and in the middle of episodes.jsonl, and a metrics.jsonl of 3 steps with one after the first."""
    run = Path(shutil.copytree(RECORDED, tmp_path / "run"))
    with open(run / EVENTS, "ab") as f:
        f.write(DEEP)
    lines = (run / INDEX).read_bytes().splitlines(keepends=True)
    (run / INDEX).write_bytes(b"".join(lines[:3] + [DEEP] + lines[3:]))
    rows = [json.dumps(r).encode() + b"\n" for r in STEPS]
    (run / METRICS).write_bytes(rows[0] + DEEP + b"".join(rows[1:]))
    return run


def test_readers_skip_and_count_a_deep_line(tmp_path):
    run = _deep_run(tmp_path)
    deep = len((run / EVENTS).read_bytes().splitlines())
    bad: list[int] = []
    assert len(list(read_traces(run, bad_lines=bad))) == 6 and bad == [deep]
    followed: list[int] = []
    assert sum(1 for _ in follow(run, bad_lines=followed)) == deep - 1 and followed == [deep]
    metrics: list[int] = []
    assert read_jsonl(run / METRICS, bad_lines=metrics) == STEPS and metrics == [2]
    (run / "summary.json").write_bytes(DEEP)
    assert read_json(run / "summary.json") is None


def test_watch_index_counts_a_deep_line_as_bad(tmp_path):
    run = _deep_run(tmp_path)
    index = RunIndex(run)
    index.poll()
    assert len(index.rows) == 6 and [m["step"] for m in index.metrics] == [1, 2, 3]
    assert index.bad_lines == {INDEX: 1, EVENTS: 1, METRICS: 1}
    assert index.trace(index.rows[-1]) is not None


def test_plot_and_resume_truncation_read_past_a_deep_line(tmp_path, capsys):
    run = _deep_run(tmp_path)
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "learning_curve.png")
    truncate_metrics(run / METRICS, 2)  # what `train --resume` from step 2 does
    assert (run / METRICS).read_bytes() == (json.dumps(STEPS[0]) + "\n").encode() + DEEP + \
        (json.dumps(STEPS[1]) + "\n").encode()  # the deep line is nobody's to delete


def test_export_and_topology_read_a_deep_config_json_without_a_traceback(tmp_path, capsys):
    from masgraph.cli.topology import run_task
    from masgraph.rundir.layout import CONFIG
    from masgraph.serve.bundle import _evaluation

    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG).write_bytes(DEEP)
    (run / METRICS).write_text(json.dumps({"step": 1, "accuracy/test": 0.5, "episodes/test": 4}) + "\n")
    evaluation = _evaluation(run, 1)  # the bundle's manifest: the metrics stand, the unreadable config adds nothing
    assert evaluation is not None and evaluation["accuracy"] == 0.5 and evaluation["task"] is None
    assert run_task(run) is None
    assert "config.json is unreadable" in capsys.readouterr().err
