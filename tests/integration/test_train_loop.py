"""TrainLoop on the real model: `batching.zero_variance: resample` replaces all-equal groups with fresh queries, and
`max_minutes` stops training on its wall-clock budget (then evaluates and checkpoints)."""

from __future__ import annotations

import asyncio
import json

import pytest

from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.loop import TrainLoop

pytestmark = pytest.mark.integration

GRAPH = """\
name: tiny
policies:
  main: {model: smollm2-135m, adapter: answer, trainable: true, sampling: {max_tokens: 6}}
nodes:
  answer: {role: generator, policy: main, prompt: direct}
entry: answer
exit: answer
train:
  steps: 1
  queries_per_step: 2
  eval_every: 0
  eval_n: 1
  flow_grpo: {group_size: 2, batching: {zero_variance: resample, resample_rounds: 3}}
"""


class FirstQueriesFlat(BasicArithmetic):
    """Reward 0 for every sample of the first two training queries (zero variance), alternating after."""

    name = "first_flat"

    def reward(self, item, trace):
        if item.id.endswith(("-0", "-1")) and "-train-" in item.id:
            return 0.0
        return float(trace.meta["sample"] % 2)


def test_resample_replaces_zero_variance_groups_and_budget_stops(tmp_path):
    graph = compile_spec(parse_spec(GRAPH, "tiny.yaml"))
    loop = TrainLoop(graph, FirstQueriesFlat(), tmp_path / "run")
    last = asyncio.run(loop.run())
    # both first queries were flat: one extra round of 2 fresh queries, both informative
    assert last["resample_rounds"] == 1 and last["groups/informative"] == 2 and loop.cursor == 4
    assert last["rows/trained"] == 4  # only the informative groups' samples are trained on
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-1" / "state.json").read_text())
    assert state["cursor"] == 4

    fg = graph.spec.train.flow_grpo
    skip = fg.model_copy(update={"batching": fg.batching.model_copy(update={"zero_variance": "skip"})})
    budget = graph.spec.model_copy(update={"train": graph.spec.train.model_copy(
        update={"steps": 50, "max_minutes": 1e-4, "flow_grpo": skip})})
    loop = TrainLoop(compile_spec(budget), FirstQueriesFlat(), tmp_path / "budget")
    last = asyncio.run(loop.run())
    assert loop.step == 1 and "accuracy/test" in last  # out of time after one step: evaluated, checkpointed
    assert (tmp_path / "budget" / "checkpoints" / "step-1" / "state.json").exists()
