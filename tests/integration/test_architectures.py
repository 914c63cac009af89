"""`model: /path` works for every architecture people train agents with: a tiny random-weight model directory of
each (tests/conftest.py `tiny_model`) runs the AgentFlow graph, takes one Flow-GRPO step that really moves its LoRA
adapter (checkpointed, then resumed by a second TrainLoop), and serves the trained adapter from an exported bundle.

A random model writes garbage, so outputs fail to parse; what must hold is the plumbing: no backend error, token ids
and logprobs recorded for every call, LoRA on modules the architecture has (Phi3 fuses q/k/v into `qkv_proj`)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.errors import MasgraphError
from masgraph.graph import Graph, compile_spec
from masgraph.loader import load_spec, parse_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.serve.agent import load_agent
from masgraph.serve.bundle import export_bundle
from masgraph.spec import GraphSpec, SamplingSpec
from masgraph.tasks import BasicArithmetic, get_task
from masgraph.trainers.loop import TrainLoop

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# tests/conftest.py ARCHITECTURES (conftest cannot be imported under --import-mode=importlib)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "phi")

GRAPH = """\
name: tiny
policies:
  main: {{model: {model}, adapter: answer, trainable: true, sampling: {{max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train:
  steps: 1
  queries_per_step: 2
  eval_every: 0
  eval_n: 1
  concurrency: 4
  flow_grpo: {{group_size: 2, lr: 0.001}}
"""


class Alternating(BasicArithmetic):
    """Reward 1 for odd samples, 0 for even ones: every group has variance, whatever a random model writes."""

    name = "alternating"

    def reward(self, item, trace):
        return float(trace.meta["sample"] % 2)


def _on_model(spec: GraphSpec, model: Path, max_tokens: int) -> Graph:
    """`spec` with every policy's `model:` the given directory and short completions."""
    policies = {name: p.model_copy(update={"model": str(model), "sampling": p.sampling.model_copy(
        update={"max_tokens": max_tokens})}) for name, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies}))


def _lora(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_agentflow_runs_on_the_architecture(arch, tiny_model, tmp_path):
    graph = _on_model(load_spec(ROOT / "graphs" / "agentflow.yaml"), tiny_model(arch), max_tokens=4)
    runner = Runner(graph, RunConfig(n=2, concurrency=2, runs_dir=str(tmp_path / "runs")))
    try:
        traces = asyncio.run(runner.run_task(get_task("basic_arithmetic"))).traces
    finally:
        asyncio.run(runner.aclose())
    assert len(traces) == 2
    for t in traces:  # garbage output is a recorded parse failure, never a failed episode or step
        assert t.status == "ok", (t.status, t.error)
        assert all(s.error is None for s in t.steps), [s.error for s in t.steps]
    calls = [c for t in traces for c in t.llm_calls]
    assert calls and {"planner", "verifier"} <= {c.adapter for c in calls}  # LoRA adapters served on it
    for c in calls:
        assert c.prompt_ids and c.completion_ids and len(c.completion_ids) == len(c.logprobs)
        assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_flow_grpo_step_trains_checkpoints_resumes_and_serves(arch, tiny_model, tmp_path):
    model = tiny_model(arch)
    graph = compile_spec(parse_spec(GRAPH.format(model=model), "tiny.yaml"))
    run = tmp_path / "run"
    loop = TrainLoop(graph, Alternating(), run)
    before = _lora(loop.learner.weights.model)
    assert before and all(not p.any() for n, p in before.items() if "lora_B" in n)  # zero-effect at init
    last = asyncio.run(loop.run())
    assert last["rows/trained"] > 0 and loop.step == 1
    after = _lora(loop.learner.weights.model)
    assert after.keys() == before.keys()
    assert any(after[n].any() for n in after if "lora_B" in n), "the step did not move the adapter"

    checkpoint = run / "checkpoints" / "step-1"
    assert (checkpoint / "adapters" / "answer" / "adapter_model.safetensors").is_file()
    resumed = TrainLoop(graph, Alternating(), run)
    resumed.load(checkpoint)
    assert resumed.step == 1
    loaded = _lora(resumed.learner.weights.model)
    assert loaded.keys() == after.keys() and all(torch.equal(loaded[n], after[n]) for n in after)

    # export -> serve: the bundle's adapter loads on this architecture, as trained, and answers
    agent = load_agent(export_bundle(run, tmp_path / "bundle"))
    try:
        [backend] = agent.engine.backends.values()
        served = {n: p for n, p in _lora(backend.model).items() if ".answer." in n}
        assert served.keys() == after.keys() and all(torch.equal(served[n], after[n]) for n in after)
        answer = agent.ask("What is 2 + 3?")
    finally:
        agent.close()
    assert answer.trace.status == "ok", answer.trace.error
    assert isinstance(answer.answer, str)
    [call] = answer.trace.llm_calls
    assert call.adapter == "answer" and len(call.completion_ids) == len(call.logprobs) > 0


@pytest.mark.parametrize("arch", ["phi3", "qwen3"])
def test_all_linear_targets_train_save_the_expanded_modules_and_resume(arch, tiny_model, tmp_path):
    model = tiny_model(arch)
    spec = GRAPH.format(model=model).replace("train:\n", "train:\n  lora_targets: all-linear\n")
    graph = compile_spec(parse_spec(spec, "tiny.yaml"))
    assert graph.spec.train.lora_targets == ["all-linear"]
    run = tmp_path / "run"
    loop = TrainLoop(graph, Alternating(), run)
    asyncio.run(loop.run())
    saved = json.loads((run / "checkpoints" / "step-1" / "adapters" / "answer" / "adapter_config.json").read_text())
    linear = {n for n, m in loop.learner.weights.base_model.named_modules() if isinstance(m, torch.nn.Linear)}
    # peft writes all-linear as the model's linear layers (full names), all but the output head
    assert saved["target_modules"] and set(saved["target_modules"]) < {n.removesuffix(".base_layer") for n in linear}
    assert not any(t.endswith("lm_head") for t in saved["target_modules"])
    resumed = TrainLoop(graph, Alternating(), run)
    resumed.load(run / "checkpoints" / "step-1")
    assert resumed.step == 1

    # another shape is still refused: the check compares, it does not wave through
    other = TrainLoop(compile_spec(parse_spec(GRAPH.format(model=model), "tiny.yaml")), Alternating(), run)
    with pytest.raises(MasgraphError, match="LoRA rank, alpha, targets"):
        other.load(run / "checkpoints" / "step-1")


# a Gemma-1/2-style template: no system role, roles must alternate (SmolLM2's turn markers, as its vocabulary has them)
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _complete(model: Path, request: Request) -> tuple[HFBackend, list]:
    """A fresh hf backend on `model` (its tokenizer and generation config read now) and its completion of `request`."""
    backend = HFBackend(str(model), dtype="float32")

    async def go():
        try:
            return await backend.complete([request])
        finally:
            await backend.aclose()
    return backend, asyncio.run(go())


def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_first_user_turn(tiny_model, tmp_path):
    model = _copy(tiny_model("gemma2"), tmp_path / "gemma2-it")
    (model / "chat_template.jinja").write_text(NO_SYSTEM_TEMPLATE)
    messages = [{"role": "system", "content": "You answer sums."}, {"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "Answer: 5"}, {"role": "user", "content": "4 + 4?"}]
    backend, [c] = _complete(model, Request(messages, sampling=SamplingSpec(max_tokens=2)))
    assert c.completion_ids and len(c.completion_ids) == len(c.logprobs)
    prompt = backend.tokenizer.decode(c.prompt_ids)
    assert prompt.startswith("<|im_start|>user\nYou answer sums.\n\n2 + 3?<|im_end|>\n<|im_start|>assistant")


def test_decoding_stops_at_the_models_end_of_turn_tokens_from_its_generation_config(tiny_model, tmp_path):
    model = _copy(tiny_model("phi3"), tmp_path / "phi3-instruct")
    request = Request([{"role": "user", "content": "Hi"}], sampling=SamplingSpec(max_tokens=3))
    backend, [before] = _complete(model, request)
    first, tokenizer_eos = before.completion_ids[0], backend.tokenizer.eos_token_id
    assert first != tokenizer_eos and before.finish_reason == "length"
    config = json.loads((model / "generation_config.json").read_text())
    # like Phi-3's [<|endoftext|>, <|end|>] or Gemma's [<eos>, <end_of_turn>]: the turn's end is not the tokenizer's EOS
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [tokenizer_eos, first]}))
    _, [after] = _complete(model, request)
    assert after.completion_ids == [first] and after.finish_reason == "stop" and after.text == ""
