"""How torch's CPU threads wait, and how many of them work: fast on a quiet machine, no collapse on a busy one.

torch's CPU kernels run on OpenMP teams. A thread that reaches a barrier either spins (libgomp's default: 300,000
iterations) or sleeps (`OMP_WAIT_POLICY=PASSIVE`). On a quiet machine a short spin is fastest (waking a sleeping
thread costs more than the wait); when other processes take the cores, a spinning thread holds the core the thread
it waits for needs, and every barrier costs a scheduler time slice (decoding 8 rows x 10 tokens: > 150 s at load 12
against 4.5 s passive). libgomp reads its policy once, when it loads, so the choice that serves both is:

- `configure_wait` (at `import masgraph`, before torch loads): a short spin (`GOMP_SPINCOUNT=30000`) unless the
  user chose a policy, a spin count or a thread count;
- `LoadGuard` (at each decode step and logprob pass): while other processes keep cores busy, torch works on one
  thread in the calling thread (a team of one has no barrier to wait at); on the full count again once they stop.
  Two threads of this process working at once (decode beside the update) share the count.
  Other processes' load is read from /proc/stat minus this process's own CPU time (Linux; elsewhere the guard
  does nothing). The deterministic mode holds the thread count (`hold`): on a CPU the count decides the order of
  parallel sums, so a changing count would make repeated runs differ.

libgomp keeps each thread's team of workers for its next parallel region, and counts the workers of every team. Once
two threads of this process have had teams of two (the decode thread, the thread that loaded the model or runs the
update), the workers outnumber the cores and libgomp cuts every wait to 100 spins whatever `GOMP_SPINCOUNT` says,
so each parallel region pays a sleep and a wake. `released_team` lets a thread's workers go when it is done with a
phase of kernels (a batch's decode, an update), and `release_team` the event loop's thread when it hands a batch to
the decode thread, so the thread that works next waits as configured.

Measured in `benchmarks/omp_wait.py` (docs/performance.md has the figures).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping

QUIET_SPIN = "30000"
"""Spin iterations before a waiting thread sleeps, when masgraph chooses: the fastest of 1,000-300,000 on a quiet
2-core machine (benchmarks/omp_wait.py)."""
AUTO = "MASGRAPH_THREADS"
"""Set to "auto" in the environment when masgraph chose the wait policy, so child processes (learner ranks, Ray
workers) know the spin count is masgraph's and guard their threads too."""
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
WORKING_S = 1.0
"""A thread that fitted its count this recently is still working (decode steps fit every ~0.1-0.5 s)."""


def configure_wait(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Choose how torch's threads wait (before torch is imported) unless the user did: returns whether masgraph
    chose, i.e. whether `LoadGuard` may change the thread count."""
    if environ.get(AUTO) == "auto":
        return True
    if any(k in environ for k in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = QUIET_SPIN
    environ[AUTO] = "auto"
    return True


def threads_for(others: float, cores: int, full: int, teams: int = 1) -> int:
    """Threads for one of this process's `teams` working at once when other processes use `others` cores of
    `cores`: one if more than half a core is taken (a team that cannot have its cores waits at every barrier), else
    an equal share of `full` (rollouts decoding while the update runs: two teams)."""
    return 1 if others > 0.5 and cores > 1 else max(1, full // max(1, teams))


def read_cpu_ticks() -> tuple[int, int, int] | None:
    """(busy ticks of the whole machine, ticks of all its CPUs, this process's CPU ticks), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    busy = total - fields[3] - (fields[4] if len(fields) > 4 else 0)
    return busy, total, int(mine[11]) + int(mine[12])  # utime + stime: fields 14 and 15 of /proc/PID/stat


class LoadGuard:
    """Sets torch's thread count in the calling thread to what the machine's load allows (`threads_for`), reading
    the load at most every `period_s` seconds. A count is per thread in torch (each OpenMP master thread has its
    own), so every thread that runs kernels calls `apply` itself."""

    def __init__(self, period_s: float = 0.5, read: Callable[[], tuple[int, int, int] | None] = read_cpu_ticks,
                 cores: int | None = None, full: int | None = None):
        self.period_s, self._read = period_s, read
        self.cores = cores or os.cpu_count() or 1
        self.full = full
        self.others = 0.0
        """Cores other processes used over the last reading."""
        self.held = False
        self._last = read()
        self._at = time.monotonic()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._working: dict[int, float] = {}
        """Thread id -> when it last fitted its count: the teams working at once."""

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Within: the calling thread counts as a working team throughout (an update whose passes fit their threads
        seconds apart), so a decode beside it takes its share."""
        me = threading.get_ident()
        with self._lock:
            self._working[me] = float("inf")
        try:
            yield
        finally:
            with self._lock:
                self._working[me] = time.monotonic()

    def leave(self) -> None:
        """The calling thread is done working for now: the teams working at once no longer count it (a thread that
        next works alone then gets the full count at once, not after `WORKING_S`)."""
        with self._lock:
            self._working.pop(threading.get_ident(), None)

    def hold(self) -> None:
        """Keep every thread at the full count from now on (the deterministic mode)."""
        self.held = True

    def measure(self) -> float:
        """Other processes' cores since the last reading (at most every `period_s`; the last value between)."""
        with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._at < self.period_s:
                return self.others
            got = self._read()
            if got is not None:
                busy, total, mine = (a - b for a, b in zip(got, self._last))
                if total > 0:
                    self.others = max(0.0, (busy - mine) * self.cores / total)
                self._last, self._at = got, now
            return self.others

    def apply(self, full: bool = False) -> int:
        """Set the calling thread's torch thread count for the current load (`full`: the full count whatever the
        load); returns it."""
        import torch

        if self.full is None:
            self.full = torch.get_num_threads()
        now, me = time.monotonic(), threading.get_ident()
        with self._lock:
            if self._working.get(me, 0.0) < now:  # a thread inside `working` stays working until it leaves
                self._working[me] = now
            self._working = {t: at for t, at in self._working.items() if now - at <= WORKING_S}
            teams = len(self._working)
        want = self.full if self.held or full else threads_for(self.measure(), self.cores, self.full, teams)
        if getattr(self._local, "threads", None) != want:
            torch.set_num_threads(want)
            self._local.threads = want
        return want


_guard: LoadGuard | None = None
_looked = False
_local = threading.local()


def guard() -> LoadGuard | None:
    """The process's guard when masgraph chose how threads wait (see `configure_wait`) on Linux, else None (decided
    at the first call)."""
    global _guard, _looked
    if not _looked:
        _looked = True
        if os.environ.get(AUTO) == "auto" and read_cpu_ticks() is not None:
            _guard = LoadGuard()
    return _guard


def fit_threads() -> None:
    """At each decode step and logprob pass: the calling thread's count for the machine's load (no-op when the user
    chose the threads or off Linux)."""
    g = guard()
    if g is not None:
        g.apply(full=getattr(_local, "full", False))


@contextlib.contextmanager
def working() -> Iterator[None]:
    """Within: the calling thread's kernels count as one team of this process for all of it (`LoadGuard.working`)."""
    g = guard()
    with g.working() if g is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def full_threads(on: bool = True) -> Iterator[None]:
    """Within (when `on`): the calling thread works on the full count whatever the load (a deterministic decode,
    whose sums must not change order with the machine's load)."""
    before = getattr(_local, "full", False)
    _local.full = on or before
    try:
        yield
    finally:
        _local.full = before


def hold_threads() -> None:
    """From now on, the full thread count everywhere (the deterministic mode; `HFModel(threads=N)`)."""
    g = guard()
    if g is not None:
        g.hold()


_pause: Callable[[int], int] | None = None
_pause_looked = False


def release_team() -> None:
    """Let the calling thread's OpenMP workers go (`omp_pause_resource_all`, soft pause, in the libgomp torch loaded);
    its next parallel region starts a new team. A no-op without libgomp (another OpenMP runtime, another OS) or inside
    a parallel region. The thread also stops counting as a working team (`LoadGuard.leave`)."""
    global _pause, _pause_looked
    if (g := guard()) is not None:
        g.leave()
    if not _pause_looked and "torch" in sys.modules:  # torch loads libgomp
        _pause_looked = True
        _pause = _find_pause()
    if _pause is not None:
        _pause(1)  # omp_pause_soft


def _find_pause() -> Callable[[int], int] | None:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and line.rstrip().endswith((".so", ".so.1"))}
        for path in sorted(paths):
            pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
            if pause is not None:
                pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
                return pause
    except OSError:  # no /proc (not Linux), a library that does not load
        pass
    return None


@contextlib.contextmanager
def released_team() -> Iterator[None]:
    """Within: a phase of the calling thread's kernels; on leaving, its OpenMP workers go (`release_team`), so the
    thread that works next (the update after the rollouts, the decode after the update) waits as configured."""
    try:
        yield
    finally:
        release_team()
