"""`train.max_staleness: 1`: the next step's rollouts decode while this step updates, on the adapters as they were
before it (issue 55). On a tiny random Llama in deterministic mode, so runs and resumes compare bit for bit."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from masgraph.errors import SpecError
from masgraph.events import CheckpointSaved
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.rundir.read import read_traces
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.loop import TrainLoop

pytestmark = pytest.mark.integration

GRAPH = """\
name: stale
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{temperature: 1.0, max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main}}
entry: answer
exit: answer
train: {{steps: 3, queries_per_step: 2, eval_every: 0, eval_n: 1, seed: 3, deterministic: true,
         max_staleness: {staleness}, flow_grpo: {{group_size: 2, lr: 0.01}}}}
"""


ALT_PY = ("from masgraph.tasks import BasicArithmetic\n\n\nclass Alternating(BasicArithmetic):\n"
          "    name = 'alternating'\n\n    def reward(self, item, trace):\n"
          "        return float(trace.meta['sample'] % 2)\n")
"""`Alternating` below as a task file, for `masgraph train --task FILE:Alternating`."""


class Alternating(BasicArithmetic):
    """Reward by sample parity: every group has variance, so every update changes the adapter."""

    name = "alternating"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The unit tests' tiny random Llama (tests/unit/conftest.py), built here the same way."""
    spec = importlib.util.spec_from_file_location("unit_conftest", Path(__file__).parents[1] / "unit" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny.__wrapped__(tmp_path_factory)


def _loop(model: Path, run: Path, staleness: int, sinks=()) -> TrainLoop:
    graph = compile_spec(parse_spec(GRAPH.format(model=model, staleness=staleness), "stale.yaml"))
    return TrainLoop(graph, Alternating(), run, dtype="float32", sinks=list(sinks))


def _adapter(loop: TrainLoop) -> list[torch.Tensor]:
    return [p.detach().clone() for p in loop.learner.parameters("answer")]


def _versions_by_step(loop: TrainLoop, run: Path) -> list[set[int]]:
    """The adapter versions each step's rollouts decoded with (steps by their items: 2 queries each)."""
    step_of = {item.id: i // 2 for i, item in enumerate(loop.items)}
    seen: list[set[int]] = [set() for _ in range(loop.cfg.steps)]
    for trace in read_traces(run / "events.jsonl"):
        if trace.item_id in step_of and not trace.meta.get("evaluation"):
            seen[step_of[trace.item_id]] |= {c.policy_version for s in trace.steps for c in s.llm}
    return seen


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    """The 3-step run with max_staleness 1: its loop and run directory."""
    run = tmp_path_factory.mktemp("stale") / "run"
    loop = _loop(tiny, run, 1)
    asyncio.run(loop.run())
    return loop, run


def test_each_steps_rollouts_decode_one_version_behind_and_a_second_run_repeats_it(tiny, uninterrupted, tmp_path):
    loop, run = uninterrupted
    assert _versions_by_step(loop, run) == [{0}, {0}, {1}]  # on-policy: [{0}, {1}, {2}] (below)
    assert loop.learner.version("answer") == 3
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rows/trained"] > 0 and m["time/update_s"] > 0 for m in metrics)
    assert not (run / "checkpoints" / ".behaviour").exists()  # the staging copy goes with the run

    again = _loop(tiny, tmp_path / "again", 1)
    asyncio.run(again.run())
    assert all(torch.equal(a, b) for a, b in zip(_adapter(loop), _adapter(again)))

    on_policy = _loop(tiny, tmp_path / "on-policy", 0)
    asyncio.run(on_policy.run())
    assert _versions_by_step(on_policy, tmp_path / "on-policy") == [{0}, {1}, {2}]
    assert not all(torch.equal(a, b) for a, b in zip(_adapter(loop), _adapter(on_policy)))


def test_a_run_stopped_while_the_next_rollouts_decode_resumes_into_the_uninterrupted_run(tiny, uninterrupted,
                                                                                        tmp_path):
    """Cancelled (as Ctrl-C does) once step 2's checkpoint is written, while step 3's rollouts decode on version 1
    (or, when they finished first, in step 3's update): the checkpoint keeps version 1 beside its own version 2, and
    the resumed step 3 decodes with it."""
    loop, _ = uninterrupted
    run = tmp_path / "run"

    async def until_step_2() -> None:
        task = asyncio.current_task()

        class StopAfter2:
            def emit(self, event):
                if isinstance(event, CheckpointSaved) and event.step == 2:
                    task.cancel()

        await _loop(tiny, run, 1, [StopAfter2()]).run()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(until_step_2())
    step2 = run / "checkpoints" / "step-2"
    state = json.loads((step2 / "state.json").read_text())
    assert state["versions"] == {"answer": 2} and state["behaviour"] == {"answer": 1}
    assert (step2 / "behaviour" / "answer" / "adapter_model.safetensors").is_file()

    resumed = _loop(tiny, run, 1)
    resumed.load(step2)
    asyncio.run(resumed.run())
    assert resumed.step == 3
    assert all(torch.equal(a, b) for a, b in zip(_adapter(loop), _adapter(resumed)))


def test_a_run_out_of_time_with_the_next_rollouts_decoding_resumes_into_the_uninterrupted_run(tiny, uninterrupted,
                                                                                             tmp_path):
    """`max_minutes` spent after step 1, while step 2's rollouts decode on version 0: the run ends there (the pending
    rollouts cancelled, nothing left running), step 1's checkpoint keeps version 0 for them, and the resumed run
    redoes them with it."""
    loop, _ = uninterrupted
    run = tmp_path / "run"
    short = _loop(tiny, run, 1)
    short.cfg = short.cfg.model_copy(update={"max_minutes": 1e-6})  # spent by the first step
    asyncio.run(short.run())
    assert short.step == 1 and short._next is None
    state = json.loads((run / "checkpoints" / "step-1" / "state.json").read_text())
    assert state["versions"] == {"answer": 1} and state["behaviour"] == {"answer": 0}
    assert not (run / "checkpoints" / ".behaviour").exists()

    resumed = _loop(tiny, run, 1)
    resumed.load(run / "checkpoints" / "step-1")
    asyncio.run(resumed.run())
    assert resumed.step == 3
    assert all(torch.equal(a, b) for a, b in zip(_adapter(loop), _adapter(resumed)))


def test_joint_training_refuses_stale_rollouts(tiny):
    """Its rollouts sample topologies from the policy the update changes; other topology trainers lack the knob."""
    router = (Path(__file__).parents[2] / "graphs" / "router.yaml").read_text().replace("smollm2-135m", str(tiny))
    with pytest.raises(SpecError, match="max_staleness"):
        parse_spec(router.replace("train:\n", "train:\n  max_staleness: 1\n", 1), "router.yaml")


def test_kill_9_while_the_last_checkpoint_is_written_resumes_exactly(tiny, tmp_path):
    """`masgraph train` SIGKILLed while it writes step 3's checkpoint (held open by the fault-injection pause):
    `--resume` starts from step 2's, decodes step 3's rollouts with the version-1 adapters that checkpoint kept,
    and ends with the uninterrupted run's adapters, bit for bit."""
    (tmp_path / "g.yaml").write_text(GRAPH.format(model=tiny, staleness=1))
    (tmp_path / "alt.py").write_text(ALT_PY)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "masgraph", "train", str(tmp_path / "g.yaml"), "--task",
           f"{tmp_path / 'alt.py'}:Alternating", "--device", "cpu"]
    done = subprocess.run([*cmd, "--runs-dir", str(tmp_path / "a")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [whole] = list((tmp_path / "a").iterdir())

    proc = subprocess.Popen([*cmd, "--runs-dir", str(tmp_path / "b")], env={**env, "MASGRAPH_CHECKPOINT_PAUSE_S": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(tmp_path.glob("b/*/checkpoints/step-3.tmp/adapters")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [killed] = list((tmp_path / "b").iterdir())
    assert json.loads((killed / "checkpoints" / "step-2" / "state.json").read_text())["behaviour"] == {"answer": 1}
    done = subprocess.run([*cmd, "--resume", str(killed)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "(step 2)" in done.stderr, done.stderr[-3000:]
    want, got = [load_file(run / "checkpoints" / "step-3" / "adapters" / "answer" / "adapter_model.safetensors")
                 for run in (whole, killed)]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_on_ray_workers_the_run_equals_the_in_process_one(tiny, tmp_path):
    """`--ray --workers 1`: the next step's rollouts decode on the worker while the driver updates, each version
    published through the object store as the step after starts its rollouts; deterministic, so each step's loss
    equals the in-process replica run's, and the adapters do to 1e-5 (the worker's recorded log-probs differ from
    this process's in the last bits: measured 1.5e-8 after 3 on-policy steps, 3e-7 after 3 of these; a step decoded
    on the wrong version moves the loss by ~1e-2).

    The machine's measured dtypes disagree by thread count here, as CI's fresh cache once did (there bf16 at the
    driver's 1 thread and fp32 at the worker's 2; the worker's fp32 decode of the bf16 learner moved the losses by up
    to 8e-5; here the other way round, so that the learner is fp32 and has a linear kernel to agree on): the worker
    decodes in the learner's dtype with the driver's kernel, whatever it would measure."""
    (tmp_path / "g.yaml").write_text(GRAPH.format(model=tiny, staleness=1))
    (tmp_path / "alt.py").write_text(ALT_PY)
    cache, driver = _disagreeing_cache(tmp_path / "cache")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "MASGRAPH_CACHE": str(cache), "MASGRAPH_LINEAR": ""}
    cmd = [sys.executable, "-m", "masgraph", "train", str(tmp_path / "g.yaml"), "--task",
           f"{tmp_path / 'alt.py'}:Alternating", "--device", "cpu"]
    for name, more in (("local", []), ("ray", ["--ray", "--workers", "1", "--address", "local"])):
        done = subprocess.run([*cmd, *more, "--runs-dir", str(tmp_path / name)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0 and "done: 3 steps" in done.stdout, done.stderr[-3000:]
    runs = [next((tmp_path / name).iterdir()) for name in ("local", "ray")]
    local, ray = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]
    assert [m["loss/total"] for m in ray] == pytest.approx([m["loss/total"] for m in local], abs=1e-6)
    want, got = [load_file(run / "checkpoints" / "step-3" / "adapters" / "answer" / "adapter_model.safetensors")
                 for run in runs]
    assert want.keys() == got.keys() and max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-5
    # the worker ran the driver's kernel: it never measured one for its own thread count
    assert json.loads((cache / "linear-kernel.json").read_text()) == {driver: "blas"}


def _disagreeing_cache(path: Path) -> tuple[Path, str]:
    """A masgraph cache whose measured dtype differs between 1 thread (the driver's, under OMP_NUM_THREADS=1: fp32)
    and all the cores (a local Ray worker's: bf16), with a linear kernel for 1 thread only; and the driver's key."""
    from masgraph.backends.hf.measured import machine_key

    was, keys = torch.get_num_threads(), []
    try:
        for threads in (os.cpu_count() or 1, 1):
            torch.set_num_threads(threads)
            keys.append(machine_key(torch.device("cpu")))
    finally:
        torch.set_num_threads(was)
    path.mkdir(parents=True)
    (path / "dtype-choice.json").write_text(json.dumps(dict(zip(keys, ["bfloat16", "float32"]))))
    (path / "linear-kernel.json").write_text(json.dumps({keys[1]: "blas"}))
    return path, keys[1]
