"""A cancelled or closed hf batch stops decoding within a step or two (issue 28, finding 9: Ctrl-C during
`masgraph train` took 163 s because the generate thread ran its whole batch after the asyncio side gave up).

Bounds are counted in decode steps, or scaled from the step time measured in the same run: never a fixed
wall-clock number, so the tests hold on a busy machine."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from masgraph.backends.base import Request
from masgraph.backends.hf.batcher import Batcher
from masgraph.backends.hf.decode import decode
from masgraph.spec import SamplingSpec

LONG = 8192  # tokens (the most a request may ask): minutes at the fake model's pace, so only a stop ends it soon


class SlowModel:
    """A fake causal LM: each forward sleeps `step_s` and returns uniform logits, never EOS. `abort` makes it
    raise, so a test that fails does not leave its thread decoding for hours."""

    device = torch.device("cpu")

    def __init__(self, step_s: float = 0.02, vocab: int = 8):
        self.step_s, self.vocab, self.calls, self.abort = step_s, vocab, [], threading.Event()

    def __call__(self, input_ids, **_):
        if self.abort.is_set():
            raise RuntimeError("test over")
        time.sleep(self.step_s)
        self.calls.append(time.perf_counter())
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 1, self.vocab))

    def step_time(self) -> float:
        """The mean time between forwards so far (this machine's pace, load included)."""
        return (self.calls[-1] - self.calls[0]) / (len(self.calls) - 1)


def _requests(n: int) -> list[Request]:
    return [Request([{"role": "user", "content": "x"}], sampling=SamplingSpec(temperature=1.0, max_tokens=LONG),
                    seed=i) for i in range(n)]


def _batcher(model: SlowModel) -> Batcher[Request, object]:
    def run(reqs: list[Request], stop: threading.Event) -> list[object]:
        gens = [torch.Generator().manual_seed(i) for i in range(len(reqs))]
        return decode(model, None, 0, [[1, 2]] * len(reqs), reqs, gens, pad_id=0, eos_ids=set(), stop=stop)
    return Batcher(run, max_batch_size=4, wait_ms=0)


async def _settled(running, within_s: float) -> None:
    """Wait up to `within_s` for the thread's batch to end, and take its outcome (Stopped) so it is not logged."""
    left = asyncio.wrap_future(running)
    await asyncio.wait([left], timeout=within_s)
    if left.done():
        left.exception()


async def _started(model: SlowModel, steps: int = 4, within_s: float = 120.0) -> None:
    """Wait for the batch's first `steps` decode steps; fail (not hang) if the decode thread never gets there."""
    deadline = time.monotonic() + within_s
    while len(model.calls) < steps:
        if time.monotonic() > deadline:
            pytest.fail(f"the decode made {len(model.calls)} steps in {within_s:.0f}s (it raised, or never started)")
        await asyncio.sleep(0.005)


async def _thread_done(batcher: Batcher, model: SlowModel) -> tuple[int, float]:
    """Wait for the batch on the thread to end (bounded: 200 steps, far below the batch's length); the decode
    steps it made after the caller's side gave up and the seconds it took."""
    running, _ = batcher._running
    n, t0 = len(model.calls), time.perf_counter()
    await _settled(running, 200 * model.step_time())
    if not running.done():
        pytest.fail(f"the batch still decodes {200 * model.step_time():.1f}s after it was cancelled")
    return len(model.calls) - n, time.perf_counter() - t0


def test_a_batch_whose_callers_are_all_cancelled_stops_within_a_step(run):
    model = SlowModel()

    async def main():
        batcher = _batcher(model)
        callers = [asyncio.ensure_future(batcher.submit(_requests(2))), asyncio.ensure_future(
            batcher.submit(_requests(1)))]
        try:
            await _started(model)
            callers[0].cancel()
            await asyncio.sleep(3 * model.step_time())
            assert not batcher._running[0].done()  # one caller still waits: the batch goes on
            callers[1].cancel()
            steps, took = await _thread_done(batcher, model)
            assert steps <= 2 and took < 20 * model.step_time() + 1.0
            for c in callers:
                with pytest.raises(asyncio.CancelledError):
                    await c
            n = len(model.calls)
            await asyncio.sleep(5 * model.step_time())
            assert len(model.calls) == n  # nothing left running
            await batcher.aclose()
        finally:
            model.abort.set()

    run(main())


def test_closing_the_batcher_stops_its_batch_and_cancels_its_callers(run):
    model = SlowModel()

    async def main():
        batcher = _batcher(model)
        caller = asyncio.ensure_future(batcher.submit(_requests(3)))
        try:
            await _started(model)
            n, t0 = len(model.calls), time.perf_counter()
            await asyncio.wait_for(batcher.aclose(), 200 * model.step_time())  # returns once the thread is out
            assert batcher._running is None and len(model.calls) - n <= 2
            assert time.perf_counter() - t0 < 20 * model.step_time() + 1.0
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(caller, 200 * model.step_time())
        finally:
            model.abort.set()

    run(main())


def test_a_cancelled_hf_backend_batch_stops_decoding(tiny, run):
    """The real backend passes the batch's stop flag down to its decode loop (the tiny random model, slowed by a
    forward hook that counts the steps; EOS switched off so only a stop ends the batch early)."""
    from masgraph.backends.hf import HFBackend

    backend = HFBackend(str(tiny), dtype="float32", max_context=4096, batch_wait_ms=0)
    backend.layout.eos_ids = set()
    calls: list[float] = []
    abort = threading.Event()

    def slow(*_):
        if abort.is_set():
            raise RuntimeError("test over")
        time.sleep(0.01)
        calls.append(time.perf_counter())

    backend.model.register_forward_hook(slow)
    req = Request([{"role": "user", "content": "1 + 1 ?"}], sampling=SamplingSpec(temperature=1.0, max_tokens=3000),
                  seed=0)

    async def main():
        caller = asyncio.ensure_future(backend.complete([req]))
        try:
            while len(calls) < 5:
                await asyncio.sleep(0.005)
            step = (calls[-1] - calls[0]) / (len(calls) - 1)
            caller.cancel()
            running, _ = backend._batcher._running
            n = len(calls)
            await _settled(running, 200 * step)
            assert running.done() and len(calls) - n <= 2
            with pytest.raises(asyncio.CancelledError):
                await caller
            await backend.aclose()
        finally:
            abort.set()

    run(main())
    assert backend.stats["batches"] == 0  # the batch ended unfinished
