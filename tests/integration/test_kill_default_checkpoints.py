"""Issue 58 #15: a training run killed with SIGKILL in its second step, with the default `checkpoint_every` (5),
resumes from its first step (HEAD: `error: no complete checkpoint`: only every 5th step and the last were saved).
On the tiny random model, in a child process (SIGKILL gives it no chance to save anything)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.rundir.checkpoint import resolve_checkpoint
from masgraph.tasks import Item, Task
from masgraph.trainers.loop import TrainLoop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAIN = "{steps: 2, queries_per_step: 2, eval_every: 0, eval_n: 2, seed: 3, flow_grpo: {group_size: 4, lr: 0.01}}"


class Sums(Task):
    """`i + 1 ?` questions; the reward alternates with the sample (every group has a signal). `slow_from` makes
    the queries from that index on sleep in their reward: the run is killed there."""

    name = "sums"
    slow_from: int | None = None

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        op = "+" if split == "train" else "*"
        return [Item(f"{split}-{seed}-{i}", f"{i % 19} {op} 1 ?", str(i % 19 + (op == "+"))) for i in range(n)]

    def score(self, item: Item, answer: str) -> float:
        return float(answer.strip() == item.answer)

    def reward(self, item: Item, trace) -> float:
        if self.slow_from is not None and int(item.id.rsplit("-", 1)[1]) >= self.slow_from:
            Path(os.environ["MARK"]).touch()
            time.sleep(300)
        return float(trace.meta["sample"] % 2)


def loop(model: str, run_dir: str, task: Task) -> TrainLoop:
    text = (f'name: tiny\npolicies:\n  main: {{model: "{model}", adapter: answer, trainable: true, '
            'sampling: {temperature: 1.0, max_tokens: 4}}\nnodes:\n  answer: {role: generator, policy: main, '
            f'prompt: direct}}\nentry: answer\nexit: answer\ntrain: {TRAIN}\n')
    return TrainLoop(compile_spec(parse_spec(text, "tiny.yaml")), task, Path(run_dir), dtype="float32")


CHILD = """
import asyncio, sys
sys.path.insert(0, sys.argv[3])
from test_kill_default_checkpoints import Sums, loop

task = Sums()
task.slow_from = 2  # step 2's queries
asyncio.run(loop(sys.argv[1], sys.argv[2], task).run())
"""


def test_a_run_killed_with_sigkill_in_step_two_resumes_from_step_one(tiny_model, tmp_path):
    tiny = tiny_model("llama")
    run, mark = tmp_path / "run", tmp_path / "in-step-2"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny), str(run), str(Path(__file__).parent)],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MARK": str(mark)})
    deadline = time.monotonic() + 300
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    err = proc.communicate()[1]
    assert proc.returncode == -signal.SIGKILL and mark.exists(), err[-2000:]
    checkpoint = resolve_checkpoint(run)  # HEAD: MasgraphError "no complete checkpoint"
    assert checkpoint.name == "step-1" and json.loads((checkpoint / "state.json").read_text())["cursor"] == 2
    resumed = loop(str(tiny), str(run), Sums())
    resumed.load(checkpoint)
    asyncio.run(resumed.run())
    assert resumed.step == 2 and resolve_checkpoint(run).name == "step-2"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
