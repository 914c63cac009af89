"""Following a run directory: a watcher in another process sees step events of episodes still running, waits
for a half-written line, stops when the run ends, and reads v1 files and v2 files alike."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from masgraph.errors import MasgraphError
from masgraph.events import EVENT_SCHEMA_VERSION, EpisodeFinished, EpisodeStarted, StepFinished
from masgraph.rundir.store import RunStore, follow, read_traces
from masgraph.trace import Step, Trace

LIVE_RUN = '''
import asyncio, sys
from masgraph.backends.scripted import ScriptedBackend
from masgraph.graph import GraphBuilder
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import Item, Task

class Ones(Task):
    name = "ones"
    def generate(self, split, n, seed):
        return [Item(f"{split}-{i}", f"What is {i} - {i - 1}?", "1") for i in range(n)]
    def score(self, item, answer):
        return float(answer.strip() == item.answer)

graph = (GraphBuilder("live").add_policy("p", backend="scripted")
         .add_node("a", role="generator", policy="p").add_node("b", role="generator", policy="p")
         .add_node("c", role="generator", policy="p").add_edge("a", "b").add_edge("b", "c")
         .set(entry="a", exit="c").compile())
runner = Runner(graph, RunConfig(concurrency=1, runs_dir=sys.argv[1]),
                backends={"scripted": ScriptedBackend(default="Answer: 1", delay_s=0.3)})
asyncio.run(runner.run_items(Ones(), Ones().generate("test", 2, 0)))
'''

# written by the v1 store (episode lines only; `episode_started` had no `started` then)
V1_LINES = (
    '{"v":1,"kind":"episode_started","episode_id":"000000-q0-0","item_id":"q0","query":"What is 2 + 3?"}\n'
    '{"v":1,"kind":"episode_finished","trace":{"episode_id":"000000-q0-0","item_id":"q0","query":"What is 2 + 3?",'
    '"steps":[{"episode_id":"000000-q0-0","index":0,"node":"planner","role":"planner","turn":1,"route":null,'
    '"text":"Sub-goal: 2 + 3\\nTool: calculator","llm":[{"policy":"planner","adapter":"planner","policy_version":0,'
    '"prompt_ids":[1,2,3],"completion_ids":[4,5],"logprobs":[-0.1,-0.2],"temperature":0.0,"top_p":1.0,'
    '"text":"Sub-goal: 2 + 3\\nTool: calculator","finish_reason":"stop","prompt_truncated":false,"latency_s":0.01}],'
    '"tool":null,"bounded":false,"parse_error":null,"error":null,"attempts":1,"started":1.0,"duration_s":0.01},'
    '{"episode_id":"000000-q0-0","index":1,"node":"executor","role":"executor","turn":1,"route":null,"text":"5",'
    '"llm":[],"tool":{"tool":"calculator","input":"2 + 3","output":"5","error":null,"duration_s":0.001},'
    '"bounded":false,"parse_error":null,"error":null,"attempts":1,"started":1.01,"duration_s":0.002}],'
    '"answer":"5","reward":1.0,"status":"ok","error":null,"duration_s":0.02,"meta":{"sample":0,"gold":"5"}}}\n'
)


def steps_of(episode_id: str, n: int) -> list[Step]:
    return [Step(episode_id=episode_id, index=i, node=f"n{i}", role="custom", turn=1, text=f"out {i}")
            for i in range(n)]


def finished(episode_id: str, steps: list[Step]) -> EpisodeFinished:
    return EpisodeFinished(trace=Trace(episode_id=episode_id, item_id="i", query="q", steps=steps, answer="a",
                                       reward=1.0))


class Watcher:
    """`follow` running in a thread (as a watcher process would), its events on a queue."""

    def __init__(self, run_dir: Path, poll_s: float = 0.02):
        self.events: queue.Queue = queue.Queue()
        self.stop, self.bad = threading.Event(), []
        self.thread = threading.Thread(target=self._run, args=(run_dir, poll_s), daemon=True)
        self.thread.start()

    def _run(self, run_dir: Path, poll_s: float) -> None:
        for event in follow(run_dir, poll_s=poll_s, stop=self.stop, bad_lines=self.bad):
            self.events.put(event)

    def next(self, timeout: float = 5.0):
        return self.events.get(timeout=timeout)

    def nothing_new(self, wait: float = 0.2) -> bool:
        try:
            self.events.get(timeout=wait)
        except queue.Empty:
            return True
        return False


@pytest.mark.slow
def test_a_watcher_in_another_process_sees_steps_of_an_unfinished_episode(tmp_path):
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-c", LIVE_RUN, str(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    told = threading.Event()
    safety = threading.Timer(120, told.set)  # the run takes ~2 s once started
    safety.start()
    live, events = [], []
    try:
        while not (runs.is_dir() and any(runs.iterdir())):
            assert proc.poll() is None, proc.stdout.read()
            assert not told.is_set(), "the run never created its directory"
            time.sleep(0.02)
        [run_dir] = runs.iterdir()
        for event in follow(run_dir, poll_s=0.02, stop=told):
            events.append(event)
            if isinstance(event, StepFinished):  # has this episode ended, as far as the file says?
                ended = {t.episode_id for t in read_traces(run_dir)}
                if event.step.episode_id not in ended:
                    live.append((event.step.episode_id, event.step.node))
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
        assert not told.is_set(), "follow did not stop when the run wrote summary.json"
    finally:
        safety.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # with a 0.3 s reply per node, the first two steps of each episode are on disk well before its end
    assert len(live) >= 2 and {node for _, node in live} <= {"a", "b", "c"}, live  # without step lines: []
    traces = [e.trace for e in events if isinstance(e, EpisodeFinished)]
    assert [[s.node for s in t.steps] for t in traces] == [["a", "b", "c"]] * 2  # rebuilt from the step lines
    assert traces == list(read_traces(run_dir)) and all(t.reward == 1.0 for t in traces)
    assert sum(isinstance(e, EpisodeStarted) for e in events) == 2


def test_step_lines_reach_the_file_within_flush_s_while_the_episode_runs(tmp_path):
    store = RunStore(tmp_path, spec=None, config={}, flush_s=0.05)
    seen = []

    async def episode():
        store.emit(EpisodeStarted(episode_id="e", item_id="i", query="q"))
        store.emit(StepFinished(step=steps_of("e", 1)[0]))
        await asyncio.sleep(0.2)  # the episode is still running
        seen.extend(json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines())

    asyncio.run(episode())
    store.close({})
    assert seen == ["episode_started", "step"]  # flushed only at episode end: []


def test_follow_waits_for_a_half_written_line_and_stops_when_the_run_ends(tmp_path):
    store = RunStore(tmp_path, spec=None, config={})
    store.emit(EpisodeStarted(episode_id="e", item_id="i", query="q"))  # outside an event loop: written at once
    watcher = Watcher(tmp_path)
    assert isinstance(watcher.next(), EpisodeStarted)
    step = '{"v":2,"kind":"step","step":' + steps_of("e", 1)[0].model_dump_json() + "}\n"
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(step[:30])  # a writer half-way through a line
    assert watcher.nothing_new()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(step[30:] + "not json\n")
    got = watcher.next()
    assert isinstance(got, StepFinished) and got.step.text == "out 0"
    assert watcher.nothing_new() and watcher.bad == [3]  # the bad line is skipped and counted
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"v":2,"kind":"episode_fin')  # the run is killed mid-line ...
    RunStore(tmp_path, spec=None, config={}).close({"interrupted": True})  # ... a resumed store ends the line
    watcher.thread.join(timeout=5)
    assert not watcher.thread.is_alive() and watcher.bad == [3, 4]


def test_follow_stops_when_told_and_counts_a_last_line_the_run_left_cut(tmp_path):
    store = RunStore(tmp_path, spec=None, config={})
    watcher = Watcher(tmp_path)
    assert watcher.nothing_new()
    watcher.stop.set()
    watcher.thread.join(timeout=5)
    assert not watcher.thread.is_alive()

    store.close({})
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"v":2,"kind":"episode_sta')
    bad: list[int] = []
    assert list(follow(tmp_path, bad_lines=bad)) == [] and bad == [1]
    with pytest.raises(MasgraphError, match="no run directory"):
        next(follow(tmp_path / "missing"))


def test_a_v1_file_reads_with_read_traces_and_follow(tmp_path):
    (tmp_path / "events.jsonl").write_text(V1_LINES)
    (tmp_path / "summary.json").write_text("{}")
    [trace] = read_traces(tmp_path)
    assert [s.node for s in trace.steps] == ["planner", "executor"] and trace.steps[1].tool.output == "5"
    assert trace.steps[0].llm[0].completion_ids == [4, 5]
    bad: list[int] = []
    started, done = follow(tmp_path, bad_lines=bad)
    assert isinstance(started, EpisodeStarted) and done.trace == trace and bad == []


def test_v2_writes_each_step_once_and_readers_rebuild_whole_traces(tmp_path):
    store = RunStore(tmp_path, spec=None, config={})
    sent = steps_of("e1", 3)
    store.emit(EpisodeStarted(episode_id="e1", item_id="i", query="q"))
    for step in sent:
        store.emit(StepFinished(step=step))
    store.emit(finished("e1", sent))
    store.emit(StepFinished(step=steps_of("e2", 1)[0]))  # a trace whose steps were not all sent: written whole
    store.emit(finished("e2", steps_of("e2", 2)))
    store.close({})
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    [compact, whole] = [x for x in lines if x["kind"] == "episode_finished"]
    assert compact["steps"] == 3 and "steps" not in compact["trace"]  # steps are in the step lines only
    assert "steps" not in whole and len(whole["trace"]["steps"]) == 2
    assert all(x["v"] == EVENT_SCHEMA_VERSION for x in lines)
    assert list(read_traces(tmp_path)) == [finished("e1", sent).trace, finished("e2", steps_of("e2", 2)).trace]
    assert [e.trace for e in follow(tmp_path) if isinstance(e, EpisodeFinished)] == list(read_traces(tmp_path))


def test_a_lost_step_line_loses_its_trace_and_a_reused_episode_id_starts_afresh(tmp_path):
    store = RunStore(tmp_path, spec=None, config={})
    for _ in range(2):  # a second run_items in one store (a training step) reuses the episode ids
        sent = steps_of("e", 2)
        store.emit(EpisodeStarted(episode_id="e", item_id="i", query="q"))
        for step in sent:
            store.emit(StepFinished(step=step))
        store.emit(finished("e", sent))
    store.close({})
    assert [len(t.steps) for t in read_traces(tmp_path)] == [2, 2]
    lines = (tmp_path / "events.jsonl").read_text().splitlines(keepends=True)
    del lines[2]  # the second step line of the first episode
    (tmp_path / "events.jsonl").write_text("".join(lines))
    bad: list[int] = []
    assert [len(t.steps) for t in read_traces(tmp_path, bad)] == [2] and bad == [3]


def test_a_step_completed_after_it_was_sent_is_stored_complete(tmp_path):
    store = RunStore(tmp_path, spec=None, config={})

    async def episode():
        [step] = steps_of("e", 1)
        store.emit(EpisodeStarted(episode_id="e", item_id="i", query="q"))
        store.emit(StepFinished(step=step))
        step.bounded = True  # the scheduler routes (and may mark the loop bound) before it next awaits
        await asyncio.sleep(0)
        store.emit(finished("e", [step]))

    asyncio.run(episode())
    store.close({})
    [trace] = read_traces(tmp_path)
    assert trace.steps[0].bounded


def test_a_reopened_run_directory_is_live_until_closed_again(tmp_path):
    RunStore(tmp_path, spec=None, config={}).close({"step": 1})
    resumed = RunStore(tmp_path, spec=None, config={})
    assert not (tmp_path / "summary.json").exists()  # a watcher would otherwise stop at once
    resumed.close({"step": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"step": 2}
