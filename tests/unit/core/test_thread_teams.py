"""A thread done with a phase of kernels lets its OpenMP workers go (masgraph/threads.py `release_team`): libgomp
counts every thread's team, and once the teams of two threads of this process outnumber the cores it cuts every
wait to 100 spins, so each parallel region of the decode paid a sleep and a wake (a 32-row bf16 step: 107 ms in one
thread, 158 ms beside another thread's idle team). Counted here as the process's OS threads (Linux, libgomp)."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from masgraph import threads
from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec

pytestmark = pytest.mark.skipif(threads._find_pause() is None, reason="needs Linux and the libgomp torch loads")


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _team() -> None:
    """A parallel region on two threads: the calling thread keeps a team with one worker thread."""
    torch.set_num_threads(2)
    torch.ones(1 << 22).sin_()


def _warm() -> None:
    """What a first parallel region starts once (a thread of torch's that stays) is there before anything counts."""
    _team()
    threads.release_team()


def _in_thread(*calls):  # noqa: ANN001, ANN002, ANN202
    """Run `calls` one after another on one new thread (after `_warm`); their results."""
    with ThreadPoolExecutor(1) as pool:
        return [pool.submit(fn).result() for fn in (_warm, *calls)][1:]


def test_a_threads_team_outlives_its_region_until_it_is_released():
    def run() -> tuple[int, int, int]:
        start = _tasks()
        _team()
        kept = _tasks()
        threads.release_team()
        return start, kept, _tasks()

    [(start, kept, released)] = _in_thread(run)
    assert kept == start + 1  # the worker waits for the thread's next region
    assert released == start
    threads.release_team()  # no team: nothing to do


def test_generate_lets_its_threads_workers_go_and_complete_the_callers(tiny_model):
    backend = HFBackend(str(tiny_model("llama")), dtype="float32")  # SmolLM2's vocabulary: parallel regions
    requests = [Request([{"role": "user", "content": "What is 1 + 2?"}], seed=0,
                        sampling=SamplingSpec(temperature=1.0, max_tokens=4))]
    # on one thread only: a thread that decoded in the last second takes its share of the cores (`LoadGuard`), and a
    # team of one has no worker
    start, _, after = _in_thread(_tasks, lambda: backend.generate(requests), _tasks)
    assert after == start  # the decode thread's worker went with the batch

    async def served() -> int:
        await backend.complete(requests)  # the batcher's thread starts
        _team()  # the event loop's thread has a team, as after loading the model or an update
        before = _tasks()
        await backend.complete(requests)  # the batcher's thread decodes: the caller's worker goes first
        return before - _tasks()

    assert asyncio.run(served()) >= 1
