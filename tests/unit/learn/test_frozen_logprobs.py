"""The update's no-grad logprob pass (`FlowGRPO._frozen_logprobs`) serves the KL reference (adapters off) and the
old logprobs of teacher-forced alternatives (the rollout adapter): once an adapter has moved away from the base,
each must equal a direct `sequence_logprobs` under the same weights, row for row, across adapters and chunks."""

from __future__ import annotations

import torch

from masgraph.backends.hf.learner import HFLearner
from masgraph.learn.learner import LoraConfigSpec
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, Row


def test_reference_and_alternative_logprobs_match_a_direct_pass(tiny):
    learner = HFLearner(str(tiny), dtype="float32")
    for a in ("plan", "check"):
        learner.add_adapter(a, LoraConfigSpec())
    torch.manual_seed(0)
    with torch.no_grad():  # move both adapters away from the base (LoRA's B starts at 0: adapter = base)
        for a in ("plan", "check"):
            for p in learner.parameters(a):
                p.add_(0.5 * torch.randn_like(p))
    algo = FlowGRPO(learner, {"planner": "plan", "verifier": "check"}, FlowGRPOConfig(batching={"micro_batch": 2}))
    rows = [Row(i, "planner" if i % 2 else "verifier", "plan" if i % 2 else "check", [3 + i % 4, 5, 6, 7][: 2 + i % 3],
                [8 + i % 3, 9, 4][: 1 + i % 3], [], 0.5, 0, alternative="x" if i % 3 == 0 else None) for i in range(7)]

    ref = algo._reference_logprobs(rows)
    with torch.no_grad():
        base = learner.sequence_logprobs(rows, None)
    assert len(ref) == len(rows) and all(torch.allclose(r, b, atol=1e-5) for r, b in zip(ref, base))

    algo._alternatives_old_logprobs(rows)
    for r in rows:
        if r.alternative is None:
            assert r.old_logprobs == []  # only the alternatives are filled
            continue
        with torch.no_grad():
            [direct] = learner.sequence_logprobs([r], r.adapter)
        assert torch.allclose(torch.tensor(r.old_logprobs), direct.float(), atol=1e-5)
        assert not torch.allclose(direct, base[rows.index(r)], atol=1e-3)  # the adapter really differs from base
