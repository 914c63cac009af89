"""Issue 30, finding 8: `masgraph train` printed nothing but 'loading ...' for its whole first step (3.6 min).
It now shows what a step does (episodes done of the total, tokens/s, the update's time) on stderr: redrawn in
place on a terminal, one line per --progress-every seconds in a log (no carriage returns); stdout is unchanged."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from masgraph.cli import TrainProgress
from masgraph.events import EpisodeFinished, LLMCallFinished, TrainStep
from masgraph.trace import Trace

STEP = {"reward/mean": 0.5, "tokens_per_s": 10.0, "time/train_s": 60.0}


def _episode(i: int) -> EpisodeFinished:
    return EpisodeFinished(trace=Trace(episode_id=f"e{i}", item_id=f"i{i}", query="q"))


def _call(tokens: int) -> LLMCallFinished:
    return LLMCallFinished(episode_id="e", node="answer", turn=1, policy="main", completion_tokens=tokens)


def test_a_long_update_in_a_log_gets_a_line_per_interval_and_no_carriage_return():
    out = io.StringIO()  # not a terminal
    progress = TrainProgress(2, out=out, every_s=0.1)
    progress.phase("update", 1, 8)
    time.sleep(0.45)  # the update blocks the event loop: the progress thread still reports
    progress.emit(TrainStep(step=1, metrics=STEP))
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert 2 <= len(lines) - 1 <= 5, lines  # about one per 0.1 s, not one per tick or per event
    assert all(re.fullmatch(r"step 1/2  update on 8 episodes  0:00", x) for x in lines[:-1]), lines
    assert lines[-1].startswith("step 1/2  reward 0.500")


def test_a_quick_phase_in_a_log_prints_nothing_but_the_step_line():
    out = io.StringIO()
    progress = TrainProgress(2, out=out, every_s=30)
    progress.phase("rollouts", 1, 4)
    for i in range(4):
        progress.emit(_episode(i))
    progress.emit(TrainStep(step=1, metrics=STEP))
    progress.close()
    assert out.getvalue().splitlines() == [
        "step 1/2  reward 0.500  acc(train) 0.000  kl 0.0000  loss +0.0000  rows 0 (each group scored alike: no update)"
        "  10.0 tok/s  1.0 min"]


def test_a_terminal_gets_one_status_line_redrawn_then_cleared_for_the_step_line():
    out = io.StringIO()
    progress = TrainProgress(2, out=out, tty=True)
    progress.phase("rollouts", 1, 4)
    progress.emit(_call(30))
    progress.emit(_episode(0))
    progress.emit(_episode(1))
    progress.emit(TrainStep(step=1, metrics=STEP))
    progress.close()
    text = out.getvalue()
    assert "\rstep 1/2  rollouts 0/4 episodes  " in text and "\rstep 1/2  rollouts 2/4 episodes  " in text
    assert re.search(r"rollouts 2/4 episodes  \d+\.\d tok/s  0:00\x1b\[K", text), repr(text)
    assert text.endswith("\r\x1b[Kstep 1/2  reward 0.500  acc(train) 0.000  kl 0.0000  loss +0.0000  rows 0 (each "
                         "group scored alike: no update)  10.0 tok/s  1.0 min\n"), repr(text)  # cleared, then step



@pytest.mark.parametrize("algorithm, line", [
    ("hrpo", "step 1/2  reward 0.750  acc(train) 0.000  topology start=solve 0.70  10.0 tok/s  1.0 min"),
    ("reinforce", "step 1/2  reward 0.750  acc(train) 0.000  topology start=solve 0.70  10.0 tok/s  1.0 min"),
    ("joint", "step 1/2  reward 0.500  acc(train) 0.000  kl 0.0100  loss +0.2000  rows 8  topology start=solve 0.70  "
              "10.0 tok/s  1.0 min")])
def test_the_step_line_shows_what_the_runs_algorithm_trains(algorithm, line):
    """The algorithm comes from the run's train config, not from which metric keys a step happens to carry."""
    out = io.StringIO()
    metrics = STEP | {"topology/reward": 0.75, "topology/p/choice:start/solve": 0.7,
                      "topology/p/choice:start/harm": 0.3}
    if algorithm == "joint":
        metrics |= {"kl/ref_k3": 0.01, "loss/total": 0.2, "rows/trained": 8.0}
    TrainProgress(2, out=out, algorithm=algorithm).emit(TrainStep(step=1, metrics=metrics))
    assert out.getvalue().splitlines() == [line]


TASK = """
import time
from masgraph.tasks import Item, Task

class Slow(Task):
    name = "slow"
    def generate(self, split, n, seed):
        op = "+" if split == "train" else "*"
        return [Item(f"{split}-{i}", f"{i % 19} {op} 1 ?", str(i % 19)) for i in range(n)]
    def score(self, item, answer):
        time.sleep(0.1)  # episodes that take a while, so the rollouts last longer than --progress-every
        return float(answer.strip() == item.answer)
"""


@pytest.mark.slow
def test_masgraph_train_in_a_log_shows_rollout_progress_on_stderr_and_keeps_stdout(tiny, tmp_path):
    (tmp_path / "slow.py").write_text(TASK)
    (tmp_path / "g.yaml").write_text(f"""\
name: tiny
policies:
  main: {{model: "{tiny}", adapter: answer, trainable: true, device: cpu, sampling: {{max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{task: slow.py:Slow, steps: 1, queries_per_step: 2, eval_every: 1, eval_n: 4, concurrency: 2,
         flow_grpo: {{group_size: 4}}}}
""")
    p = subprocess.run([sys.executable, "-m", "masgraph.cli", "train", "g.yaml", "--progress-every", "0.2",
                        "--runs-dir", "runs"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("done: 1 steps;") and len(p.stdout.splitlines()) == 1, p.stdout  # stdout as before
    assert "\r" not in p.stderr and "\x1b" not in p.stderr, repr(p.stderr)
    lines = p.stderr.splitlines()
    rollouts = [x for x in lines if re.fullmatch(r"step 1/1  rollouts \d/8 episodes  \d+\.\d tok/s  0:\d\d", x)]
    evaluation = [x for x in lines if re.fullmatch(r"step [01]/1  evaluation \d/4 episodes  \d+\.\d tok/s  0:\d\d", x)]
    assert rollouts and evaluation, p.stderr
    assert lines.index(rollouts[0]) < next(i for i, x in enumerate(lines) if x.startswith("step 1/1  reward"))
    assert Path(tmp_path / "runs").is_dir()
