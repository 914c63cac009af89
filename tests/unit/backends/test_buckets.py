"""Length-bucketed prompt passes (masgraph/backends/hf/buckets.py): a batch's prompt parts run as passes over rows of
similar length. The plan must be the cheapest grouping, and a bucketed batch must decode what one left-padded pass
decodes (same tokens, logprobs within fp32 rounding) in every layout the backend builds, running fewer positions."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.buckets import pass_cost, plan
from masgraph.spec import SamplingSpec
from tests.unit.backends.adapters import perturbed
from tests.unit.backends.grids import grid

SYSTEM_A = {"role": "system", "content": "You are a careful assistant who checks each step. " * 3}
SYSTEM_B = {"role": "system", "content": "You plan the next tool call and say nothing else. " * 2}


def _cost(passes: list[list[int]], lengths: list[int], overhead: int) -> int:
    return sum(overhead + len(p) * max(lengths[i] for i in p) for p in passes)


def _partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield [*part[:k], [first, *part[k]], *part[k + 1:]]


def test_plan_is_the_cheapest_grouping():
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
        overhead = rng.choice([0, 3, 16, 32, 100])
        passes = plan(lengths, overhead)
        assert sorted(itertools.chain(*passes)) == list(range(len(lengths)))  # every row once
        assert all(p == sorted(p) for p in passes) and passes == sorted(passes)  # row order
        best = min(_cost(p, lengths, overhead) for p in _partitions(list(range(len(lengths)))))
        assert _cost(passes, lengths, overhead) == best


def test_plan_keeps_close_lengths_together_and_far_ones_apart():
    assert plan([10, 11, 10, 12], 32) == [[0, 1, 2, 3]]
    assert plan([300, 20, 310, 25], 32) == [[0, 2], [1, 3]]
    assert plan([300, 20, 310, 25], None) == [[0, 1, 2, 3]]  # None: one pass
    assert plan([7], 0) == [[0]]


def _requests() -> list[Request]:
    """Suffixes of very different lengths on two prefixes and none, two pairs of rows sharing more than their prefix
    (a question's samples: the middle pass), greedy and sampling rows."""
    long = "Tell me the sum of 17 and 25 and then the product of 3 and 4, showing each step. " * 3
    prompts = [[SYSTEM_A, {"role": "user", "content": "Hi."}],
               [SYSTEM_A, {"role": "user", "content": long}], [SYSTEM_A, {"role": "user", "content": long}],
               [SYSTEM_A, {"role": "user", "content": "What is 2 + 2? Think." * 4}],
               [SYSTEM_B, {"role": "user", "content": "Plan."}], [SYSTEM_B, {"role": "user", "content": "Plan."}],
               [SYSTEM_B, {"role": "user", "content": long + " And then plan it."}],
               [{"role": "user", "content": "No system prompt here at all, and a longer question than most."}]]
    return [Request(m, sampling=SamplingSpec(temperature=0.0 if i % 3 == 0 else 1.0, max_tokens=4 + i % 3), seed=i)
            for i, m in enumerate(prompts)]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= 2e-5


@pytest.mark.parametrize(*grid({"per": ["adapter", "batch"], "cascade": [True, False], "arch": ["llama", "qwen2"]},
                              fast=[("adapter", True, "qwen2"), ("batch", False, "llama")]))
def test_bucketed_passes_decode_what_one_pass_decodes(tiny_model, arch, cascade, per):
    backend = HFBackend(str(tiny_model(arch)), dtype="float32")
    assert backend.pass_overhead == 32  # on by default on a CPU
    backend.cascade, backend.one_loop_per = backend.cascade and cascade, per
    reqs = _requests()
    if per == "batch":  # several adapters in one loop: each pass names its rows' adapters
        perturbed(backend, "planner", 1)
        reqs = [dataclasses.replace(r, adapter="planner" if i % 2 else None) for i, r in enumerate(reqs)]
    backend.pass_overhead = None
    backend.generate(reqs)  # the static prefixes' KV cached: the runs compared below compute only the rest
    before = dict(backend.stats)
    one = backend.generate(reqs)
    one_run = backend.stats["prompt_positions_run"] - before["prompt_positions_run"]
    computed = backend.stats["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert backend.stats["prompt_tokens_shared"] > 0  # the middle pass ran too
    backend.pass_overhead = 0  # every distinct length its own pass: no padding at all
    before = dict(backend.stats)
    bucketed = backend.generate(reqs)
    _same(bucketed, one)
    assert backend.stats["prompt_tokens_computed"] - before["prompt_tokens_computed"] == computed
    assert backend.stats["prompt_positions_run"] - before["prompt_positions_run"] == computed < one_run


def test_rows_without_any_cached_prefix_bucket_too(tiny_model):
    """No static prefix anywhere: the passes start from an empty cache."""
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")
    reqs = [Request([{"role": "user", "content": "Say " + "more and " * (3 * i) + "stop."}],
                    sampling=SamplingSpec(temperature=0.0, max_tokens=4)) for i in range(4)]
    backend.pass_overhead = None
    before = dict(backend.stats)
    one = backend.generate(reqs)
    one_run = backend.stats["prompt_positions_run"] - before["prompt_positions_run"]
    backend.pass_overhead = 0
    before = dict(backend.stats)
    _same(backend.generate(reqs), one)
    computed = backend.stats["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert backend.stats["prompt_positions_run"] - before["prompt_positions_run"] == computed < one_run


def test_a_windowed_model_keeps_one_pass(tiny_model):
    backend = HFBackend(str(tiny_model("mistral")), dtype="float32")
    assert pass_cost(backend.model) is None and backend.pass_overhead is None
    assert all(c.completion_ids for c in backend.generate(_requests()[:3]))
