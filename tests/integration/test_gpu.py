"""What only a GPU can show: the weights, adapters, optimizer states and RNG states live on CUDA; a real out-of-memory
in an update is one error line naming the knob, with the last checkpoint intact. `make test-gpu` runs these with
the other `gpu`-marked real-model tests (flow-grpo, joint, determinism, kill -9 resume, export, serve), which
run on CUDA there because their graphs say `device: auto`. Skipped where torch sees no GPU.

These three passed on an H200 (RESULTS.md, 2026-11-27 20:00); the Flow-GRPO real-model ones failed there."""

from __future__ import annotations

import asyncio

import pytest
import torch

from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.rundir.checkpoint import latest_checkpoint
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.loop import TrainLoop

pytestmark = [pytest.mark.integration, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRAPH = """\
name: gpu
policies:
  main: {model: smollm2-135m, adapter: answer, trainable: true, device: cuda, sampling: {max_tokens: 8}}
nodes:
  answer: {role: generator, policy: main, prompt: direct}
entry: answer
exit: answer
train:
  steps: 2
  queries_per_step: 2
  eval_every: 0
  eval_n: 2
  checkpoint_every: 1
  seed: 3
  flow_grpo: {group_size: 4, lr: 0.002}
"""


class Alternating(BasicArithmetic):
    name = "alternating"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


def _loop(tmp_path, **train):
    spec = parse_spec(GRAPH, "gpu.yaml")
    spec = spec.model_copy(update={"train": spec.train.model_copy(update=train)})
    return TrainLoop(compile_spec(spec), Alternating(), tmp_path / "run")


def test_a_training_step_keeps_everything_on_the_gpu(tmp_path):
    loop = _loop(tmp_path)
    assert loop.learner.device.type == "cuda"
    assert all(p.is_cuda for p in loop.learner.weights.model.parameters())
    last = asyncio.run(loop.run())
    assert last["rows/trained"] > 0 and last["step"] == 2 and last["memory/peak_gib"] > 0
    states = [s for opt in loop.algo.optimizers.values() for st in opt.state.values() for s in st.values()
              if torch.is_tensor(s) and s.dim() > 0]
    assert states and all(s.is_cuda for s in states)  # Adam moments next to their parameters
    rng = torch.load(latest_checkpoint(tmp_path / "run") / "rng.pt", weights_only=False)
    assert len(rng["cuda"]) == torch.cuda.device_count()  # CUDA generators are checkpointed too


def test_bf16_is_picked_on_a_gpu_that_supports_it():
    from masgraph.backends.hf.dtype import pick_dtype

    if torch.cuda.is_bf16_supported():
        assert pick_dtype(device=torch.device("cuda")) == torch.bfloat16


def test_a_real_out_of_memory_in_an_update_names_the_knob_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    loop = _loop(tmp_path, steps=3)
    update = loop.algo.update

    def starved(traces, seed=0):  # from step 2 on, the update may allocate almost nothing
        if loop.step >= 1:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(
                (torch.cuda.memory_allocated() + 1024**2) / torch.cuda.get_device_properties(0).total_memory)
        return update(traces, seed)

    monkeypatch.setattr(loop.algo, "update", starved)
    try:
        with pytest.raises(Exception, match=r"out of device memory.*micro_batch_tokens.*gradient_checkpointing"):
            asyncio.run(loop.run())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step-1"
    resumed = _loop(tmp_path, steps=3)
    resumed.load(checkpoint)
    assert asyncio.run(resumed.run())["step"] == 3
