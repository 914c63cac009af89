"""Cascade attention (masgraph/backends/hf/cascade.py): rows on a cached static prefix attend its KV once per
distinct prefix instead of a copy per row. It must decode what the copy-per-row layout decodes (same tokens,
logprobs within fp32 rounding) in every batch shape the backend builds, and the decode cache must hold only the
rows' own positions."""

from __future__ import annotations

import pytest
import torch

import masgraph.backends.hf.backend as backend_module
import masgraph.backends.hf.cascade as cascade_module
from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.cascade import NAME
from masgraph.spec import SamplingSpec
from tests.unit.backends.grids import grid

SYSTEM_A = {"role": "system", "content": "You are a careful assistant who checks each step. " * 3}
SYSTEM_B = {"role": "system", "content": "You plan the next tool call and say nothing else. " * 2}


def _requests() -> list[Request]:
    """Two static prefixes, a row with none, two rows sharing more than their prefix (a question's samples), suffixes
    of different lengths, greedy and seeded sampling rows (top-p too)."""
    question = "Tell me the sum of 17 and 25 and then the product of 3 and 4, showing each step of the work."
    prompts = [[SYSTEM_A, {"role": "user", "content": f"What is {i} + {i}?" + " Think." * i}] for i in range(3)]
    prompts += [[SYSTEM_B, {"role": "user", "content": "Plan: add two numbers."}],
                [{"role": "user", "content": "No system prompt here at all."}],
                [SYSTEM_A, {"role": "user", "content": question}], [SYSTEM_A, {"role": "user", "content": question}]]
    return [Request(m, sampling=SamplingSpec(temperature=0.0 if i % 3 == 0 else 1.0, top_p=0.9 if i == 4 else 1.0,
                                             max_tokens=5 + i), seed=i)
            for i, m in enumerate(prompts)]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= 2e-5


@pytest.mark.parametrize(*grid({"chunk": [None, 64], "per": ["adapter", "prefix"], "arch": ["llama", "qwen2"]},
                              fast=[(None, "prefix", "qwen2"), (64, "adapter", "llama")]))
def test_cascade_decodes_what_the_copied_prefixes_decode(tiny_model, arch, per, chunk, monkeypatch):
    if chunk:  # a long prefill's queries attend in chunks
        monkeypatch.setattr(cascade_module, "_MAX_SCORES", chunk)
    backend = HFBackend(str(tiny_model(arch)), dtype="float32")
    assert backend.cascade and backend.model.config._attn_implementation == NAME
    backend.one_loop_per = per
    reqs = _requests()
    cascaded = backend.generate(reqs)
    backend.cascade = False
    copied = backend.generate(reqs)
    _same(cascaded, copied)
    assert backend.stats["prompt_tokens_shared"] > 0  # the rows sharing a question went through the middle path
    backend.cascade, backend.deterministic = True, True  # rows alone (batch 1) on the cascade too
    _same(backend.generate(reqs), copied)


def test_the_decode_cache_holds_only_each_rows_own_positions(tiny_model, monkeypatch):
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")
    seen = []
    decode = backend_module.decode

    def watched(model, cache, prefix_len, suffixes, *args, **kwargs):
        out = decode(model, cache, prefix_len, suffixes, *args, **kwargs)
        seen.append((cache.layers[0].keys.shape[2], kwargs.get("cascade", args[-1])))
        return out

    monkeypatch.setattr(backend_module, "decode", watched)
    reqs = [r for r in _requests() if r.messages[0] is SYSTEM_A][:3]
    done = backend.generate(reqs)
    [(kv_length, cascade)] = seen
    assert cascade is not None
    prefix = len(backend.layout.static_prefix(reqs[0].messages, done[0].prompt_ids))
    assert prefix > 16
    # the cached positions: each row's prompt after the system prompt and its completion, never the prefix per row
    own = max(len(c.prompt_ids) for c in done) - prefix + max(len(c.completion_ids) for c in done)
    assert kv_length <= own


def test_models_it_cannot_serve_keep_sdpa(tiny_model):
    backend = HFBackend(str(tiny_model("mistral")), dtype="float32")  # a sliding window: its own cache layers
    assert not backend.cascade and backend.model.config._attn_implementation == "sdpa"
    done = backend.generate(_requests()[:2])
    assert all(c.completion_ids for c in done)


def test_outside_a_cascade_the_attention_is_sdpas(tiny_model):
    """The learner's passes run on the same model object: with no cascade active they must be sdpa's, bit for bit."""
    backend = HFBackend(str(tiny_model("qwen2")), dtype="float32")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ours = backend.model(input_ids=ids).logits
        backend.model.config._attn_implementation = "sdpa"
        theirs = backend.model(input_ids=ids).logits
    assert torch.equal(ours, theirs)


def test_the_stats_count_the_padding_the_prompt_passes_ran(tiny_model):
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")
    backend.pass_overhead = None  # one prompt pass, left-padded (test_buckets.py runs the passes without padding)
    sampling = SamplingSpec(temperature=0.0, max_tokens=2)
    short = Request([SYSTEM_A, {"role": "user", "content": "Hi."}], sampling=sampling)
    long = Request([SYSTEM_A, {"role": "user", "content": "Explain, in words, " + "why and how " * 6}],
                   sampling=sampling)
    backend.generate([short])
    assert backend.stats["prompt_positions_run"] == backend.stats["prompt_tokens_computed"]  # one row: no padding
    before = dict(backend.stats)
    backend.generate([short, long])
    computed = backend.stats["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    run = backend.stats["prompt_positions_run"] - before["prompt_positions_run"]
    lengths = [len(backend.encode(r.messages, 2)[0]) for r in (short, long)]
    assert run == computed + lengths[1] - lengths[0]  # the short row's left padding beside the long one


def test_the_rows_decode_through_the_cascade_on_a_gpu_too(tiny_model):
    """On an H200 a 64-row decode step of the 0.5B shape took 58.6 ms with the cascade and 123.4 ms reading each
    row's prefix copy, though the cascade adds ops (benchmarks/results/decode_ops.md): no device turns it off."""
    from masgraph.backends.hf.model import HFModel

    weights = HFModel(str(tiny_model("qwen2")), "float32")
    assert HFBackend(weights).cascade and backend_module.cascade_pays(weights)  # on this CPU
    weights.device = torch.device("cuda")  # what a model loaded on a GPU reports (nothing runs on it here)
    assert weights.attention and backend_module.cascade_pays(weights)
