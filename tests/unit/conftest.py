"""Unit fixtures: a tiny random Llama saved as an HF directory, for trainer and adapter tests that need a real
transformers model but not the embedded one's cost."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "system", "user", "assistant", "Answer:",
         *map(str, range(20)), *"+-*/=?.:,"]



def _benchmark(name: str) -> ModuleType:
    bench = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, bench)  # the scripts import their sibling learns.py
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(bench)


@pytest.fixture
def memory_bench() -> ModuleType:
    """benchmarks/memory.py as a module (its reference stores, its --resume checks)."""
    return _benchmark("memory")


@pytest.fixture
def memory_signal() -> ModuleType:
    """benchmarks/memory_signal.py as a module (how it reads a run's credit lines)."""
    return _benchmark("memory_signal")


@pytest.fixture
def replay_step() -> ModuleType:
    """benchmarks/replay_step.py as a module (its checks before any model loads)."""
    return _benchmark("replay_step")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights and a word-level tokenizer with a chat template, saved as an HF dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            unk_token="<unk>", chat_template=template).save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def two_routes():
    """start -> tool | direct -> end, the choice at `start` learnable: the scripted toy of the topology trainers'
    collapse tests (nodes on a scripted policy; the toys make their own traces)."""
    from masgraph.graph import GraphBuilder

    b = GraphBuilder("arms")
    for name in ("start", "tool", "direct", "end"):
        b.add_node(name, role="generator", policy="p")
    b.add_policy("p", backend="scripted")
    b.add_edge("start", "tool").add_edge("start", "direct").add_edge("tool", "end").add_edge("direct", "end")
    return b.set(entry="start", exit="end", topology={"choices": {"start": ["tool", "direct"]}}).compile()


class Categorical:
    """A learner whose one adapter is a context-free categorical over 4 tokens (logits start at [3, 0, 0, 0]); the
    reference is the uniform distribution: enough to see what an update does to one decision's probabilities."""

    def __init__(self):
        self.logits = torch.nn.Parameter(torch.tensor([3.0, 0.0, 0.0, 0.0]))  # token 0 near-certain (p 0.87)
        self.versions = {"m": 0}

    def adapters(self):
        return ["m"]

    def parameters(self, adapter):
        return [self.logits]

    def probs(self) -> list[float]:
        return torch.softmax(self.logits.detach(), -1).tolist()

    def sequence_logprobs(self, rows, adapter):
        logits = self.logits if adapter else torch.zeros(4)
        return [torch.log_softmax(logits, -1)[torch.tensor(r.completion_ids)] for r in rows]

    def train(self, mode=True):
        pass

    def new_version(self, adapter):
        self.versions[adapter] += 1
        return self.versions[adapter]


@pytest.fixture
def categorical():
    """The `Categorical` toy learner class (a test builds as many as it compares)."""
    return Categorical


@pytest.fixture
def one_node_graph(tiny):
    """one_node_graph(flow_grpo) -> a compiled graph of one trainable generator on the tiny model whose `train:`
    runs one step of 2 queries (`flow_grpo`: the inside of its YAML flow mapping, e.g. "group_size: 4, lr: 0.01")."""
    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec

    def make(flow_grpo: str):
        text = f"""\
name: one-node
policies:
  main: {{model: "{tiny}", adapter: answer, trainable: true, sampling: {{temperature: 1.0, max_tokens: 4}}}}
nodes:
  answer: {{role: generator, policy: main, prompt: direct}}
entry: answer
exit: answer
train: {{steps: 1, queries_per_step: 2, eval_every: 0, eval_n: 1, seed: 3, flow_grpo: {{{flow_grpo}}}}}
"""
        return compile_spec(parse_spec(text, "one-node.yaml"))
    return make
