"""Dynamic batching: requests from many coroutines are queued and run together on one worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class Stopped(Exception):
    """Raised by a batch's `run` that saw its stop flag set: nobody waits for the batch any more."""


class Batcher(Generic[In, Out]):
    """Queues items and runs them through `run(items, stop)` (blocking, one result per item, in order) in batches.

    The loop takes what is queued, waits up to `wait_ms` for more (never when the batch is full), and runs up to
    `max_batch_size` items at once on a dedicated thread. An exception from `run` fails every item of its batch
    with `error(exc)`; later batches go on.

    A thread cannot be stopped from outside, so each batch gets its own `stop` event, set when every caller
    waiting on the batch was cancelled or the batcher is closing (`aclose`, or its loop cancelled, as on Ctrl-C);
    a long `run` checks it (e.g. once per decode step) and raises `Stopped`, and its items' callers that still
    wait are cancelled. Otherwise the thread would run the batch to its end after everyone gave up.

    Example:
        >>> batcher = Batcher(lambda xs, stop: [x * 2 for x in xs], max_batch_size=8, wait_ms=3.0)
        >>> asyncio.run(batcher.submit([1, 2]))
        [2, 4]
    """

    def __init__(self, run: Callable[[list[In], threading.Event], list[Out]], max_batch_size: int = 32,
                 wait_ms: float = 3.0, error: Callable[[Exception], Exception] = lambda exc: exc,
                 thread_name: str = "masgraph-batch"):
        self.run, self.max_batch_size, self.wait_ms, self.error = run, max_batch_size, wait_ms, error
        self._queue: list[tuple[In, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._running: tuple[Future, threading.Event] | None = None
        """The batch on the thread: its future and stop flag."""
        # one dedicated thread runs every batch: torch's OpenMP team is per calling thread, and teams of
        # several pool threads spin against each other on a small CPU (2.2x slower at batch 1, measured)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    async def submit(self, items: list[In]) -> list[Out]:
        """Queue `items` and wait for their results."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._loop())
        futures = []
        for item in items:
            fut = loop.create_future()
            self._queue.append((item, fut))
            futures.append(fut)
        assert self._wake is not None
        self._wake.set()
        return list(await asyncio.gather(*futures))

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            await self._gather_more()
            batch, self._queue = self._queue[:self.max_batch_size], self._queue[self.max_batch_size:]
            if not self._queue:
                self._wake.clear()
            batch = [(x, f) for x, f in batch if not f.cancelled()]
            if not batch:
                continue
            futures, stop = [f for _, f in batch], threading.Event()

            def gave_up(_: asyncio.Future, futures: list[asyncio.Future] = futures, stop: threading.Event = stop
                        ) -> None:
                if all(f.cancelled() for f in futures):  # nobody waits for the batch: end it at its next step
                    stop.set()

            for fut in futures:
                fut.add_done_callback(gave_up)
            running = self._executor.submit(self.run, [x for x, _ in batch], stop)
            self._running = (running, stop)
            try:
                results = await asyncio.wrap_future(running)
            except asyncio.CancelledError:  # the batcher is closing: the thread ends the batch at its next step
                stop.set()
                for fut in futures:
                    fut.cancel()
                raise
            except Stopped:
                for fut in futures:
                    fut.cancel()
                continue
            except Exception as exc:  # the whole batch fails; each caller records it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(self.error(exc))
                continue
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)

    async def _gather_more(self) -> None:
        """Wait briefly for more items: until the batch is full or `wait_ms` passes with no arrival."""
        if self.wait_ms <= 0:
            await asyncio.sleep(0)
            return
        while len(self._queue) < self.max_batch_size:
            n = len(self._queue)
            await asyncio.sleep(self.wait_ms / 1000)
            if len(self._queue) == n:
                return

    async def aclose(self) -> None:
        """Stop the batch loop and the batch on the thread, and wait until the thread has left it; the callers of
        that batch and of the queued items are cancelled."""
        queued, self._queue = self._queue, []
        for _, fut in queued:
            fut.cancel()
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):
                pass
            self._worker = None
        if self._running is not None:
            running, stop = self._running
            stop.set()
            left = asyncio.wrap_future(running)
            await asyncio.wait([left])
            if not left.cancelled():
                left.exception()  # delivered to its callers already, or nobody waits: not logged as unretrieved
            self._running = None
