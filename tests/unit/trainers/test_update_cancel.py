"""Ctrl-C or SIGTERM during a training update (issue 58, finding 14: the process exited 101.5 s later, when the
update ended; during rollouts 0.2 s): the update runs on the event loop's thread with no `await`, so it asks
`masgraph.runtime.cancel.raise_if_cancelled` before each forward pass, and the CLI's SIGTERM handler runs at once
while it computes (`masgraph.cli.interrupt`). In-process here; tests/unit/cli/test_interrupt_update.py signals a
process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from masgraph.trace import LLMCall, Step, Trace
from masgraph.trainers.config import FlowGRPOConfig
from masgraph.trainers.flow_grpo import FlowGRPO


def _traces(learner) -> list[Trace]:
    """Eight one-call episodes of one question, rewards 1, 0, 1, 0, ...: eight rows with a learning signal."""
    lp = torch.log_softmax(learner.logits.detach(), -1).tolist()
    out = []
    for i in range(8):
        tok = i % 4
        call = LLMCall(policy="m", adapter="m", prompt_ids=[9], completion_ids=[tok], logprobs=[lp[tok]], text="x",
                       policy_version=0)
        out.append(Trace(episode_id=f"e{i}", item_id="q", query="q", reward=float(i % 2 == 0),
                         steps=[Step(episode_id=f"e{i}", index=0, node="memory", role="memory", turn=1, llm=[call])]))
    return out


# 8 reference passes (one row each), then 4 mini-batches of 2 passes and an optimizer step each: cancelled in a
# reference pass nothing stepped; in mini-batch 2's first pass, mini-batch 1 stepped
@pytest.mark.parametrize("at, stepped", [(2, 0), (11, 1)])
def test_a_cancelled_task_stops_its_update_at_the_next_forward_pass(categorical, at, stepped):
    learner = categorical()
    passes = []
    compute = learner.sequence_logprobs

    def counted(rows, adapter):
        passes.append(adapter)
        if len(passes) == at:
            asyncio.current_task().cancel()  # as Ctrl-C's handler does, from the main thread, mid-update
        return compute(rows, adapter)

    learner.sequence_logprobs = counted
    algo = FlowGRPO(learner, {"memory": "m"}, FlowGRPOConfig(lr=0.1, batching={"micro_batch": 1},
                                                            ppo={"num_mini_batches": 4}))

    async def update():
        return algo.update(_traces(learner))

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(update())
    assert len(passes) == at  # not one pass more (the full update: 8 reference + 8 update passes)
    # an optimizer that stepped before the cancel made a new version (no stale cache serves the old weights)
    assert learner.versions["m"] == stepped


def test_outside_a_task_the_update_runs_to_its_end(categorical):
    learner = categorical()
    metrics = FlowGRPO(learner, {"memory": "m"}, FlowGRPOConfig(lr=0.1, batching={"micro_batch": 1})).update(
        _traces(learner))
    assert metrics["rows/trained"] == 8 and learner.versions["m"] == 1
