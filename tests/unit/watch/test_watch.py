"""`masgraph watch`: the run index, the views (Textual pilot on recorded real-model run dirs), live following,
damaged files, SVG snapshots, and the CLI's errors."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies
from rich.console import Console

from masgraph.rundir.store import INDEX, RunStore, read_traces
from masgraph.watch.app import EpisodeScreen, EpisodeTable, WatchApp
from masgraph.watch.index import RunIndex

pytestmark = pytest.mark.anyio  # the async tests run on anyio's pytest plugin, on asyncio

RECORDED = Path(__file__).parents[2] / "data" / "recorded"
SNAPSHOTS = Path(__file__).parents[2] / "snapshots" / "watch"
UPDATE = os.environ.get("MASGRAPH_UPDATE_SNAPSHOTS") == "1"
SIZE = (80, 24)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def run_dir(tmp_path):
    """The recorded real-model run (agentflow, 6 episodes on basic_arithmetic), copied."""
    return Path(shutil.copytree(RECORDED / "agentflow-run", tmp_path / "agentflow-run"))


@pytest.fixture
def train_dir(tmp_path):
    """The recorded real-model joint training run (router graph, 3 steps, topology + adapters), copied."""
    return Path(shutil.copytree(RECORDED / "router-train", tmp_path / "router-train"))


def screen_text(app: WatchApp) -> str:
    """What the terminal shows, as plain text."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), force_terminal=True,
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def check_snapshot(pilot, app: WatchApp, name: str, settle_s: float = 10.0) -> None:
    """The screen's SVG equals the stored one (MASGRAPH_UPDATE_SNAPSHOTS=1 rewrites it; review the diff).

    A loaded machine may still be painting after one pause (a view fills in from its own timer), so the screen
    is re-read every 50 ms for up to `settle_s` until it matches; what it shows last is what is compared.
    """
    path = SNAPSHOTS / f"{name}.svg"
    expected = None if UPDATE or not path.exists() else path.read_text()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s
    while True:
        svg = app.export_screenshot(title=f"masgraph watch: {name}")
        if expected is None or svg == expected or loop.time() > deadline:
            break
        await pilot.pause(0.05)
    if expected is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(svg)
        if not UPDATE:
            pytest.fail(f"no snapshot {path} yet: written now; review it and commit it")
    assert svg == expected or UPDATE, (f"the {name} view changed; if intended, rerun with "
                                       f"MASGRAPH_UPDATE_SNAPSHOTS=1 and review {path}")


# -- the index ----------------------------------------------------------------------------------------------

def test_the_index_holds_every_episode_of_a_recorded_run_and_reads_each_back(run_dir):
    index = RunIndex(run_dir)
    assert index.poll() and index.indexed and index.ended
    traces = list(read_traces(run_dir))
    assert [r.id for r in index.rows] == [t.episode_id for t in traces]
    for row, trace in zip(index.rows, traces, strict=True):
        assert index.trace(row) == trace  # the byte range holds the whole episode
        assert (row.tokens, row.turns, row.reward) == (trace.completion_tokens, trace.turns, trace.reward)
    stats = index.node_stats()
    for node in ("planner", "executor", "verifier", "generator"):
        steps = [s for t in traces for s in t.steps if s.node == node]
        assert stats[node].calls == len(steps)
        assert stats[node].tokens == sum(len(c.completion_ids) for s in steps for c in s.llm)
    edges = index.edge_counts()
    assert edges[("planner", "executor")] == 6 and edges[("verifier", "generator")] == 6
    assert sum(edges.values()) == sum(len(s.sources) for t in traces for s in t.steps)
    assert not index.poll()  # nothing new


def test_an_episode_id_with_quotes_and_non_ascii_reads_back(tmp_path):
    from masgraph.events import EpisodeFinished, EpisodeStarted, StepFinished
    from masgraph.trace import Step, Trace

    store = RunStore(tmp_path / "r", spec=None, config={})
    for eid in ('naïve-"q"-0', "plain-1"):
        store.emit(EpisodeStarted(episode_id=eid, item_id="i", query="q"))
        step = Step(episode_id=eid, index=0, node="solo", role="generator", turn=1, text="4")
        store.emit(StepFinished(step=step))
        store.emit(EpisodeFinished(trace=Trace(episode_id=eid, item_id="i", query="q", steps=[step])))
    store.close({})
    index = RunIndex(tmp_path / "r")
    index.poll()
    assert [r.id for r in index.rows] == ['naïve-"q"-0', "plain-1"]
    assert [index.trace(r).steps[0].text for r in index.rows] == ["4", "4"]  # type: ignore[union-attr]


def test_text_only_calls_count_the_servers_tokens_in_every_view(tmp_path):
    """A litellm call has no ids: the row's tokens (from the index, and from events.jsonl alone for a run without
    one) and the step view show the counts the server reported, and no log-probs that are not there."""
    from masgraph.events import EpisodeFinished, EpisodeStarted, StepFinished
    from masgraph.trace import LLMCall, Step, Trace
    from masgraph.watch.render import step_text

    call = LLMCall(policy="api", prompt_ids=[], completion_ids=[], logprobs=[], text="4", prompt_tokens=31,
                   completion_tokens=7)
    step = Step(episode_id="e0", index=0, node="solo", role="generator", turn=1, text="4", llm=[call])
    store = RunStore(tmp_path / "r", spec=None, config={})
    store.emit(EpisodeStarted(episode_id="e0", item_id="i", query="q"))
    store.emit(StepFinished(step=step))
    store.emit(EpisodeFinished(trace=Trace(episode_id="e0", item_id="i", query="q", steps=[step])))
    store.close({})
    index = RunIndex(tmp_path / "r")
    index.poll()
    assert [r.tokens for r in index.rows] == [7] and index.trace(index.rows[0]).llm_calls == [call]
    (tmp_path / "r" / INDEX).unlink()  # as a run from before the index (schema v2)
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    (tmp_path / "r" / "config.json").write_text(json.dumps(cfg | {"event_schema_version": 2}))
    old = RunIndex(tmp_path / "r")
    old.poll()
    assert not old.indexed and [r.tokens for r in old.rows] == [7]
    text = step_text(step, decode=lambda ids: "", show_prompt=True).plain
    assert "31 tokens (as the server counted" in text and "(7 tokens, api v0)" in text and "log-prob" not in text


def test_a_run_dir_from_before_the_index_reads_the_same(run_dir):
    """Schema v2 wrote no episodes.jsonl: rows, counts and edges then come from events.jsonl alone."""
    new = RunIndex(run_dir)
    new.poll()
    (run_dir / INDEX).unlink()
    cfg = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(cfg | {"event_schema_version": 2}))
    old = RunIndex(run_dir)
    old.poll()
    assert not old.indexed
    assert [(r.id, r.status, r.reward, r.tokens, r.turns) for r in old.rows] == [
        (r.id, r.status, r.reward, r.tokens, r.turns) for r in new.rows]
    assert old.node_stats() == new.node_stats() and old.edge_counts() == new.edge_counts()
    assert old.trace(old.rows[2]) == new.trace(new.rows[2])


def test_damaged_files_show_what_they_can_with_a_warning(run_dir):
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(b'{"v":3,"kind":"step_started","episode_id":"x","node":"planner"}\nnot json\n{"v":3,"kind":"st')
    with open(run_dir / INDEX, "ab") as f:
        f.write(b'{"id": "cut"\n[1, 2]\n')
    metrics = run_dir / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    index = RunIndex(run_dir)
    index.poll()
    assert len(index.rows) == 6 and len(index.metrics) == 1
    text = " ".join(index.warnings)
    assert "episodes.jsonl: 2 bad lines" in text and "events.jsonl: 2 bad lines" in text
    assert "half a line" in text


async def test_a_damaged_run_opens_with_the_warning_on_screen(run_dir):
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(b"garbage\n")
    (run_dir / INDEX).write_bytes((run_dir / INDEX).read_bytes()[:-40])  # the last index line cut
    app = WatchApp(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        text = screen_text(app)
        assert "⚠" in text and "bad line" in text
        assert "5/5 episodes" in text  # the cut index line is left out, the others shown


def test_an_unknown_directory_is_a_clear_error(tmp_path):
    from masgraph.errors import MasgraphError

    with pytest.raises(MasgraphError, match="no run directory"):
        RunIndex(tmp_path / "nope")
    with pytest.raises(MasgraphError, match="not a run directory"):
        RunIndex(tmp_path)


# -- the views on recorded real-model runs ------------------------------------------------------------------

async def test_graph_view_shows_nodes_counts_and_edges(run_dir):
    app = WatchApp(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("1")
        await pilot.pause()
        text = screen_text(app)
        assert "agentflow-run run ended 6 done" in text
        for node in ("planner", "executor", "verifier", "generator"):
            assert f"{node}  {node}" in text  # name and role
        assert "calls 6 · 2.26 s · 110 tok · 0 parse ✗ · 0 err" in text  # planner, from the recorded steps
        assert "→ executor ×6" in text and "→ planner [continue] ×0" in text and "→ generator [stop] ×6" in text
        await check_snapshot(pilot, app, "graph")


@pytest.mark.slow
async def test_episodes_view_lists_filters_searches_and_sorts(run_dir):
    app = WatchApp(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        await pilot.pause()
        text = screen_text(app)
        assert "6/6 episodes · filter all · sort finished" in text
        assert "episode" in text and "status reward turns tokens" in text
        assert text.count("wrong") == 5 and text.count("correct") >= 1
        await check_snapshot(pilot, app, "episodes")
        table = app.query_one(EpisodeTable)
        await pilot.press("f")  # failed
        assert len(table.rows) == 0 and "0/6 episodes · filter failed" in screen_text(app)
        await pilot.press("f")  # correct
        assert [r.seq for r in table.rows] == [2]
        await pilot.press("f", "f")  # wrong, then all
        await pilot.press("s")  # by reward, largest first
        assert table.rows[0].reward == 1.0 and "sort reward ↓" in screen_text(app)
        await pilot.press("s", "r")  # tokens, smallest first
        assert [r.tokens for r in table.rows] == sorted(r.tokens for r in app.index.rows)
        await pilot.press("slash", *"test-323290510-12", "enter")
        await pilot.pause()
        assert len(table.rows) == 1 and "search “test-323290510-12”" in screen_text(app)
        await pilot.press("slash", "escape")
        await pilot.pause()
        assert len(table.rows) == 6


@pytest.mark.slow
async def test_episode_view_shows_the_step_timeline_prompts_and_token_logprobs(run_dir):
    app = WatchApp(run_dir)
    async with app.run_test(size=(100, 60)) as pilot:
        await pilot.press("2", "down", "down", "enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, EpisodeScreen) and screen.row.seq == 2
        await app.workers.wait_for_complete()
        await pilot.pause()
        text = screen_text(app)
        assert "status ok · reward 1.00" in text and "answer 386" in text
        assert "#0 planner (planner) turn 1 → route calculator" in text
        assert "#1 executor (executor) turn 1 ← planner → route ok" in text
        assert "tool   calculator(-60 * -7 + -34)" in text and "→ 386" in text
        assert "▸ 347 tokens, p to unfold" in text
        assert "tokens decoded with smollm2-135m's tokenizer" in text
        await pilot.press("p")
        text = screen_text(app)
        assert "<|im_start|>system" in text and "You are the planner" in text
        planner = screen.query(".step").first()
        plain = len(planner.render().spans)  # type: ignore[attr-defined]
        await pilot.press("l")
        await pilot.pause()
        coloured = planner.render().spans  # type: ignore[attr-defined]
        assert len(coloured) >= plain + 19  # one coloured span per output token (19 in the planner's output)
        assert len({str(s.style) for s in coloured[plain:]}) >= 2  # likely and unlikely tokens differ
        await pilot.press("escape")
        assert not isinstance(app.screen, EpisodeScreen)


@pytest.mark.slow
async def test_episode_view_snapshot(run_dir):
    app = WatchApp(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2", "down", "down", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        await check_snapshot(pilot, app, "episode")


@pytest.mark.slow
async def test_training_view_shows_curves_progress_nodes_checkpoints(train_dir):
    app = WatchApp(train_dir)
    async with app.run_test(size=(100, 70)) as pilot:
        await pilot.pause()
        text = screen_text(app)  # a training run opens on the training view
        assert "router-train train ended 24 done" in text
        assert "step 3/3" in text and "100%" in text
        for key in ("reward/mean", "accuracy/train", "accuracy/test", "kl/ref_k3", "loss/total", "loss/clip_frac",
                    "tokens_per_s", "grad_norm/planner", "grad_norm/verifier", "topology/entropy"):
            assert key in text
        assert "accuracy/test 0.5" in text
        assert "planner     planner   planner" in text and "verifier    verifier  verifier" in text
        assert "checkpoints  step-3 (planner v3,verifier v3)" in text
        await pilot.press("1")
        await pilot.pause()
        text = screen_text(app)
        assert "Topology after step 3 (metrics.jsonl: each option's probability" in text  # says what it is
        assert "choice:planner" in text and "python          0.62" in text


@pytest.mark.slow
async def test_training_view_snapshot(train_dir):
    app = WatchApp(train_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await check_snapshot(pilot, app, "training")


async def test_help_lists_the_keys(run_dir):
    app = WatchApp(run_dir)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        text = screen_text(app)
        assert "search (id, item, query, answer" in text and "filter: all → failed → correct → wrong" in text
        await check_snapshot(pilot, app, "help")
        await pilot.press("escape")
        assert "search (id, item" not in screen_text(app)


# -- live ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_appended_events_appear_while_the_app_runs(run_dir, tmp_path):
    """A run written while the app watches: a running step lights its node, finished episodes join the table."""
    live = tmp_path / "live"
    live.mkdir()
    for name in ("spec.yaml", "config.json"):
        shutil.copy(run_dir / name, live)
    events = (run_dir / "events.jsonl").read_bytes().splitlines(keepends=True)
    index_lines = (run_dir / INDEX).read_bytes().splitlines(keepends=True)
    first_end = json.loads(index_lines[0])["end"]
    app = WatchApp(live, poll_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("1")
        await pilot.pause()
        assert "0 done" in screen_text(app) and "● live" in screen_text(app)
        with open(live / "events.jsonl", "ab") as f:  # up to the first step_started
            for line in events:
                f.write(line)
                if b'"kind":"step_started"' in line:
                    break
        await pilot.pause(0.3)
        text = screen_text(app)
        assert "1 running" in text and "● 1 running" in text  # planner lit
        with open(live / "events.jsonl", "ab") as f:
            f.write(b"".join(events)[f.tell():first_end])
        with open(live / INDEX, "ab") as f:
            f.write(index_lines[0])
        await pilot.pause(0.3)
        assert "1 done" in screen_text(app)
        with open(live / "events.jsonl", "ab") as f:
            f.write(b"".join(events)[first_end:])
        with open(live / INDEX, "ab") as f:
            f.writelines(index_lines[1:])
        (live / "summary.json").write_text("{}")
        await pilot.pause(0.3)
        await pilot.press("2")
        text = screen_text(app)
        assert "6/6 episodes" in text and "ended" in text and "running" not in text


@pytest.mark.slow
async def test_a_store_written_live_is_followed(tmp_path):
    """The RunStore writer and the app in one process: what the store writes shows up."""
    from masgraph.events import EpisodeFinished, EpisodeStarted, StepFinished, StepStarted
    from masgraph.trace import Step, Trace

    store = RunStore(tmp_path / "r", spec=None, config={})
    app = WatchApp(tmp_path / "r", poll_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("2")
        for i in range(3):
            eid = f"e{i}"
            store.emit(EpisodeStarted(episode_id=eid, item_id=f"i{i}", query=f"q{i}"))
            store.emit(StepStarted(episode_id=eid, node="solo", turn=1))
            step = Step(episode_id=eid, index=0, node="solo", role="generator", turn=1, text="4")
            store.emit(StepFinished(step=step))
            store.emit(EpisodeFinished(trace=Trace(episode_id=eid, item_id=f"i{i}", query=f"q{i}", steps=[step],
                                                   answer="4", reward=float(i % 2))))
            await pilot.pause(0.2)
            assert f"{i + 1}/{i + 1} episodes" in screen_text(app)
        store.close({})
        await pilot.pause(0.2)
        assert "ended" in screen_text(app)
        assert app.index.node_stats()["solo"].calls == 3


# -- the command line ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_watch_without_a_terminal_is_an_error_line(run_dir):
    for argv in (["watch", str(run_dir)], ["watch", str(run_dir / "nope")],
                 ["run", "graphs/agentflow.yaml", "--task", "basic_arithmetic", "--watch"]):
        p = subprocess.run([sys.executable, "-m", "masgraph.cli", *argv], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=120, cwd=Path(__file__).parents[3])
        assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert "interactive terminal" in p.stderr


# -- unreadable, malformed and large run files ---------------------------------------------------------------

def _make(path: Path, kind: str) -> None:
    """Put a FIFO, a directory or a symlink loop where a run file should be."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(path.name)  # points at itself


@pytest.mark.parametrize("name, kind, says", [
    ("events.jsonl", "fifo", "is a FIFO (named pipe), not a regular file"),
    ("events.jsonl", "directory", "is a directory, not a regular file"),
    ("events.jsonl", "loop", "cannot read {path}: Too many levels of symbolic links"),
    ("episodes.jsonl", "directory", "is a directory, not a regular file"),
    ("metrics.jsonl", "fifo", "is a FIFO (named pipe), not a regular file"),
])
def test_a_run_file_that_is_not_a_regular_file_is_an_error_line_up_front(run_dir, capsys, name, kind, says):
    """HEAD: the app opened it while drawing: a FIFO hung it (q did nothing), a directory or a loop crashed it
    with a traceback and exit code 0."""
    from masgraph.cli import main

    _make(run_dir / name, kind)
    assert main(["watch", str(run_dir)]) == 2  # before the terminal check: no TTY needed
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says.format(path=run_dir / name) in err and str(run_dir / name) in err
    assert "interactive terminal" not in err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.json", "spec.yaml"])
def test_a_fifo_read_when_the_index_opens_is_an_error_line_not_a_hang(run_dir, name):
    """HEAD: RunIndex() read config.json / spec.yaml whole: blocked on a FIFO for ever (a subprocess here, so a
    regression fails at the timeout instead of hanging the suite)."""
    _make(run_dir / name, "fifo")
    p = subprocess.run([sys.executable, "-m", "masgraph.cli", "watch", str(run_dir)], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=120, cwd=Path(__file__).parents[3])
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert f"{run_dir / name} is a FIFO (named pipe), not a regular file" in p.stderr


def test_a_fifo_that_appears_while_watching_is_an_error_not_a_hang(run_dir):
    import threading

    from masgraph.errors import MasgraphError

    index = RunIndex(run_dir)
    index.poll()
    os.mkfifo(run_dir / "metrics.jsonl")
    outcome: list[BaseException | bool] = []

    def poll() -> None:
        try:
            outcome.append(index.poll())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # HEAD: open() waits for a writer; be one, to free the thread
        os.close(os.open(run_dir / "metrics.jsonl", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("poll() blocked on a FIFO")
    assert isinstance(outcome[0], MasgraphError) and "is a FIFO" in str(outcome[0])


async def test_a_run_file_unreadable_while_the_app_runs_ends_it_with_an_error(run_dir):
    """The app stops with exit code 2 and keeps the error for `watch` to report once the terminal is back;
    HEAD: IsADirectoryError in the app's timer (a traceback, exit code 0 from the CLI)."""
    app = WatchApp(run_dir, poll_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        (run_dir / "events.jsonl").unlink()
        (run_dir / "events.jsonl").mkdir()
        for _ in range(200):  # until a tick has read it (the app then exits)
            await pilot.pause(0.05)
            if app.error is not None:
                break
    assert app.return_code == 2 and "events.jsonl is a directory" in str(app.error)


def test_watch_raises_the_apps_error_and_exits_non_zero_after_a_crash(run_dir, monkeypatch):
    """HEAD: `watch` returned 0 whatever the app's end (a crash printed a traceback, then exit code 0)."""
    import masgraph.watch
    from masgraph.errors import MasgraphError

    monkeypatch.setattr(masgraph.watch, "require_terminal", lambda: None)
    ends = {"crash": lambda app: setattr(app, "_return_code", 1),
            "error": lambda app: setattr(app, "error", MasgraphError("events.jsonl is a FIFO"))}
    monkeypatch.setattr(WatchApp, "run", lambda self: ends["crash"](self))
    assert masgraph.watch.watch(run_dir) == 1
    monkeypatch.setattr(WatchApp, "run", lambda self: ends["error"](self))
    with pytest.raises(MasgraphError, match="events.jsonl is a FIFO"):
        masgraph.watch.watch(run_dir)


def test_a_string_event_schema_version_is_an_error_line(run_dir, capsys):
    """HEAD: TypeError traceback ('>=' not supported between 'str' and 'int')."""
    from masgraph.cli import main

    cfg = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(cfg | {"event_schema_version": "3"}))
    assert main(["watch", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'config.json'}: event_schema_version is '3', not a whole number")


async def test_a_spec_yaml_that_is_not_utf8_is_left_out_with_a_warning(run_dir):
    """The run is still shown (nodes as the steps name them), the reason on screen; HEAD: UnicodeDecodeError
    traceback from RunIndex()."""
    (run_dir / "spec.yaml").write_bytes(b"name: \xff\xfe\n")
    app = WatchApp(run_dir)
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("1")
        await pilot.pause()
        text = screen_text(app)
        assert "spec.yaml not used (the file is not UTF-8 text (byte 0xff), line 1)" in text
        assert "(no readable spec.yaml: nodes as the steps name them)" in text and "planner" in text


@pytest.mark.slow
async def test_malformed_metric_and_index_lines_are_skipped_and_counted(train_dir):
    """Lines whose fields have the wrong type are bad lines like cut ones; HEAD: ValueError / TypeError /
    OverflowError tracebacks from the training view, the table or the index."""
    metrics = train_dir / "metrics.jsonl"
    good = len(metrics.read_text().splitlines())
    with open(metrics, "a") as f:
        for bad in ({"step": "two", "reward/mean": 0.7}, {"step": 9, "reward/mean": "high"}, {"step": 1.5},
                    {"step": True}, {"step": 9, "grad_norm/planner": [1]}, {"step": 9, "topology/p/route/x": "p"}):
            f.write(json.dumps(bad) + "\n")
        f.write(json.dumps({"step": 9, "reward/mean": 0.5, "accuracy/test": None}) + "\n")  # null: not measured
    line = json.loads((train_dir / INDEX).read_text().splitlines()[0])
    with open(train_dir / INDEX, "a") as f:
        for field, value in (("id", 7), ("reward", "1"), ("query", None), ("steps", [["planner", None, 0, "x", 1.0,
                                                                                        []]])):
            f.write(json.dumps(line | {field: value}) + "\n")
        f.write(json.dumps(line | {"id": "inf"})[:-1] + ', "tokens": Infinity}\n')
    index = RunIndex(train_dir)
    index.poll()
    assert index.bad_lines == {"metrics.jsonl": 6, INDEX: 5}
    assert len(index.metrics) == good + 1 and "accuracy/test" not in index.metrics[-1]
    app = WatchApp(train_dir)
    async with app.run_test(size=(120, 40)) as pilot:
        for key in ("3", "1", "2"):
            await pilot.press(key)
            await pilot.pause()
        text = screen_text(app)
        assert "metrics.jsonl: 6 bad lines skipped" in text and "episodes.jsonl: 5 bad lines skipped" in text


def _v2_run(tmp_path: Path, run_dir: Path, copies: int) -> Path:
    """A run dir from before the index (events.jsonl alone) holding `copies` copies of the recorded episodes."""
    big = tmp_path / "big"
    big.mkdir()
    shutil.copy(run_dir / "spec.yaml", big)
    cfg = json.loads((run_dir / "config.json").read_text())
    (big / "config.json").write_text(json.dumps(cfg | {"event_schema_version": 2}))
    events = (run_dir / "events.jsonl").read_bytes()
    with open(big / "events.jsonl", "wb") as f:
        for k in range(copies):
            f.write(events.replace(b'"episode_id":"', b'"episode_id":"c%05d-' % k))
    return big


@pytest.mark.slow
def test_a_large_events_file_is_read_in_bounded_chunks(tmp_path, run_dir, monkeypatch):
    """Peak memory of reading a 20 MB events.jsonl stays a fraction of it (chunks of 1 MiB here); HEAD read it
    whole (and split it into lines beside it): a 1 GB file took 2.3 GB."""
    import tracemalloc

    import masgraph.rundir.read as read_module
    import masgraph.watch.index as index_module

    for module in (read_module, index_module):
        monkeypatch.setattr(module, "CHUNK", 1 << 20)
    big = _v2_run(tmp_path, run_dir, 300)
    size = (big / "events.jsonl").stat().st_size
    index = RunIndex(big)
    tracemalloc.start()
    try:
        index.poll()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 4, f"peak {peak:,} bytes traced reading {size:,}"
    assert len(index.rows) == 1800 and not index.bad_lines and index.caught_up
    last = index.rows[-1]
    assert last.id.startswith("c00299-") and index.trace(last).episode_id == last.id  # read back from its range


def test_a_line_longer_than_the_limit_is_skipped_not_held(run_dir, monkeypatch):
    """A 10 MB line, then 10 MB with no newline (a killed writer, junk): neither is held whole (HEAD read and
    kept both: memory grows with the line); both are bad lines, the second also a cut end."""
    import tracemalloc

    import masgraph.rundir.read as read_module
    import masgraph.watch.index as index_module

    for module in (read_module, index_module):  # the reader's chunks and the index's own range reads
        monkeypatch.setattr(module, "CHUNK", 1 << 20)
        monkeypatch.setattr(module, "MAX_LINE", 2 << 20)
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(b'{"v":3,"kind":"' + b"y" * (10 << 20) + b'"}\n' + b"z" * (10 << 20))
    index = RunIndex(run_dir)
    tracemalloc.start()
    try:
        index.poll()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (8 << 20), f"peak {peak:,} bytes traced"  # MAX_LINE + CHUNK, and some
    assert len(index.rows) == 6 and index.bad_lines == {"events.jsonl": 2}  # the cut one can only be skipped too
    (run_dir / "summary.json").write_text("{}")
    index.poll()
    assert "events.jsonl ends in half a line" in " ".join(index.warnings)


async def test_the_table_keeps_the_last_episodes_and_counts_them_all(tmp_path, run_dir, monkeypatch):
    """Rows past MAX_ROWS (+10 %) are dropped, oldest first; counts, the status line and the node stats cover
    every episode. HEAD kept every row: a 1M-episode index took 1.3 GB."""
    import masgraph.watch.index as index_module

    monkeypatch.setattr(index_module, "MAX_ROWS", 10, raising=False)
    lines = [json.loads(x) for x in (run_dir / INDEX).read_bytes().splitlines()]
    with open(run_dir / INDEX, "w") as f:
        for i in range(100):
            f.write(json.dumps(lines[i % 6] | {"id": f"e{i:03d}"}) + "\n")
    app = WatchApp(run_dir)
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        rows = app.index.rows
        assert len(rows) <= 11 and rows[-1].id == "e099" and [r.seq for r in rows] == list(range(100 - len(rows), 100))
        assert app.index.n_done == 100 and app.index.node_stats()["planner"].calls == 100
        text = screen_text(app)
        assert "100 done" in text and f"{len(rows)}/{len(rows)} episodes (the last {len(rows)} of 100)" in text


async def test_the_app_answers_keys_while_it_catches_up_with_a_large_run(tmp_path, run_dir, monkeypatch):
    """Each poll reads READ_BUDGET bytes at most, so q works at once; HEAD read the whole file before drawing."""
    import masgraph.watch.app as app_module

    monkeypatch.setattr(app_module, "READ_BUDGET", 64 << 10, raising=False)
    big = _v2_run(tmp_path, run_dir, 20)
    app = WatchApp(big, poll_s=3600)  # no timer tick during the test: only the polls made here
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.pause()
        assert not app.index.caught_up and "reading the run's files" in screen_text(app)
        for _ in range(100):
            app.tick()
            if app.index.caught_up:
                break
        await pilot.pause()
        assert app.index.n_done == 120 and "reading" not in screen_text(app)
        await pilot.press("q")
    assert app.return_code == 0


@settings(max_examples=200, deadline=None)
@given(strategies.lists(strategies.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=12),
       strategies.booleans(), strategies.integers(1, 50), strategies.integers(1, 30))
def test_lines_are_read_back_whole_with_their_offsets_in_any_chunks(tmp_path_factory, lines, cut, chunk, max_line):
    """Whatever the chunk size, every line up to MAX_LINE comes back once with its offset; longer ones (and a
    too-long unfinished end) are counted, never returned."""
    from unittest import mock

    import masgraph.rundir.read as read_module

    path = tmp_path_factory.mktemp("lines") / "f.jsonl"
    data = b"".join(line + b"\n" for line in lines) + (b"x" * 60 if cut else b"")
    path.write_bytes(data)
    with mock.patch.object(read_module, "MAX_LINE", max_line):
        reader, got = read_module.Lines(path), []
        while True:
            got += reader.read(chunk)
            if not reader.behind:
                break
    offsets = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
    assert got == [(o, x) for o, x in zip(offsets, lines, strict=True) if len(x) <= max_line]
    assert reader.too_long == sum(len(x) > max_line for x in lines) + (cut and 60 > max_line)
    assert reader.cut == cut


def test_the_step_view_lists_a_memory_managers_operations(tmp_path):
    """Issue 27: a memory manager's operations are inspectable in the step timeline, read back from the run dir."""
    from masgraph.events import EpisodeFinished, EpisodeStarted, StepFinished
    from masgraph.trace import MemoryOp, Step, Trace
    from masgraph.watch.render import step_text

    ops = [MemoryOp(fact="Kalo Mira lives in Rafeport.", op="ADD", target=1, text="Kalo Mira lives in Rafeport.",
                    output="Operation: ADD"),
           MemoryOp(fact="It rained.", op="NOOP", output="NOOP"),
           MemoryOp(fact="Kalo Mira moved to Sadport.", op="UPDATE", target=1, text="Kalo Mira moved to Sadport.",
                    output="UPDATE"),
           MemoryOp(fact="Tomo Rii left.", op="ADD", target=2, text="Tomo Rii left.", output="DELETE 9",
                    error="DELETE: no entry 9 (the fact was added)")]
    step = Step(episode_id="e0", index=0, node="memory", role="memory", turn=1, text="Memory: ...", memory_ops=ops)
    store = RunStore(tmp_path / "r", spec=None, config={})
    store.emit(EpisodeStarted(episode_id="e0", item_id="i", query="q"))
    store.emit(StepFinished(step=step))
    store.emit(EpisodeFinished(trace=Trace(episode_id="e0", item_id="i", query="q", steps=[step])))
    store.close({})
    index = RunIndex(tmp_path / "r")
    index.poll()
    [back] = index.trace(index.rows[0]).steps
    assert back.memory_ops == ops
    lines = step_text(back).plain.splitlines()
    assert "  memory 4 operations" in lines
    assert "    UPDATE [1] Kalo Mira moved to Sadport." in lines and "    NOOP       It rained." in lines
    assert "    ADD    [2] Tomo Rii left.  (DELETE: no entry 9 (the fact was added))" in lines
