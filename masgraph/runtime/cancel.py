"""Ctrl-C and SIGTERM during synchronous work on the event loop's thread (a training update): asyncio delivers a
task's cancellation at its next `await`, and an update has none for minutes, so long loops ask here between their
forward passes."""

from __future__ import annotations

import asyncio

__all__ = ["raise_if_cancelled"]


def raise_if_cancelled() -> None:
    """Raise `CancelledError` when the running task has been asked to stop (`task.cancel()`, as the Ctrl-C and
    SIGTERM handlers of `masgraph.cli.interrupt` do from the main thread while this work runs); outside a task
    (a plain call, another thread), nothing."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop in this thread
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
