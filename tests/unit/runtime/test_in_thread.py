"""`masgraph.runtime.cancel.in_thread`: an update in a worker thread (rollouts decode meanwhile on the event loop)
that a Ctrl-C still stops at its next `raise_if_cancelled`, and never outlives the task awaiting it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from masgraph.runtime.cancel import in_thread, raise_if_cancelled


def _work(done: list[int], started: threading.Event) -> str:
    for i in range(500):
        started.set()
        raise_if_cancelled()
        time.sleep(0.01)
        done.append(i)
    return "finished"


def test_cancelling_the_awaiting_task_stops_the_work_at_its_next_check_before_the_task_ends():
    done: list[int] = []
    started = threading.Event()

    async def main() -> None:
        task = asyncio.create_task(in_thread(_work, done, started))
        await asyncio.to_thread(started.wait)
        await asyncio.sleep(0.05)
        task.cancel()  # as Ctrl-C's handler does
        with pytest.raises(asyncio.CancelledError):
            await task
        stopped = len(done)
        await asyncio.sleep(0.1)
        assert len(done) == stopped  # the thread had returned before the task did
        assert stopped < 100  # at its next check, not at the end of its 500 rounds

    asyncio.run(main())


def test_the_event_loop_runs_beside_the_work_and_gets_its_result():
    ticks: list[int] = []

    async def tick() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def main() -> str:
        ticker = asyncio.create_task(tick())
        result = await in_thread(time.sleep, 0.3)  # holds no GIL, as torch's kernels do not
        ticker.cancel()
        return result

    assert asyncio.run(main()) is None
    assert len(ticks) >= 10


def test_a_plain_thread_and_a_plain_call_are_never_cancelled():
    raise_if_cancelled()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            raise_if_cancelled()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assert
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert errors == []
