"""Topology learning on the real model: HRPO drives a harmful branch's probability down, `masgraph run
--checkpoint` then follows the learned topology, one joint step moves the topology policy and two adapters, and
resuming from a checkpoint (in process, and after kill -9 of `masgraph train`) reproduces the topology policy and
adapters of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from masgraph.cli import main
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.tasks import load_task_file
from masgraph.trainers.loop import TrainLoop

pytestmark = [pytest.mark.integration, pytest.mark.gpu]  # the GPU tier runs these on CUDA (device: auto)

PLUGIN = """\
from masgraph.agents import register_agent
from masgraph.node import NodeOutput


@register_agent("pass-query")
async def pass_query(ctx):
    return NodeOutput(text=ctx.query)


@register_agent("pass-input")
async def pass_input(ctx):
    return NodeOutput(text=ctx.merged)


@register_agent("harm-fail")
async def harm_fail(ctx):
    raise RuntimeError("this branch always breaks the episode")
"""

TASKS = """from masgraph.tasks import BasicArithmetic


class Digits(BasicArithmetic):
    # a format reward: the answer holds a number (the real model's direct answer mostly does)
    name = "digits"
    def reward(self, item, trace):
        return float(trace.answer is not None and any(ch.isdigit() for ch in trace.answer))


class Alternating(BasicArithmetic):
    # a reward that varies inside every group, so every step has a learning signal
    name = "alternating"
    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)
"""

HARM = """\
name: harm
plugins: [plugin.py]
policies:
  main: {model: smollm2-135m, sampling: {max_tokens: 12}}
nodes:
  start: {role: custom, agent: pass-query}
  solve: {role: generator, policy: main, prompt: direct}
  harm: {role: custom, agent: harm-fail}
  end: {role: custom, agent: pass-input}
edges:
  - {source: start, target: solve}
  - {source: start, target: harm}
  - {source: solve, target: end}
  - {source: harm, target: end}
entry: start
exit: end
topology:
  choices: {start: [solve, harm]}
train:
  algorithm: hrpo
  task: tasks.py:Digits
  steps: 6
  queries_per_step: 2
  eval_every: 0
  eval_n: 2
  checkpoint_every: 6
  hrpo: {group_size: 8, lr: 0.3}
"""

JOINT = """\
name: joint
plugins: [plugin.py]
policies:
  first: {model: smollm2-135m, adapter: first, trainable: true, sampling: {max_tokens: 8}}
  second: {model: smollm2-135m, adapter: second, trainable: true, sampling: {max_tokens: 8}}
nodes:
  a: {role: generator, policy: first, prompt: direct}
  b: {role: generator, policy: second, prompt: direct}
  c: {role: generator, policy: second, prompt: direct}
  end: {role: custom, agent: pass-input}
edges:
  - {source: a, target: b}
  - {source: a, target: c}
  - {source: b, target: end}
  - {source: c, target: end}
entry: a
exit: end
topology:
  choices: {a: [b, c]}
train:
  algorithm: joint
  task: tasks.py:Alternating
  steps: 2
  queries_per_step: 2
  eval_every: 0
  eval_n: 2
  checkpoint_every: 1
  deterministic: true
  seed: 3
  flow_grpo: {group_size: 4, lr: 0.002}
  hrpo: {lr: 0.2}
"""


def _loop(tmp: Path, text: str, run: str) -> TrainLoop:
    (tmp / "plugin.py").write_text(PLUGIN)
    (tmp / "tasks.py").write_text(TASKS)
    (tmp / "graph.yaml").write_text(text)
    graph = compile_spec(load_spec(tmp / "graph.yaml"), str(tmp / "graph.yaml"))
    return TrainLoop(graph, load_task_file(str(tmp / graph.spec.train.task)), tmp / run, dtype="float32")


@pytest.fixture(scope="module")
def harm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harm")
    loop = _loop(tmp, HARM, "run")
    asyncio.run(loop.run())
    return tmp, loop


def test_hrpo_drives_the_harmful_branch_down(harm_run):
    tmp, loop = harm_run
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    harm = [r["topology/p/choice:start/harm"] for r in rows if "topology/p/choice:start/harm" in r]
    assert len(harm) == 6 and harm[-1] < 0.2, harm
    assert harm[0] < 0.5  # it fell from the uniform prior at the first update
    assert (tmp / "run" / "checkpoints" / "step-6" / "topology.pt").exists()


def test_run_with_the_checkpoint_follows_the_learned_topology(harm_run, capsys):
    tmp, _ = harm_run
    runs = tmp / "runs"
    assert main(["run", str(tmp / "graph.yaml"), "--task", f"{tmp / 'tasks.py'}:Digits", "--n", "4",
                 "--checkpoint", str(tmp / "run"), "--runs-dir", str(runs)]) == 0
    err = capsys.readouterr().err
    assert "topology: learned v6, greedy" in err
    [run_dir] = list(runs.iterdir())
    traces = [json.loads(x)["trace"] for x in (run_dir / "events.jsonl").read_text().splitlines()
              if '"episode_finished"' in x]
    assert len(traces) == 4
    assert all(t["topology"]["decisions"] == {"choice:start": "solve"} and t["topology"]["mode"] == "greedy"
               and t["topology"]["version"] == 6 and t["status"] == "ok" for t in traces)


def _lora(loop: TrainLoop, adapter: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in loop.learner.parameters(adapter)]


@pytest.mark.slow
def test_one_joint_step_moves_the_topology_and_two_adapters_and_resume_is_exact(tmp_path):
    a = _loop(tmp_path, JOINT, "a")
    asyncio.run(a.run())  # 2 steps, a checkpoint after each
    assert a.step == 2

    b = _loop(tmp_path, JOINT, "b")  # same seed: the same initial adapters and topology policy as `a` had
    initial = {name: _lora(b, name) for name in ("first", "second")}
    logits0 = b.topology.logits[0].detach().clone()
    b.load(tmp_path / "a" / "checkpoints" / "step-1")  # the state after one joint step
    assert b.topology.version == 1 and not torch.equal(b.topology.logits[0], logits0)  # HRPO moved the topology
    for name in ("first", "second"):  # Flow-GRPO moved both adapters
        assert any(not torch.equal(x, y) for x, y in zip(initial[name], _lora(b, name))), name
    asyncio.run(b.run())  # resume: step 2 again, from the checkpoint
    assert b.step == 2 and b.topology.version == 2
    for k, v in a.topology.state_dict().items():
        assert torch.allclose(b.topology.state_dict()[k], v, atol=1e-6), k
    for name in ("first", "second"):
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(_lora(a, name), _lora(b, name))), name


STAGED = JOINT.replace("  seed: 3\n", "  seed: 3\n  schedule: staged\n"
                        "  stages: {topology_steps: 1, node_steps: 1, node_topology: greedy}\n"
                        ).replace("steps: 2\n  queries", "steps: 3\n  queries")


class Temperatures:
    """A progress sink: the temperatures trainable policy `first` decoded at in each step's rollouts, and how each
    step's episodes picked their topology (sample / greedy)."""

    def __init__(self):
        self.steps: dict[int, set[float]] = {}
        self.modes: dict[int, set[str]] = {}
        self.current: int | None = None

    def phase(self, name: str, step: int, total: int) -> None:
        self.current = step if name in ("rollouts", "resampling") else None

    def emit(self, event) -> None:
        trace = getattr(event, "trace", None)
        if trace is not None and self.current is not None:
            self.steps.setdefault(self.current, set()).update(
                c.temperature for st in trace.steps for c in st.llm if c.policy == "first")
            self.modes.setdefault(self.current, set()).add(trace.topology.mode)


@pytest.mark.slow
def test_staged_joint_learns_the_topology_on_greedy_nodes_then_the_nodes_then_both(tmp_path):
    (tmp_path / "plugin.py").write_text(PLUGIN)
    (tmp_path / "tasks.py").write_text(TASKS)
    (tmp_path / "graph.yaml").write_text(STAGED)
    graph = compile_spec(load_spec(tmp_path / "graph.yaml"), str(tmp_path / "graph.yaml"))
    seen = Temperatures()
    loop = TrainLoop(graph, load_task_file(str(tmp_path / "tasks.py:Alternating")), tmp_path / "s", dtype="float32",
                     sinks=[seen])
    state = [(loop.topology.logits[0].detach().clone(), _lora(loop, "first"), _lora(loop, "second"))]
    for _ in range(3):  # one step at a time, to see what each step moved
        loop.cfg.steps = loop.step + 1
        asyncio.run(loop.run())
        state.append((loop.topology.logits[0].detach().clone(), _lora(loop, "first"), _lora(loop, "second")))
    moved = [[not torch.equal(prev[0], cur[0])] + [any(not torch.equal(p, q) for p, q in zip(prev[k], cur[k]))
                                                   for k in (1, 2)] for prev, cur in zip(state, state[1:])]
    # [topology, adapter first, adapter second] per step: the topology alone, then the nodes alone, then both
    assert moved == [[True, False, False], [False, True, True], [True, True, True]], moved
    # step 1 rolled the graph out as written (greedy), later steps sampled the trainable nodes (flow_grpo.temperature)
    assert seen.steps == {1: {0.0}, 2: {1.0}, 3: {1.0}}, seen.steps
    # `node_topology: greedy`: the node stage (step 2) took each query's most likely route, the others sampled it
    assert seen.modes == {1: {"sample"}, 2: {"greedy"}, 3: {"sample"}}, seen.modes
    rows = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [r["joint/stage"] for r in rows] == [0.0, 1.0, 2.0]


def _train_cli(tmp: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "masgraph.cli", "train", str(tmp / "graph.yaml"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)


def _same(x: object, y: object, path: str = "") -> None:
    """Nested checkpoint contents equal (tensors to float tolerance)."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.allclose(x.float(), y.float(), atol=1e-5), path
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), path
        for k in x:
            _same(x[k], y[k], f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y)):
            _same(a, b, f"{path}/{i}")
    else:
        assert x == y, path


@pytest.mark.slow
def test_sigkill_mid_joint_run_then_resume_matches_the_uninterrupted_run(tmp_path):
    """kill -9 during step 2 of a joint run (after step 1's checkpoint), then `masgraph train --resume`: step 2's
    topology policy with its optimizer, and both adapters, equal those of an uninterrupted run."""
    for name, text in (("plugin.py", PLUGIN), ("tasks.py", TASKS), ("graph.yaml", JOINT)):
        (tmp_path / name).write_text(text)
    runs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        proc = _train_cli(tmp_path, "--runs-dir", str(tmp_path / name))
        if name == "b":
            deadline = time.time() + 300
            while not list((tmp_path / "b").glob("*/checkpoints/step-1/state.json")):
                assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            [run] = (tmp_path / "b").iterdir()
            assert not (run / "checkpoints" / "step-2").exists()  # killed inside step 2
            proc = _train_cli(tmp_path, "--resume", str(run))
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        [runs[name]] = (tmp_path / name).iterdir()
    assert "resumed from" in err and "(step 1)" in err, err[-2000:]
    a, b = (runs[n] / "checkpoints" / "step-2" for n in ("a", "b"))
    _same(torch.load(a / "topology.pt", weights_only=True), torch.load(b / "topology.pt", weights_only=True))
    for adapter in ("first", "second"):
        wa = load_file(str(a / "adapters" / adapter / "adapter_model.safetensors"))
        wb = load_file(str(b / "adapters" / adapter / "adapter_model.safetensors"))
        _same(wa, wb, adapter)
