"""A model whose layers attend a sliding window (Mistral, Qwen2 with `use_sliding_window`, Gemma 2's local layers)
decodes and scores each row as it would alone when rows of different lengths share a batch. transformers' window
mask and window cache count positions, pads included, so the batched layout's pad gap (cached prefix | left-padded
suffix) pushed a row's earliest real tokens out of its window; where a gap could reach the window, rows now batch only
with rows of their own prefix and prompt length, and the learner's pass runs whole sequences left-padded."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.cascade import gaps_fit
from masgraph.backends.hf.learner import HFLearner
from masgraph.spec import SamplingSpec

SYSTEM = "1 + 2 = 3 . 4 + 5 = 9 . 6 * 2 = 12 . 8 - 3 = 5 ."
QUESTIONS = ["3 + 4 ?", "9 * 2 + 1 - 7 ?", "12 - 5 = ?", "1 ?", "2 * 3 * 4 * 5 + 6 ?"]
WINDOW = 8


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float = 1.0


@pytest.fixture(scope="module")
def windowed(tiny, tmp_path_factory):
    """The tiny Llama's word-level tokenizer on a 2-layer Mistral whose layers attend the last 8 positions."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    path = tmp_path_factory.mktemp("tiny-mistral-window")
    for f in tiny.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, path / f.name)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           sliding_window=WINDOW, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    MistralForCausalLM(config).save_pretrained(path)
    return path


def _requests(temperature: float) -> list[Request]:
    return [Request([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], seed=i,
                    sampling=SamplingSpec(temperature=temperature, max_tokens=6)) for i, q in enumerate(QUESTIONS)]


def test_the_rule_lets_gaps_through_only_where_they_cannot_reach_a_window():
    from types import SimpleNamespace as Config

    assert gaps_fit(Config(sliding_window=None), 10_000)  # every layer attends the whole context
    assert gaps_fit(Config(use_sliding_window=False, sliding_window=16), 10_000)  # Qwen2's window off
    assert gaps_fit(Config(sliding_window=16), 16) and not gaps_fit(Config(sliding_window=16), 17)
    assert not gaps_fit(Config(layer_types=["sliding_attention", "full_attention"], sliding_window=None), 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_windowed_model_decodes_each_row_of_a_batch_as_it_would_alone(windowed, temperature):
    backend = HFBackend(str(windowed), dtype="float32")
    requests = _requests(temperature)
    together = backend.generate(requests)
    lengths = {len(c.prompt_ids) for c in together}
    assert len(lengths) > 1 and min(lengths) + 6 > WINDOW  # rows of different lengths, each longer than the window
    for request, batched in zip(requests, together, strict=True):
        [alone] = backend.generate([request])
        assert batched.completion_ids == alone.completion_ids
        # fp32, the same positions attended: summation order only (a pushed-out position moves them by O(0.1))
        assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs)) <= 1e-5


def test_a_windowed_models_logprob_pass_scores_each_row_of_a_batch_as_it_would_alone(windowed):
    done = HFBackend(str(windowed), dtype="float32").generate(_requests(1.0))
    rows = [Row(c.prompt_ids, c.completion_ids) for c in done]
    learner = HFLearner(str(windowed), dtype="float32")
    with torch.no_grad():
        together = learner.sequence_logprobs(rows, None)
        for row, completion, batched in zip(rows, done, together, strict=True):
            [alone] = learner.sequence_logprobs([row], None)
            torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
            # and what the rollout recorded (its decode in steps, this pass teacher-forced: summation order apart)
            torch.testing.assert_close(batched, torch.tensor(completion.logprobs), atol=1e-4, rtol=0)
