"""The rows of one adapter decode in one loop whatever their static prompt prefixes (a graph's nodes each have their own
system prompt): the prefixes' cached KVs are stacked, left-padded (layout.stack_prefixes). The completions are those of
each row decoded alone (greedy tokens equal, logprobs to fp32 summation order), and one loop ran instead of one per
prefix."""

from __future__ import annotations

import dataclasses

import pytest

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec
from tests.unit.backends.adapters import perturbed

SYSTEMS = ["1 + 2 = 3 . 4 + 5 = 9 . 6 * 2 = 12 . 8 - 3 = 5 . 7 + 7 = 14 .",
           "You plan. Write the steps one per line, then stop. Be brief and exact in every step you write.",
           "Check the answer below against the question; say yes or no, and nothing else at all, please."]


def _requests(temperature: float) -> list[Request]:
    out = []
    for s, system in enumerate(SYSTEMS):
        for q, question in enumerate(["3 + 4 ?", "9 * 2 ?", "9 * 2 ?"]):  # the last two share their whole prompt
            out.append(Request([{"role": "system", "content": system}, {"role": "user", "content": question}],
                               sampling=SamplingSpec(temperature=temperature, max_tokens=5 + q),
                               seed=10 * s + q, key=(s, q)))
    out.append(Request([{"role": "user", "content": "no system prompt: 5 + 5 ?"}],  # no cached prefix at all
                       sampling=SamplingSpec(temperature=temperature, max_tokens=6), seed=99, key=(9, 0)))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_on_different_prefixes_decode_in_one_loop_as_each_alone(tiny, temperature):
    backend = HFBackend(str(tiny), dtype="float32")
    requests = _requests(temperature)
    prefixes = {backend.layout.static_prefix(r.messages, backend.encode(r.messages, 8)[0]) for r in requests}
    assert len(prefixes) == 4 and () in prefixes and len({len(p) for p in prefixes}) > 2  # lengths differ
    alone = [backend.generate([r])[0] for r in requests]
    backend.one_loop_per = "prefix"  # the layout before: one loop per prefix
    loops = backend.stats["decode_loops"]
    apart = backend.generate(requests)
    assert backend.stats["decode_loops"] - loops == 4
    backend.one_loop_per = "adapter"  # the default
    loops = backend.stats["decode_loops"]
    shared = backend.stats["prompt_tokens_shared"]
    together = backend.generate(requests)
    assert backend.stats["decode_loops"] - loops == 1  # one loop for the four prefixes
    assert backend.stats["prompt_tokens_shared"] > shared  # each prefix's repeated question prefilled once
    for a, b, t in zip(alone, apart, together, strict=True):
        assert t.prompt_ids == a.prompt_ids and t.completion_ids == a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(t.logprobs, a.logprobs)) <= 1e-4
        assert t.batch_size == len(requests)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_several_adapters_decode_in_one_loop_as_each_alone(tiny, temperature):
    """The base and two adapters in one batch, on four prefixes: one loop (PEFT's mixed-adapter forward), the
    completions each row gets alone under its own adapter."""
    backend = HFBackend(str(tiny), dtype="float32")
    perturbed(backend, "planner", 1)
    perturbed(backend, "verifier", 2)
    names = [None, "planner", "verifier"]
    requests = [dataclasses.replace(r, adapter=names[i % 3]) for i, r in enumerate(_requests(temperature))]
    alone = [backend.generate([r])[0] for r in requests]
    base = [backend.generate([dataclasses.replace(r, adapter=None)])[0] for r in requests]
    assert sum(a.logprobs != b.logprobs for a, b in zip(alone, base)) >= 6  # the adapters change what is said
    backend.one_loop_per = "adapter"
    loops = backend.stats["decode_loops"]
    apart = backend.generate(requests)
    assert backend.stats["decode_loops"] - loops == 3
    backend.one_loop_per = "batch"
    loops = backend.stats["decode_loops"]
    together = backend.generate(requests)
    assert backend.stats["decode_loops"] - loops == 1
    for a, b, t in zip(alone, apart, together, strict=True):
        assert t.completion_ids == a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(t.logprobs, a.logprobs)) <= 1e-4


def test_a_model_in_training_mode_decodes_its_adapters_apart(tiny):
    """PEFT mixes adapters in eval mode only: a shared model the learner left in training mode decodes one loop per
    adapter, the same completions."""
    backend = HFBackend(str(tiny), dtype="float32")
    backend.one_loop_per = "batch"
    perturbed(backend, "planner", 1)
    requests = [dataclasses.replace(r, adapter="planner" if i % 2 else None) for i, r in enumerate(_requests(0.0))]
    together = backend.generate(requests)
    assert backend.stats["decode_loops"] == 1
    backend.weights.model.train()
    loops = backend.stats["decode_loops"]
    apart = backend.generate(requests)
    assert backend.stats["decode_loops"] - loops == 2
    assert [t.completion_ids for t in together] == [a.completion_ids for a in apart]


def test_rows_of_several_adapters_without_any_cached_prefix_decode_in_one_loop(tiny):
    """Mixed adapters, no static prefix anywhere (single-message prompts): nothing to stack, one loop from scratch."""
    backend = HFBackend(str(tiny), dtype="float32")
    perturbed(backend, "planner", 1)
    requests = [Request([{"role": "user", "content": f"no system prompt: {i} + {i} ?"}],
                        adapter="planner" if i % 2 else None, sampling=SamplingSpec(temperature=0.0, max_tokens=5))
                for i in range(4)]
    alone = [backend.generate([r])[0] for r in requests]
    backend.one_loop_per = "batch"
    loops = backend.stats["decode_loops"]
    together = backend.generate(requests)
    assert backend.stats["decode_loops"] - loops == 1
    assert [t.completion_ids for t in together] == [a.completion_ids for a in alone]
