"""The trainer's one seam: an algorithm is a `TrainAlgorithm` the registry names, and the loop drives whichever one a
graph's `train:` section asks for. A fourth algorithm is one file outside trainers/ (a graph plugin here), registered
like the built-in three: the loop rolls out its groups, calls its update, publishes the adapters it changed, and
checkpoints and restores its state. The loop itself names no algorithm and imports no backend."""

from __future__ import annotations

import ast
import asyncio
import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.registry import Registry, default_registry, register_core
from masgraph.tasks import Item, Task
from masgraph.trainers.loop import TrainLoop


class Sums(Task):
    """`i + 1 ?` questions; the reward is the sample's parity (every group has a signal)."""

    name = "sums"

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        op = "+" if split == "train" else "*"
        return [Item(f"{split}-{seed}-{i}", f"{i % 19} {op} 1 ?", str(i)) for i in range(n)]

    def score(self, item: Item, answer: str) -> float:
        return float(answer.strip() == item.answer)

    def reward(self, item, trace) -> float:
        return float(trace.meta["sample"] % 2)

ROOT = Path(__file__).resolve().parents[3]

PLUGIN = '''
"""A tiny algorithm: each step nudges every LoRA parameter of each trained adapter by the step's mean reward."""
from typing import Literal

import torch

from masgraph.registry import Algorithm
from masgraph.trainers import train_loop
from masgraph.trainers.algorithm import TrainAlgorithm, query_groups
from masgraph.trainers.config import TrainSpec


class NudgeSpec(TrainSpec):
    algorithm: Literal["nudge"] = "nudge"
    size: int = 3


class Nudge(TrainAlgorithm):
    state_file = "nudge.pt"

    def __init__(self, learner, adapters, size):
        self.learner, self.adapters, self.group_size = learner, adapters, size
        self.steps, self.groups_seen = 0, []

    @classmethod
    def build(cls, ctx):
        return cls(ctx.learner, sorted(set(ctx.trainable.values())), ctx.config.size)

    def train_step(self, traces, step):
        self.groups_seen.append([len(g) for g in query_groups(traces, self.group_size)])
        push = sum(t.reward or 0.0 for t in traces) / len(traces) + 1.0
        with torch.no_grad():
            for a in self.adapters:
                for p in self.learner.parameters(a):
                    p.add_(push * 1e-3)
                self.learner.new_version(a)
        self.steps += 1
        return {"nudge/push": push}

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])


def register(registry):
    registry.algorithms["nudge"] = Algorithm("nudge", NudgeSpec, lambda spec, reg: [], train_loop, lambda: Nudge)
'''

GRAPH = """\
name: nudged
plugins: [nudge_algo.py]
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{max_tokens: 3}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{algorithm: nudge, size: 3, steps: 2, queries_per_step: 2, eval_every: 0, eval_n: 2, checkpoint_every: 1,
         concurrency: 6}}
"""


def _graph(tiny: Path, tmp_path: Path):
    """The graph, whose `plugins:` brings the algorithm its `train:` section names (compiled against a registry of
    its own, so the process-wide one never learns `nudge`)."""
    (tmp_path / "nudge_algo.py").write_text(PLUGIN)
    path = tmp_path / "nudged.yaml"
    path.write_text(GRAPH.format(model=tiny))
    registry = Registry()
    register_core(registry)
    for ep in entry_points(group="masgraph.plugins"):
        ep.load()(registry)
    assert "nudge" not in registry.algorithms  # the graph's plugin registers it while the graph compiles
    return compile_spec(parse_spec(path.read_text(), str(path), registry), file=str(path), registry=registry)


@pytest.mark.slow
def test_a_fourth_algorithm_is_one_plugin_file_and_the_loop_drives_it(tiny, tmp_path):
    graph = _graph(tiny, tmp_path)
    assert type(graph.spec.train).__name__ == "NudgeSpec"  # the registry parsed the section with its model
    loop = TrainLoop(graph, Sums(), tmp_path / "run", dtype="float32")
    before = [p.detach().clone() for p in loop.learner.parameters("answer")]
    asyncio.run(loop.run())

    algo = loop.algo
    assert type(algo).__name__ == "Nudge" and algo.steps == 2
    assert algo.groups_seen == [[3, 3], [3, 3]]  # its group_size decided the rollouts: 2 queries x 3 samples
    assert all(not torch.equal(b, p) for b, p in zip(before, loop.learner.parameters("answer")))
    assert loop.backend.versions["answer"] == loop.learner.version("answer") == 2  # the loop published them
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and all(m["nudge/push"] >= 1.0 for m in lines)
    assert 0.0 <= lines[0]["groups/no_signal"] <= 1.0

    step2 = tmp_path / "run" / "checkpoints" / "step-2"
    assert (step2 / "nudge.pt").is_file() and not (step2 / "optimizer.pt").exists()
    again = TrainLoop(_graph(tiny, tmp_path), Sums(), tmp_path / "again", dtype="float32")
    again.load(step2)
    assert again.algo.steps == 2 and again.step == 2 and again.learner.version("answer") == 2
    assert all(torch.equal(a, b) for a, b in zip(again.learner.parameters("answer"),
                                                   loop.learner.parameters("answer")))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_loop_names_no_algorithm_and_imports_no_backend():
    loop = ROOT / "trainers" / "loop.py"
    imports = _imports(loop)
    assert any(m.startswith("masgraph.trainers.algorithm") for m in imports)  # the walk sees its imports
    algorithms = set(default_registry().algorithms)
    assert {"flow_grpo", "hrpo", "joint"} <= algorithms
    modules = {f"masgraph.trainers.{m}" for m in ("flow_grpo", "hrpo", "hrpo_math", "joint")}
    assert not [m for m in imports if m.split(".")[:3] and ".".join(m.split(".")[:3]) in modules]
    backends = [m for m in imports if m.startswith("masgraph.backends") and not m.startswith("masgraph.backends.base")]
    assert backends == []  # the serving backends come from masgraph.learn.serving; only the protocol is named
    strings = {n.value for n in ast.walk(ast.parse(loop.read_text()))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & algorithms, strings & algorithms
