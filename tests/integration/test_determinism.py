"""Deterministic mode on the real model: the same items reproduce bit-exactly (completion ids, logprobs,
answers) whatever the episode concurrency, the arrival timing of requests and the load beside the run."""

from __future__ import annotations

import asyncio
import random

import pytest

from masgraph.backends.base import Completion, Request
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.spec import SamplingSpec
from masgraph.tasks import get_task

pytestmark = [pytest.mark.integration, pytest.mark.gpu]  # the GPU tier runs these on CUDA (device: auto)


class Jittery:
    """Forwards to a backend after a random few milliseconds, so batches form differently on every run."""

    returns_tokens = True

    def __init__(self, inner, seed: int):
        self.inner, self._rng = inner, random.Random(seed)

    async def complete(self, requests: list[Request]) -> list[Completion]:
        await asyncio.sleep(self._rng.uniform(0, 0.02))
        return await self.inner.complete(requests)

    async def aclose(self) -> None:
        return None


def _signature(result) -> list:
    return [(t.item_id, t.answer, [(c.completion_ids, c.logprobs) for c in t.llm_calls])
            for t in sorted(result.traces, key=lambda t: t.item_id)]


def test_deterministic_mode_is_independent_of_concurrency_and_timing(root, hf, runner_for, run, busy):
    spec = load_spec(root / "graphs" / "single.yaml")
    hot = spec.policies["main"].model_copy(update={"sampling": SamplingSpec(temperature=0.7, max_tokens=10)})
    graph = compile_spec(spec.model_copy(update={"policies": {"main": hot}}))
    task = get_task("basic_arithmetic")
    hf.deterministic = True
    try:
        sigs = [_signature(run(runner_for(graph, hf, n=8, concurrency=1, seed=3).run_task(task)))]
        with busy(2):  # the others beside two spinning processes: a busy machine changes no result
            sigs += [_signature(run(runner_for(graph, backend, n=8, concurrency=8, seed=3).run_task(task)))
                     for backend in (hf, Jittery(hf, 0))]
    finally:
        hf.deterministic = False
    assert sigs[0] == sigs[1] == sigs[2]
    # evaluation's deterministic view: a second backend over the same weights, nothing flipped on the first
    from masgraph.backends.hf import HFBackend

    view = HFBackend(hf.weights, deterministic=True, max_batch_size=16)
    assert view.model is hf.model and hf.deterministic is False
    assert _signature(run(runner_for(graph, view, n=8, concurrency=8, seed=3).run_task(task))) == sigs[0]
    assert all(lps for _, _, calls in sigs[0] for _, lps in calls)
    calls = [c for t in run(runner_for(graph, hf, n=1, seed=3).run_task(task)).traces for c in t.llm_calls]
    assert calls and all((c.temperature, c.top_p) == (0.7, 1.0) for c in calls)  # the sampling is recorded
