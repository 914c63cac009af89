"""The memory knobs a GPU run needs: passes sized by a token budget, gradient checkpointing, and out-of-memory
errors that name the knob to turn and leave the last checkpoint intact (the OOM is forced: no GPU here)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from masgraph.backends.base import BackendError, Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.cli import main
from masgraph.graph import compile_spec
from masgraph.learn.learner import LoraConfigSpec
from masgraph.loader import parse_spec
from masgraph.rundir.checkpoint import latest_checkpoint
from masgraph.spec import SamplingSpec
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.flow_grpo import Row, micro_batches
from masgraph.trainers.loop import TrainLoop


def test_micro_batches_cap_rows_and_tokens_in_order():
    assert micro_batches([5, 5, 5, 5, 5], max_rows=2) == [[0, 1], [2, 3], [4]]
    assert micro_batches([5, 5, 5, 5, 5], max_rows=16, max_tokens=12) == [[0, 1], [2, 3], [4]]
    # a row over the budget goes alone; the budget counts the pass's tokens, not its longest row
    assert micro_batches([3, 20, 4, 4, 4], max_rows=16, max_tokens=10) == [[0], [1], [2, 3], [4]]
    assert micro_batches([3, 3, 3], max_rows=2, max_tokens=100) == [[0, 1], [2]]
    assert micro_batches([], max_rows=4, max_tokens=8) == []


def _rows(learner, n=3):
    tok = learner.weights.tokenizer
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief. " * 10},
                                      {"role": "user", "content": "2 + 2?"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    return [Row(0, "answer", "solver", prompt, tok.encode(f"Answer: {i + 3}", add_special_tokens=False),
                [-1.0] * 4, 1.0, 0, 1.0) for i in range(n)]


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model):
    learner = HFLearner(str(tiny_model("llama")), dtype="float32")
    learner.add_adapter("solver", LoraConfigSpec(rank=4, alpha=8))
    with torch.no_grad():  # a non-zero adapter, so its gradients flow through both LoRA factors
        for p in learner.parameters("solver"):
            p.add_(0.01)
    rows = _rows(learner)

    def grads():
        learner.train()
        for p in learner.parameters("solver"):
            p.grad = None
        lps = learner.sequence_logprobs(rows, "solver")
        torch.stack([lp.sum() for lp in lps]).sum().backward()
        learner.train(False)
        return [lp.detach() for lp in lps], [p.grad.clone() for p in learner.parameters("solver")]

    plain_lp, plain_g = grads()
    learner.gradient_checkpointing(True)
    assert _checkpointing(learner.weights.base_model)
    ckpt_lp, ckpt_g = grads()
    for a, b in zip(plain_lp, ckpt_lp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(plain_g, ckpt_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    learner.gradient_checkpointing(False)
    assert not _checkpointing(learner.weights.base_model)


def _checkpointing(model) -> bool:
    return model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") else \
        model.is_gradient_checkpointing


def test_a_rollout_out_of_memory_fails_its_calls_with_the_knobs_to_turn(tiny_model, monkeypatch):
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("masgraph.backends.hf.backend.decode", oom)
    req = Request([{"role": "user", "content": "hi"}], sampling=SamplingSpec(max_tokens=2))
    with pytest.raises(BackendError, match=r"out of device memory.*--concurrency.*max_tokens"):
        asyncio.run(backend.complete([req]))


GRAPH = """\
name: oom
policies:
  main: {{model: {model}, adapter: answer, trainable: true, sampling: {{max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main}}
entry: answer
exit: answer
train:
  task: alternating
  steps: 3
  queries_per_step: 1
  eval_every: 0
  eval_n: 1
  checkpoint_every: 1
  concurrency: 4
  flow_grpo: {{group_size: 2}}
"""


class Alternating(BasicArithmetic):
    """Reward by sample parity: every group has variance, so every step updates."""

    name = "alternating"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


def _oom_on_update(monkeypatch, at_update: int):
    """The learner's forward pass raises a CUDA OOM from the `at_update`-th update on."""
    real = HFLearner.sequence_logprobs
    seen = {"updates": 0, "last": None}

    def patched(self, rows, adapter):
        if adapter is None and seen["last"] is not rows:  # the reference pass opens each update
            seen["updates"] += 1
            seen["last"] = rows
        if seen["updates"] >= at_update:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, rows, adapter)

    monkeypatch.setattr(HFLearner, "sequence_logprobs", patched)


@pytest.mark.slow
def test_an_update_out_of_memory_names_the_knobs_and_keeps_the_last_checkpoint(tiny_model, tmp_path, monkeypatch):
    graph = compile_spec(parse_spec(GRAPH.format(model=tiny_model("llama")), "oom.yaml"))
    _oom_on_update(monkeypatch, at_update=2)
    loop = TrainLoop(graph, Alternating(), tmp_path / "run", dtype="float32")
    with pytest.raises(Exception, match=r"micro_batch_tokens.*gradient_checkpointing.*resume") as err:
        asyncio.run(loop.run())
    assert "out of device memory in the Flow-GRPO update" in str(err.value)
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step-1"  # the failed step 2 wrote nothing
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 1
    monkeypatch.undo()
    resumed = TrainLoop(graph, Alternating(), tmp_path / "run", dtype="float32")
    resumed.load(checkpoint)  # intact: it loads, and training goes on from it
    assert resumed.step == 1
    assert asyncio.run(resumed.run())["step"] == 3


def test_the_cli_prints_one_error_line_for_an_update_out_of_memory(tiny_model, tmp_path, monkeypatch, capsys):
    path = tmp_path / "oom.yaml"
    path.write_text(GRAPH.format(model=tiny_model("llama")))
    plugin = tmp_path / "alt.py"
    plugin.write_text("from masgraph.tasks import BasicArithmetic\n\n\nclass Alternating(BasicArithmetic):\n"
                      "    name = 'alternating'\n\n    def reward(self, item, trace):\n"
                      "        return float(trace.meta['sample'] % 2)\n")
    _oom_on_update(monkeypatch, at_update=1)
    code = main(["train", str(path), "--task", f"{plugin}:Alternating", "--runs-dir", str(tmp_path / "runs"),
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        next(line for line in err.splitlines() if "out of device memory" in line)]
    assert "Traceback" not in err


def test_an_update_that_fails_after_an_optimizer_step_still_counts_the_new_version(tiny_model, tmp_path,
                                                                                   monkeypatch):
    """Weights an optimizer stepped are a new version (served caches keyed by version must not be reused)."""
    text = GRAPH.format(model=tiny_model("llama")).replace("{group_size: 2}",
                                                           "{group_size: 2, ppo: {num_mini_batches: 2}}")
    loop = TrainLoop(compile_spec(parse_spec(text, "oom.yaml")), Alternating(), tmp_path / "run", dtype="float32")
    real, calls = HFLearner.sequence_logprobs, []

    def second_pass_fails(self, rows, adapter):
        if adapter is not None:
            calls.append(adapter)
            if len(calls) == 2:  # the second mini-batch, after the first one's optimizer step
                raise torch.OutOfMemoryError("CUDA out of memory")
        return real(self, rows, adapter)

    monkeypatch.setattr(HFLearner, "sequence_logprobs", second_pass_fails)
    with pytest.raises(Exception, match="out of device memory"):
        asyncio.run(loop.run())
    assert loop.learner.version("answer") == 1
