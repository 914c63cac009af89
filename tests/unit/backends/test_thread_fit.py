"""The hf decode loop and the learner's logprob passes fit torch's thread count to the machine's load at every step
(masgraph/threads.py): one thread while other processes hold the cores; a deterministic decode keeps the full count."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from masgraph import threads
from masgraph.backends.base import LoraConfigSpec, Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.spec import SamplingSpec
from masgraph.threads import LoadGuard


class BusyGuard(LoadGuard):
    """Other processes always hold both cores; counts the fits."""

    def __init__(self):
        super().__init__(period_s=0.0, read=lambda: None, cores=2, full=2)
        self.calls = 0
        self.others = 2.0

    def apply(self, full: bool = False) -> int:
        self.calls += 1
        return super().apply(full)


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float = 1.0


def _in_thread(fn):
    out = {}
    full = torch.get_num_threads()

    def run():
        try:
            fn()
            out["threads"] = torch.get_num_threads()
        finally:
            torch.set_num_threads(full)  # the default later threads start from, as before

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["threads"]


@pytest.fixture
def busy(monkeypatch):
    guard = BusyGuard()
    monkeypatch.setattr(threads, "_guard", guard)
    monkeypatch.setattr(threads, "_looked", True)
    return guard


@pytest.mark.slow
def test_decode_fits_its_threads_every_step_and_deterministic_decode_keeps_them(tiny_model, busy):
    reqs = [Request([{"role": "user", "content": f"Count to {i}"}],
                    sampling=SamplingSpec(temperature=1.0, max_tokens=6), seed=i) for i in range(2)]
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")
    done = []
    assert _in_thread(lambda: done.extend(backend.generate(reqs))) == 1
    steps = max(len(c.completion_ids) for c in done)
    assert steps > 1 and busy.calls == 1 + steps  # before the prefills, then every step (not once per batch)
    backend.deterministic = True
    assert _in_thread(lambda: backend.generate(reqs)) == 2


@pytest.mark.slow
def test_the_learners_passes_fit_their_threads(tiny_model, busy):
    learner = HFLearner(str(tiny_model("llama")), dtype="float32")
    learner.add_adapter("solver", LoraConfigSpec(rank=4, alpha=8))
    rows = [Row([1, 2, 3, 4], [5, 6]), Row([1, 2, 7], [8])]
    assert _in_thread(lambda: learner.sequence_logprobs(rows, "solver")) == 1
    assert busy.calls == 1
