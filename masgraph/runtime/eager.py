"""Eager awaiting: run a coroutine up to its first suspension before paying for a timer or a task.

`await_within` awaits under a timeout whose timer is armed only if the coroutine suspends; `gather_eager` is
`asyncio.gather` that makes tasks only of the coroutines that suspend (as Python 3.12's eager task factory does).
Most node steps of a scripted or pure graph finish without ever suspending; arming and cancelling an
`asyncio.timeout` for each of them was ~17 % of the scheduler's per-step cost (profiled on a 10-node chain).
An asyncio timeout can only fire at a suspension point anyway, so a coroutine that never suspends could not
have timed out: running it up to its first suspension before arming the timer changes no outcome. Likewise a
32-branch fan-out of such steps spent most of its time creating and scheduling 32 tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


async def await_within(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Await `coro`; raise TimeoutError if it has not finished `timeout_s` seconds after it first suspends."""
    if not isinstance(coro, Coroutine):  # another awaitable: the plain timeout
        async with asyncio.timeout(timeout_s):
            return await coro
    try:
        first = coro.send(None)
    except StopIteration as done:  # finished without suspending: no timer needed
        return done.value
    except BaseException:
        coro.close()
        raise
    async with asyncio.timeout(timeout_s):
        return await _Resumed(coro, first)


async def gather_eager(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Results of `coros` in order, run concurrently: each starts at once, in order, and only those that
    suspend become tasks. If one raises while they are being started, every other coroutine is closed (its
    `finally` runs) and the exception propagates."""
    results: list[Any] = [None] * len(coros)
    started: dict[int, tuple[Any, asyncio.Future]] = {}
    for i, coro in enumerate(coros):
        try:
            first = coro.send(None)
        except StopIteration as done:
            results[i] = done.value
            continue
        except BaseException:
            for j, rest in enumerate(coros):
                if j != i:
                    rest.close()
            for waiting_on, task in started.values():
                task.cancel()
                if isinstance(waiting_on, asyncio.Future):
                    waiting_on.cancel()
            raise
        started[i] = (first, asyncio.ensure_future(_finish(coro, first)))
    if started:
        for i, value in zip(started, await asyncio.gather(*(task for _, task in started.values()))):
            results[i] = value
    return results


async def _finish(coro: Coroutine[Any, Any, T], first: Any) -> T:
    return await _Resumed(coro, first)


class _Resumed:
    """Awaitable that continues a coroutine already advanced to its first suspension (`first` is what it
    yielded to the event loop): every later yield, send, throw and close is passed through unchanged."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any):
        self.coro, self.first = coro, first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.first
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # e.g. the CancelledError of a timeout: delivered into the coroutine
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
