"""How a run or a training run stops on Ctrl-C or SIGTERM: cancelled cleanly, then the process exits at once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

CLOSE_GRACE_S = 2.0
"""After Ctrl-C or SIGTERM: how long a run waits for its backends to close (a model batch computing on its thread
stops at its next decode step, but a long prefill on a busy machine took 12-36 s) before it exits without them."""

NOT_CLOSED = (f"note: not waiting for the backends to close (still busy after {CLOSE_GRACE_S:g} s: a model batch "
              "computing on its thread)")

interrupted = False
"""Set when `run_cancellable`'s run was stopped by Ctrl-C or SIGTERM: `main` then exits at once (`exit_now`)."""


async def closed_within(close: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Awaits `close` for up to `seconds`: whether it finished (if not, it is left, and cancelled with the event
    loop's other tasks)."""
    task = asyncio.ensure_future(close)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if task in done:
        task.result()
    return task in done


class _Executor(ThreadPoolExecutor):
    """The event loop's default executor (asyncio.to_thread: tool calls, plain-def agents): once the run is
    interrupted, the loop's shutdown no longer waits for its threads (a sandboxed tool may run to its time limit)."""

    abandon = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=wait and not self.abandon, cancel_futures=cancel_futures or self.abandon)


def drive_then_close(work: Callable[[], Awaitable[None]], aclose: Callable[[], Coroutine[Any, Any, None]],
                     run_dir: Path, watch: bool, display: Any) -> int:
    """`work()` then `aclose()` under `drive`; on Ctrl-C or SIGTERM the close gets CLOSE_GRACE_S (a model batch may
    still be computing), and a note says when it did not finish in time. Returns 0, 130 or 143."""
    closed = True

    async def main() -> None:
        nonlocal closed
        try:
            await work()
        except asyncio.CancelledError:  # Ctrl-C or SIGTERM: what finished is saved by now; do not wait long
            closed = await closed_within(aclose(), CLOSE_GRACE_S)
            raise
        except BaseException:
            try:
                await aclose()
            except asyncio.CancelledError:
                # a stop asked for while this error was on its way out (torchrun stopping the learner ranks because
                # one died, as this rank saw the same loss): the error is what happened, and it names the checkpoint
                pass
            raise  # the error, as raised (its cause kept)
        await aclose()

    code = drive(main, run_dir, watch, display)
    if not closed:
        print(NOT_CLOSED, file=sys.stderr)
    return code


def drive(main: Callable[[], Coroutine[Any, Any, None]], run_dir: Path, watch: bool, display: Any) -> int:
    """`main` under the TUI when watching, else with Ctrl-C / SIGTERM handled (`run_cancellable`); the progress
    display (None when watching) is closed afterwards."""
    try:
        if watch:
            from masgraph.watch import watch_while

            return watch_while(run_dir, main)
        return run_cancellable(main)
    finally:
        if display is not None:
            display.close()


def run_cancellable(main: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """asyncio.run(main()); Ctrl-C or SIGTERM cancels it (its `finally` blocks run). Returns 0, 130 or 143."""
    global interrupted
    terminated = False
    executor = _Executor(thread_name_prefix="masgraph-io")

    async def guarded() -> None:
        loop, this = asyncio.get_running_loop(), asyncio.current_task()
        loop.set_default_executor(executor)

        def on_sigterm(signum: int, frame: Any) -> None:
            nonlocal terminated
            terminated = executor.abandon = True
            this.cancel()
            loop.call_soon_threadsafe(lambda: None)  # wake the loop if it waits in select()

        # a Python-level handler, as asyncio.run's for Ctrl-C: it runs in the main thread at once, also while a
        # training update holds the loop (which then stops at its next pass: masgraph.runtime.cancel); the loop's
        # own add_signal_handler would run it only once the loop is back in select()
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            await main()
        except asyncio.CancelledError:
            executor.abandon = True  # Ctrl-C (asyncio.run cancels this task) or SIGTERM
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)

    try:
        asyncio.run(guarded())
    except KeyboardInterrupt:
        interrupted = True
        return 130
    except asyncio.CancelledError:
        if not terminated:
            raise
        interrupted = True
        return 143
    return 0


def exit_now(code: int) -> NoReturn:
    """Ends the process after an interrupted run or as a learner rank (masgraph/cli/main.py), its results saved by
    now: runs the atexit hooks (a vLLM server's stop, log flushing) and exits without joining worker threads still
    computing (a model batch, a tool call: Python's exit would wait for each) or the interpreter's teardown (seconds
    on a busy machine; where a learner rank's gloo group was freed and aborted)."""
    import atexit

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    atexit._run_exitfuncs()
    os._exit(code)
