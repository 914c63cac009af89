"""One Flow-GRPO step on the real SmolLM2 with two trainable nodes, each with its own LoRA adapter."""

from __future__ import annotations

import math

import pytest
import torch

from masgraph.backends.base import Request
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.spec import SamplingSpec
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, Row, build_rows

pytestmark = [pytest.mark.integration, pytest.mark.gpu]  # the GPU tier runs these on CUDA (device: auto)


class AlternatingReward(BasicArithmetic):
    """Real arithmetic items, but a reward that is guaranteed to vary inside every group (odd samples win)."""

    name = "alternating"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


@pytest.mark.slow
def test_one_step_trains_two_adapters_and_leaves_the_base_alone(root, runner_for, run):
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.learner import LoraConfigSpec, WeightSync

    spec = load_spec(root / "graphs" / "agentflow.yaml")
    hot = SamplingSpec(temperature=1.0, max_tokens=24)
    policies = dict(spec.policies)
    policies["planner"] = policies["planner"].model_copy(update={"sampling": hot})
    policies["verify"] = policies["verify"].model_copy(update={"adapter": "verifier", "trainable": True,
                                                               "sampling": hot.model_copy(update={"max_tokens": 8})})
    graph = compile_spec(spec.model_copy(update={"policies": policies, "limits": spec.limits.model_copy(
        update={"max_turns": 2})}))
    learner = HFLearner(dtype="float32")
    for adapter in ("planner", "verifier"):
        learner.add_adapter(adapter, LoraConfigSpec())
    backend = HFBackend(learner.weights, max_batch_size=16)  # serves the learner's own model
    sync = WeightSync(learner, [backend])
    sync()
    result = run(runner_for(graph, backend, n=1, samples=4, concurrency=4).run_task(AlternatingReward()))
    traces = result.traces
    assert all(t.status == "ok" for t in traces) and {t.reward for t in traces} == {0.0, 1.0}

    trainable = {"planner": "planner", "verifier": "verifier"}
    config = FlowGRPOConfig(lr=2e-3, batching={"micro_batch": 4})
    algo = FlowGRPO(learner, trainable, config)
    rows = build_rows(traces, trainable, config)
    assert {r.adapter for r in rows} == {"planner", "verifier"}
    positive = [r for r in rows if r.advantage > 0]

    def row_logprobs(rs):
        out = []
        with torch.no_grad():
            for r in rs:
                out.append(float(learner.sequence_logprobs([r], r.adapter)[0].sum()))
        return out

    def base_tensors():
        return {k.replace(".base_layer", ""): v.detach().clone()
                for k, v in learner.weights.base_model.state_dict().items() if "lora" not in k}

    # the batched, shared-prefix forward gives each row's own logprobs and gradients (the prefix's grads summed)
    planner_rows = [r for r in rows if r.adapter == "planner"]
    lora = algo.params["planner"]
    learner.weights.model.zero_grad(set_to_none=True)
    batched = learner.sequence_logprobs(planner_rows, "planner")
    torch.stack([lp.sum() for lp in batched]).sum().backward()
    grads_batched = [p.grad.clone() for p in lora]
    learner.weights.model.zero_grad(set_to_none=True)
    single = [learner.sequence_logprobs([r], "planner")[0] for r in planner_rows]
    torch.stack([lp.sum() for lp in single]).sum().backward()
    for a, b in zip(batched, single):
        assert torch.allclose(a, b, atol=2e-4), (a, b)
    # fp32 sums in another order (one batched pass vs one pass per row): on a CPU measured up to 2.0e-5 of the
    # largest entry (5.5e-5 at 2.77, 2026-12-02, on rollouts of the inverse-CDF sampler); on an H200, whose fp32
    # kernels change their reduction order with the batch's shape, 2.25e-4 (2026-12-04, results/gpu.md). A lost
    # prefix gradient is O(1) of the largest entry (0.62 globally, 2026-12-03): either bound is far below it.
    scale = 1e-4 if learner.weights.device.type == "cpu" else 1e-3
    for p, g in zip(lora, grads_batched):
        worst = int(((g - p.grad).abs() - 1e-3 * p.grad.abs()).argmax())  # the entry furthest past rtol
        assert torch.allclose(g, p.grad, rtol=1e-3, atol=scale * float(g.abs().max()) + 1e-8), (
            f"worst entry {g.flatten()[worst]:.6e} vs {p.grad.flatten()[worst]:.6e}; largest deviation "
            f"{float((g - p.grad).abs().max()) / float(g.abs().max()):.2e} of the largest entry")
    learner.weights.model.zero_grad(set_to_none=True)

    base_before, lp_before = base_tensors(), row_logprobs(positive)
    metrics = algo.update(traces)
    assert sync() == ["planner", "verifier"]  # the weight-sync step: both new versions published

    assert math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["kl/ref_k3"])
    for adapter, params in algo.params.items():
        assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in params), adapter
        assert metrics[f"grad_norm/{adapter}"] > 0
        assert learner.version(adapter) == backend.versions[adapter] == 1  # next rollouts: the new version
    lp_after = row_logprobs(positive)
    gains = [a - b for a, b in zip(lp_after, lp_before)]
    assert sum(gains) / len(gains) > 0, gains  # positive-advantage samples became more likely
    after = base_tensors()
    assert after.keys() == base_before.keys() and all(torch.equal(base_before[k], after[k]) for k in after)

    # the updated adapters serve the next rollouts, stamped with their new version
    nxt = run(runner_for(graph, backend, n=1, samples=1, concurrency=1).run_task(AlternatingReward()))
    versions = {c.adapter: c.policy_version for t in nxt.traces for c in t.llm_calls if c.adapter}
    assert versions == {"planner": 1, "verifier": 1}


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_recorded_logprobs_are_recomputed_at_the_calls_sampling_params(hf, temperature, top_p):
    """The update's teacher-forced logprobs match the recorded ones at T != 1 and under top_p < 1 (both are the
    temperature-scaled softmax before nucleus truncation; greedy calls record the raw logits')."""
    from masgraph.backends.hf.learner import HFLearner

    sampling = SamplingSpec(temperature=temperature, top_p=top_p, max_tokens=16)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three fruits."}]
    calls = hf.generate([Request(msgs, sampling=sampling, seed=s) for s in range(3)])
    rows = [Row(0, "n", "a", c.prompt_ids, c.completion_ids, c.logprobs, 1.0, 0, temperature or 1.0) for c in calls]
    with torch.no_grad():  # the reference (adapters off) through a learner on the backend's own weights
        recomputed = HFLearner(hf.weights).sequence_logprobs(rows, None)
    for row, lp in zip(rows, recomputed):
        # on the host: on a GPU the recomputed logprobs are CUDA tensors, the recorded ones host floats
        assert torch.allclose(lp.cpu(), torch.tensor(row.old_logprobs), atol=1e-4), (lp, row.old_logprobs)

