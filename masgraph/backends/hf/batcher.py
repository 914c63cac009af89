"""Dynamic batching: requests from many coroutines are queued and run together on one worker thread.

Each item tells its caller's `masgraph.workclock` waiter how it is served: waiting in the queue until its batch
starts (the node's work clock stops; the call records it as `queue_s`), then computed in a batch of n rows (the
clock runs at 1/n: the call's share of the batch); see masgraph/workclock.py for why."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from masgraph.workclock import Queued

In = TypeVar("In")
Out = TypeVar("Out")


_batch = threading.local()  # .rows_started: the running batch's callback, on the batch thread


def rows_started(items: list[Any]) -> None:
    """Called by a batch's `run` (on the batch thread) when it starts computing `items` (objects of its batch)
    together, and has finished the items it reported before. With `Batcher(reports_starts=True)` an item waits
    until then (and again after its rows are done, until the batch ends) instead of sharing the whole batch, so a
    row decoded after other rows of its batch (another adapter or prompt prefix, or one row at a time in
    deterministic mode) is charged its own decode only. A no-op outside a batch."""
    report = getattr(_batch, "rows_started", None)
    if report is not None:
        report(items)


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

    An item counts as waiting (`masgraph.workclock.Queued`: its caller's node clock stops) from `submit` until its
    batch starts, then as served in a batch of len(batch) rows until the batch ends; with `reports_starts=True`,
    as `run` reports with `rows_started` (waiting until its rows start, served with the rows reported with it).

    Example:
        >>> batcher = Batcher(lambda xs, stop: [x * 2 for x in xs], max_batch_size=8, wait_ms=3.0)
        >>> asyncio.run(batcher.submit([1, 2]))
        [2, 4]
    """

    def __init__(self, run: Callable[[list[In], threading.Event], list[Out]], max_batch_size: int = 32,
                 wait_ms: float = 3.0, error: Callable[[Exception], Exception] = lambda exc: exc,
                 thread_name: str = "masgraph-batch", reports_starts: bool = False):
        self.run, self.max_batch_size, self.wait_ms, self.error = run, max_batch_size, wait_ms, error
        self.reports_starts = reports_starts
        self._queue: list[tuple[In, asyncio.Future, Queued]] = []
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
        futures, waits = [], []
        for item in items:
            fut, wait = loop.create_future(), Queued()
            self._queue.append((item, fut, wait))
            futures.append(fut)
            waits.append(wait)
        assert self._wake is not None
        self._wake.set()
        try:
            return list(await asyncio.gather(*futures))
        finally:  # served, failed, or cancelled while queued: the queue is done with it
            for wait in waits:
                wait.done()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            await self._gather_more()
            batch, self._queue = self._queue[:self.max_batch_size], self._queue[self.max_batch_size:]
            if not self._queue:
                self._wake.clear()
            for _, f, w in batch:
                if f.cancelled():
                    w.done()
            batch = [(x, f, w) for x, f, w in batch if not f.cancelled()]
            if not batch:
                continue
            if not self.reports_starts:
                for _, _, w in batch:
                    w.serving(len(batch))
            futures, stop = [f for _, f, _ in batch], threading.Event()

            def gave_up(_: asyncio.Future, futures: list[asyncio.Future] = futures, stop: threading.Event = stop
                        ) -> None:
                if all(f.cancelled() for f in futures):  # nobody waits for the batch: end it at its next step
                    stop.set()

            for fut in futures:
                fut.add_done_callback(gave_up)
            items = [x for x, _, _ in batch]
            if self.reports_starts:
                running = self._executor.submit(self._run_reporting, items, stop, self._reporter(batch))
            else:
                running = self._executor.submit(self.run, items, stop)
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
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(self.error(exc))
                continue
            for (_, fut, _), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)

    def _run_reporting(self, items: list[In], stop: threading.Event, report: Callable[[list[Any]], None]
                       ) -> list[Out]:
        _batch.rows_started = report
        try:
            return self.run(items, stop)
        finally:
            _batch.rows_started = None

    def _reporter(self, batch: list[tuple[In, asyncio.Future, Queued]]) -> Callable[[list[Any]], None]:
        """`rows_started` for a batch: from the batch thread, (on the loop) the items reported before wait again and
        the items named are served together; `submit`'s finally ends them all when the batch does."""
        loop = asyncio.get_running_loop()
        waits: dict[int, list[Queued]] = {}
        for x, _, w in batch:
            waits.setdefault(id(x), []).append(w)
        serving: list[Queued] = []

        def started(items: list[Any]) -> None:
            for w in serving:
                w.waiting()
            serving[:] = [w for x in items for w in waits.get(id(x), ())]
            for w in serving:
                w.serving(len(serving))

        def report(items: list[Any]) -> None:
            loop.call_soon_threadsafe(started, list(items))
        return report

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
        for _, fut, wait in queued:
            fut.cancel()
            wait.done()
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
