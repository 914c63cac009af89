"""The captured decode step (masgraph/backends/hf/captured.py): traced whole (`fullgraph`: a graph break fails the
trace), it decodes what the eager loop decodes; a batch of a shape seen before reuses its static cache (a replayed
CUDA graph reads it where it is); a changed adapter is read by the replayed step; a batch of several adapters and a
stopped batch behave as in the eager loop. On a CPU the traced step runs eagerly (torch.compile's "eager" backend):
what a GPU replays as one graph is the same traced step."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf import captured as captured_module
from masgraph.backends.hf.batcher import Stopped
from masgraph.backends.hf.captured import CapturedDecoder, slots
from masgraph.errors import MasgraphError
from masgraph.spec import SamplingSpec
from tests.unit.backends.adapters import perturbed

SYSTEM = {"role": "system", "content": "You are a careful assistant who checks each step of the work."}


def _requests(n: int = 6, adapter: str | None = None) -> list[Request]:
    """Prompts of different lengths, greedy and sampled rows, different max_tokens (rows finish at different steps)."""
    return [Request([SYSTEM, {"role": "user", "content": f"Question {i}: {i} + {2 * i}?" + " and more" * i}],
                    sampling=SamplingSpec(temperature=0.0 if i % 2 else 1.0, max_tokens=[2, 9, 4, 9, 1, 6][i % 6]),
                    seed=i, adapter=adapter) for i in range(n)]


def _same(a, b, atol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert len(x.logprobs) == len(y.logprobs)
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) <= atol


@pytest.fixture
def backend(tiny_model) -> HFBackend:
    return HFBackend(str(tiny_model("llama")), dtype="float32")


def test_the_captured_step_decodes_what_the_eager_loop_decodes(backend):
    reqs = _requests()
    eager = backend.generate(reqs)
    assert backend.stats["decode_loops"] == 1
    backend.capture_decode("eager")
    traced = counters["stats"]["unique_graphs"]
    captured = backend.generate(reqs)
    assert backend.captured.shapes == 1  # the captured path ran (one static cache made)
    assert counters["stats"]["unique_graphs"] - traced == 1  # traced once for its 8 steps: each step replays it
    _same(captured, eager)  # fp32: the same tokens, logprobs within 1e-5 (another attention kernel, masked)
    assert [len(c.completion_ids) for c in captured] == [2, 9, 4, 9, 1, 6]  # finished rows' picks dropped
    again = backend.generate(reqs)
    assert backend.captured.shapes == 1 and len(backend.captured._caches) == 1  # the same shape: its cache reused
    _same(again, captured, atol=0.0)
    assert counters["stats"]["unique_graphs"] - traced == 1
    backend.generate(_requests(3))  # 3 rows: 4 slots, another shape
    assert backend.captured.shapes == 2
    assert slots(3) == 4 and slots(1) == 1 and slots(64) == 64 and slots(65) == 128


def test_a_shape_past_the_captured_ones_decodes_in_the_eager_loop(backend, monkeypatch):
    """A decoder captures its first `SHAPES` shapes and keeps their caches (a cache made again would be a new CUDA
    graph each time, and dynamo's recompile limit is an error under fullgraph); another shape goes eager."""
    monkeypatch.setattr(captured_module, "SHAPES", 1)
    eager = backend.generate(_requests(3))
    backend.capture_decode("eager")
    backend.generate(_requests())  # 6 rows: the one captured shape
    _same(backend.generate(_requests(3)), eager, atol=0.0)  # 3 rows: another shape, the eager loop's own result
    assert backend.captured.shapes == 1 and backend.captured.declined == 1


def test_a_model_with_sliding_window_layers_is_refused():
    """Its cache layers count positions in Python ints: the step would be traced again at every position."""
    model = SimpleNamespace(config=SimpleNamespace(sliding_window=16), device=torch.device("cpu"))
    with pytest.raises(MasgraphError, match="sliding-window"):
        CapturedDecoder(model)
    CapturedDecoder(SimpleNamespace(config=SimpleNamespace(sliding_window=None), device=torch.device("cpu")))


def test_an_adapter_changed_in_place_is_read_by_the_replayed_step(backend):
    perturbed(backend, "planner", 1)
    reqs = _requests(adapter="planner")
    backend.capture_decode("eager")
    before = backend.generate(reqs)
    lora = [p for n, p in backend.model.named_parameters() if "lora_B" in n and "planner" in n]
    with torch.no_grad():
        for p in lora:
            p.mul_(-3.0)  # as an optimizer step does: the same tensors, new values
    after = backend.generate(reqs)
    assert backend.captured.shapes == 1  # both batches took the captured step, one shape
    backend.captured = None
    _same(after, backend.generate(reqs))  # the eager loop under the changed weights
    assert any(a.logprobs != b.logprobs for a, b in zip(after, before))


def test_several_adapters_in_one_batch_take_the_eager_loop(backend):
    perturbed(backend, "planner", 1)
    reqs = [dataclasses.replace(r, adapter="planner" if i % 2 else None) for i, r in enumerate(_requests())]
    backend.one_loop_per = "batch"  # both adapters in one loop: PEFT's per-row adapter names, not captured
    eager = backend.generate(reqs)
    backend.capture_decode("eager")
    _same(backend.generate(reqs), eager, atol=0.0)
    assert backend.captured.shapes == 0
    backend.one_loop_per = "adapter"  # one loop per adapter (the default): each captured
    _same(backend.generate(reqs), eager)
    assert backend.captured.shapes == 1  # 3 rows of each adapter: one shape


def test_a_stopped_batch_ends_at_its_next_step(backend):
    backend.capture_decode("eager")
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        backend.generate(_requests(2), stop)
    assert backend.captured.shapes == 1  # stopped in the captured loop
