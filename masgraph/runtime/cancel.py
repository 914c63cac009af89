"""Ctrl-C and SIGTERM during synchronous work (a training update): asyncio delivers a task's cancellation at its
next `await`, and an update has none for minutes, so long loops ask here between their forward passes, whether
they run on the event loop's thread or in a worker thread (`in_thread`: an update overlapping rollouts)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["in_thread", "raise_if_cancelled"]

T = TypeVar("T")
_STOP: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("masgraph_stop", default=None)
"""The stop flag of the `in_thread` call this thread runs, if any."""


def raise_if_cancelled() -> None:
    """Raise `CancelledError` when the running task has been asked to stop (`task.cancel()`, as the Ctrl-C and
    SIGTERM handlers of `masgraph.cli.interrupt` do from the main thread while this work runs), or, in a worker
    thread of `in_thread`, when the task awaiting it was; anywhere else (a plain call), nothing."""
    stop = _STOP.get()
    if stop is not None:
        if stop.is_set():
            raise asyncio.CancelledError
        return
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop in this thread
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread, so the event loop goes on (rollouts decode meanwhile). A cancellation of
    the awaiting task asks `fn` to stop at its next `raise_if_cancelled` and waits for it to return: the work never
    outlives its caller, and nothing it holds is used by two threads at once."""
    stop = threading.Event()

    def call() -> T:
        _STOP.set(stop)  # in the copied context of this call only
        return fn(*args)

    ctx = contextvars.copy_context()
    future = asyncio.get_running_loop().run_in_executor(None, ctx.run, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait([future])  # a second Ctrl-C stops this wait (not the thread)
        raise
