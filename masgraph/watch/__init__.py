"""`masgraph watch`: the Textual TUI over a run directory (app.py), what it reads (index.py), what it draws
(render.py). Textual is imported only when a watcher starts."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from masgraph.errors import MasgraphError


def require_terminal() -> None:
    """The TUI needs an interactive terminal on stdin and stdout; a clear error otherwise (a pipe, a CI job)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise MasgraphError("masgraph watch needs an interactive terminal (stdin and stdout are not both a TTY). "
                            "Over SSH use `ssh -t`; in scripts read the run directory's events.jsonl, episodes.jsonl "
                            "and metrics.jsonl instead")


def watch(run_dir: str | Path, poll_s: float = 0.25) -> int:
    """Open the TUI on a run directory until the user quits (a wrong path, or a run file that is not a regular
    file, is reported before the terminal check). A run file that becomes unreadable while watching is raised
    here once the terminal is restored (the CLI's error line); a crash of the app exits non-zero."""
    from masgraph.watch.app import WatchApp
    from masgraph.watch.index import RunIndex

    index = RunIndex(run_dir)
    require_terminal()
    app = WatchApp(run_dir, poll_s, index=index)
    app.run()
    if app.error is not None:
        raise app.error
    return app.return_code or 0


def watch_while(run_dir: Path, main: Callable[[], Coroutine[Any, Any, None]], poll_s: float = 0.25) -> int:
    """Run `main()` on its own event loop in a worker thread while the TUI watches `run_dir` in this one
    (`masgraph run|train --watch`). Quitting the TUI leaves the run going: this then waits for it, and Ctrl-C
    cancels it (exit 130). An exception of the run is raised here once the TUI has closed."""
    require_terminal()
    run_dir.mkdir(parents=True, exist_ok=True)
    job = _Background(main)
    job.thread.start()
    while not job.done.wait(0.05) and not _started(run_dir):  # the run writes its first files
        pass
    if _started(run_dir):
        _watch_beside(run_dir, poll_s)
    if not job.done.is_set():
        print(f"the watcher closed; the run goes on in {run_dir} (Ctrl-C stops it, `masgraph watch {run_dir}` "
              "watches it again)", file=sys.stderr)
    try:
        while not job.done.wait(0.2):
            pass
    except KeyboardInterrupt:
        job.cancel()
        job.done.wait()
        return 130
    if job.error is not None:
        raise job.error
    return 130 if job.cancelled else 0


def _watch_beside(run_dir: Path, poll_s: float) -> None:
    """The TUI over a run this process is writing; if it cannot read the run, or crashes, that is said on stderr
    and the run goes on (its own exit code stands)."""
    from masgraph.watch.app import WatchApp

    try:
        app = WatchApp(run_dir, poll_s)
    except MasgraphError as exc:
        print(f"error: the watcher cannot read the run: {exc}", file=sys.stderr)
        return
    app.run()
    if app.error is not None:
        print(f"error: the watcher stopped: {app.error}", file=sys.stderr)
    elif app.return_code:
        print(f"error: the watcher crashed (exit code {app.return_code})", file=sys.stderr)


def _started(run_dir: Path) -> bool:
    from masgraph.rundir.layout import is_run_dir

    return is_run_dir(run_dir)


class _Background:
    """A coroutine run to completion on a new event loop in a daemon thread, cancellable from another thread."""

    def __init__(self, main: Callable[[], Coroutine[Any, Any, None]]):
        self.main = main
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cancelled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self.thread = threading.Thread(target=self._run, name="masgraph-run", daemon=True)

    def _run(self) -> None:
        async def go() -> None:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            await self.main()

        try:
            asyncio.run(go())
        except asyncio.CancelledError:
            self.cancelled = True
        except BaseException as exc:  # handed to the main thread, which reports it as the CLI does
            self.error = exc
        finally:
            self.done.set()

    def cancel(self) -> None:
        if self._loop is not None and self._task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
