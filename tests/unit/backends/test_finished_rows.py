"""A decode row that finished (EOS or its max_tokens) leaves the batch at the end of its step: each later step runs
only the rows still decoding, and every row decodes what it decoded when the finished rows rode along."""

from __future__ import annotations

import dataclasses

import pytest

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec
from tests.unit.backends.adapters import perturbed
from tests.unit.backends.grids import grid

SYSTEM = {"role": "system", "content": "You are a careful assistant who checks each step of the work. " * 2}


def _requests() -> list[Request]:
    return [Request([SYSTEM, {"role": "user", "content": f"Question {i}: what is {i} + {2 * i}?"}],
                    sampling=SamplingSpec(temperature=0.0 if i % 2 else 1.0, max_tokens=limit), seed=i)
            for i, limit in enumerate([2, 9, 4, 9, 1, 6])]


def _rows_per_forward(backend: HFBackend, requests: list[Request]) -> tuple[list, list[int]]:
    seen: list[int] = []
    hook = backend.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        done = backend.generate(requests)
    finally:
        hook.remove()
    return done, seen


@pytest.mark.parametrize(*grid({"per": ["adapter", "batch"], "cascade": [True, False]},
                              fast=[("adapter", True), ("batch", False)]))
def test_finished_rows_leave_the_batch(tiny_model, cascade, per):
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")
    backend.cascade, backend.one_loop_per = backend.cascade and cascade, per
    backend.share_prompts, backend.pass_overhead = False, None  # one prompt pass, then the one-token steps
    reqs = _requests()
    if per == "batch":  # several adapters in one loop: the adapter names follow the rows that stay
        perturbed(backend, "planner", 1)
        reqs = [dataclasses.replace(r, adapter="planner" if i % 2 else None) for i, r in enumerate(reqs)]
    backend.generate(reqs)  # the static prefix's KV cached: the passes below are the decode's own
    backend.drop_finished = False
    along, steps_along = _rows_per_forward(backend, reqs)
    backend.drop_finished = True
    dropped, steps = _rows_per_forward(backend, reqs)
    lengths = [len(c.completion_ids) for c in dropped]
    assert steps_along == [len(reqs)] * max(lengths)  # before: every row in every step
    # step k (after the prompt pass) runs the rows that had not finished after step k - 1
    assert steps == [len(reqs)] + [sum(n > k for n in lengths) for k in range(1, max(lengths))]
    assert steps[-1] < len(reqs)
    for a, b in zip(dropped, along, strict=True):
        assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 2e-5
