"""The captured decode step (masgraph/backends/hf/captured.py) on the embedded SmolLM2-135M under a LoRA adapter
that changes its output: it decodes what the eager loop decodes. On a CPU the traced step runs eagerly (fp32: the same
tokens); on a GPU (marked `gpu`, `make test-gpu`) inductor compiles it once and replays each step as a CUDA graph
(bf16: the greedy rows' first picks equal; later ones a rounding difference could part at a near tie)."""

from __future__ import annotations

import pytest
import torch

from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec
from tests.unit.backends.adapters import perturbed

pytestmark = pytest.mark.integration

QUESTIONS = ["What is 17 + 25?", "Name a prime number above 20.", "Spell 'graph' backwards.", "What is 3 times 14?",
             "Which is larger, 0.5 or 0.45?"]


def _requests() -> list[Request]:
    return [Request([{"role": "user", "content": q}], adapter="planner", seed=i,
                    sampling=SamplingSpec(temperature=0.0 if i % 2 else 0.8, max_tokens=[12, 6, 12, 9, 3][i]))
            for i, q in enumerate(QUESTIONS)]


def _decode_both(device: str, dtype: str, backend: str) -> tuple[list, list, HFBackend]:
    hf = HFBackend("smollm2-135m", dtype=dtype, device=device)
    perturbed(hf, "planner", 0)
    eager = hf.generate(_requests())
    hf.capture_decode(backend)
    return eager, hf.generate(_requests()), hf


def test_the_captured_step_decodes_what_the_eager_loop_does_on_the_real_model():
    eager, captured, hf = _decode_both("cpu", "float32", "eager")
    assert hf.captured.shapes == 1  # 5 rows in 8 slots, one cache length
    for a, b in zip(eager, captured, strict=True):
        assert b.completion_ids == a.completion_ids and b.finish_reason == a.finish_reason
        # fp32 sums in another order (BLAS inside the trace, oneDNN outside; attention over the static length; the
        # thread count `fit_threads` picks per step): 5e-6..6e-5 in quiet runs, 3.5e-4 once right after a busy one
        # (tests/integration/test_captured_real.py, 2026-12-04). A wrong position or mask moves them by O(1).
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-3
    assert len({tuple(c.completion_ids) for c in captured}) == len(QUESTIONS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_step_replays_as_a_cuda_graph_and_decodes_the_same():
    from torch._dynamo.utils import counters

    traced, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    eager, captured, hf = _decode_both("cuda", "bfloat16", "inductor")
    assert hf.captured.graphs and counters["inductor"]["cudagraph_skips"] == skips  # CUDA graphs, not plain inductor
    for i, (a, b) in enumerate(zip(eager, captured, strict=True)):
        if i % 2:  # greedy rows: the first pick (bf16 rounding may part them later, at a near tie)
            assert b.completion_ids[0] == a.completion_ids[0]
        assert len(b.completion_ids) == len(b.logprobs) > 0
    again = hf.generate(_requests())  # replayed: the same shape, nothing recompiled
    assert hf.captured.shapes == 1 and [c.completion_ids for c in again] == [c.completion_ids for c in captured]
    assert counters["stats"]["unique_graphs"] - traced == 1
