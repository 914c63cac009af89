"""Issue 30, finding 11: SIGTERM on `masgraph run` took 25-70 s on a busy machine before exiting 143.

Measured (2 cores, load 8-10 from other work, two busy loops beside; agentflow, basic_arithmetic, --n 16, SIGTERM
40 s in): 9.3, 19.4 and 42.8 s with 04456a9 (a cancelled hf batch stops decoding at its next step). The time went
to runner.aclose() waiting for the hf batch thread, still in a forward that checks no stop flag (12-36 s), then to
the interpreter's exit (its thread joins and teardown, ~7 s). With the fix: 2.5 s. These tests make the same
shapes without a model: work on a backend's own worker thread that aclose waits for, and a plain-def agent on the
event loop's default executor, each busy for 60 s when SIGTERM comes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARTS = '''
import asyncio, time
from concurrent.futures import ThreadPoolExecutor

from masgraph.agents import register_agent
from masgraph.backends.scripted import ScriptedBackend
from masgraph.node import NodeOutput
from masgraph.registry import BackendKind, record

BUSY_S = 60.0


class BatchThread(ScriptedBackend):
    """As the hf backend: a 'slow' question is computed on the backend's own worker thread, which nothing can
    interrupt (a long prefill), and aclose waits until that thread is done."""

    def __init__(self):
        super().__init__(default="4")
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-batch")
        self.running = []

    async def complete(self, requests):
        if any("slow" in m["content"] for r in requests for m in r.messages):
            fut = self.pool.submit(time.sleep, BUSY_S)
            self.running.append(fut)
            await asyncio.wrap_future(fut)
        return await super().complete(requests)

    async def aclose(self):
        for fut in self.running:
            await asyncio.wrap_future(fut)
        self.pool.shutdown(wait=True)


record(__name__, "backends", "batch_thread", BackendKind("batch_thread", lambda policy, **o: BatchThread(), False))


@register_agent("blocking")
def blocking(ctx):  # a plain def: runs on the event loop's default executor
    if "slow" in ctx.query:
        time.sleep(BUSY_S)
    return NodeOutput(text="4", answer="4")
'''

TASK = '''
from masgraph.tasks import Item, Task

class Mixed(Task):
    name = "mixed"
    def generate(self, split, n, seed):
        return [Item(f"{split}{i}", f"{split} {'slow' if i % 2 else 'quick'} {i}", "4") for i in range(n)]
    def score(self, item, answer):
        return float(answer.strip() == "4")
'''

GRAPHS = {
    "batch": "name: batch\nplugins: [parts.py]\npolicies:\n  main: {backend: batch_thread}\n"
             "nodes:\n  answer: {role: generator, policy: main, prompt: direct}\nentry: answer\nexit: answer\n",
    "agent": "name: agent\nplugins: [parts.py]\nnodes:\n  answer: {role: custom, agent: blocking}\n"
             "entry: answer\nexit: answer\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_sigterm_exits_within_seconds_with_the_finished_episodes_saved(tmp_path, graph):
    (tmp_path / "parts.py").write_text(PARTS)
    (tmp_path / "t.py").write_text(TASK)
    (tmp_path / "g.yaml").write_text(GRAPHS[graph])
    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "run", "g.yaml", "--task", "t.py:Mixed", "--n", "4",
                             "--concurrency", "4", "--runs-dir", "runs"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        index = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the two quick episodes finish; the two slow ones are busy
            found = list((tmp_path / "runs").glob("*/episodes.jsonl")) if (tmp_path / "runs").is_dir() else []
            if found and len(found[0].read_text().splitlines()) >= 2:
                index = found[0]
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        assert index is not None, "the quick episodes never finished"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)  # the busy work has 60 s to go
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"still running 20 s after SIGTERM (the old code waited for the 60 s of work): {err}")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert took < 10, f"exit took {took:.1f}s"  # measured ~3 s (2 s grace for the backend, then out)
    assert "interrupted: 2 episodes finished, 2 cancelled" in err and "Traceback" not in err, err
    summary = json.loads((index.parent / "summary.json").read_text())
    assert summary["episodes"] == 2 and summary["cancelled"] == 2 and summary["correct"] == 2, summary
    assert [json.loads(x)["status"] for x in index.read_text().splitlines()].count("ok") == 2
    assert "run dir" in out and Path(out.split("run dir")[1].strip()).name == index.parent.name
