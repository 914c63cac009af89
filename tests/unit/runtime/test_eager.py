"""await_within and gather_eager: the outcomes of asyncio.timeout and asyncio.gather, with timers and tasks
made only for coroutines that suspend."""

import asyncio

import pytest

from masgraph.runtime.eager import await_within, gather_eager


async def instant():
    return 7


async def sleeper(s: float, log: list):
    try:
        await asyncio.sleep(s)
        return "woke"
    except asyncio.CancelledError:
        log.append("cancelled")  # the timeout's cancellation reaches the coroutine itself
        raise


async def several_suspensions():
    total = 0
    for i in range(5):
        await asyncio.sleep(0)
        total += i
    return total


async def raises_after_suspending():
    await asyncio.sleep(0)
    raise ValueError("boom")


def test_result_with_and_without_suspension():
    assert asyncio.run(await_within(instant(), 0.01)) == 7
    assert asyncio.run(await_within(several_suspensions(), 1)) == 10


def test_no_timer_for_a_coroutine_that_never_suspends(monkeypatch):
    armed = []
    real = asyncio.timeout
    monkeypatch.setattr(asyncio, "timeout", lambda s: armed.append(s) or real(s))
    asyncio.run(await_within(instant(), 1))
    assert armed == []
    asyncio.run(await_within(several_suspensions(), 1))
    assert armed == [1]


def test_timeout_fires_and_cancels_the_coroutine():
    log = []
    with pytest.raises(TimeoutError):
        asyncio.run(await_within(sleeper(5, log), 0.05))
    assert log == ["cancelled"]


def test_exceptions_pass_through():
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(await_within(raises_after_suspending(), 1))


def test_outer_cancellation_is_not_a_timeout():
    log = []

    async def main():
        task = asyncio.create_task(await_within(sleeper(5, log), 10))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["cancelled"]


def test_other_awaitables_use_the_plain_timeout():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await await_within(fut, 0.02)
    asyncio.run(main())


def test_gather_eager_keeps_order_and_runs_suspending_ones_concurrently(monkeypatch):
    made = []
    real = asyncio.ensure_future
    monkeypatch.setattr(asyncio, "ensure_future", lambda c: made.append(c) or real(c))

    async def main():
        t0 = asyncio.get_running_loop().time()
        out = await gather_eager([instant(), sleeper(0.1, []), several_suspensions(), sleeper(0.1, []), instant()])
        return out, asyncio.get_running_loop().time() - t0

    out, took = asyncio.run(main())
    assert out == [7, "woke", 10, "woke", 7]
    assert len(made) == 3  # tasks only for the three that suspend
    assert took < 0.19  # the two 0.1 s sleeps overlapped


def test_gather_eager_failure_closes_every_other_coroutine():
    log = []

    async def tracked(name):
        try:
            await asyncio.sleep(5)
        finally:
            log.append(name)

    async def raises_at_once():
        raise ValueError("now")

    async def main():
        late = tracked("late")
        with pytest.raises(ValueError, match="now"):
            await gather_eager([tracked("started"), raises_at_once(), late])
        assert late.cr_frame is None

    asyncio.run(main())
    assert log == ["started"]  # the started one left through its finally; the late one never ran


def test_gather_eager_propagates_a_later_exception():
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(gather_eager([several_suspensions(), raises_after_suspending()]))
