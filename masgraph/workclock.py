"""Work clocks: a node's and an episode's time limits measure their own work, not the time they wait for a turn.

A limit means "this node is stuck or runs away": it should grow with what the node does, not with how many
episodes share the machine. So a call waiting in a masgraph queue (the hf batcher's, the vLLM backend's
deterministic gate) counts nothing (recorded as `queue_s`); a call computed in a batch of n rows counts 1/n of the
batch's time (per row group when the batcher reports starts); the agent's own code and tools count in full; a
busier machine making work slower still counts. `max_tokens` already bounds generation, so no token budget.

- a node's `timeout_s`, per attempt: wall time with work accruing at the rate its calls set (0 queued, 1/n in a
  batch of n, else 1; several calls at once: the lowest rate).
- `episode_timeout_s`: wall time at the highest rate of its running steps (1 between steps).
- the backstop: each limit also has a wall-clock ceiling (`CEILING_FACTOR` x the limit, at least `MIN_CEILING_S`)
  that catches a queue that never moves and a batch that never finishes.

Mechanics: a `WorkClock` owns an `asyncio.Timeout` and reschedules it whenever its rate changes. The scheduler
puts the current call's `CallWait` in the `WAITER` context variable; a queue marks each item with `Queued()`
(which reads it) and tells it `serving(rows)`, `waiting()` and `done()"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

CEILING_FACTOR = 10.0
"""The wall-clock ceiling of a limit is this many times the limit ..."""
MIN_CEILING_S = 600.0
"""... and at least this long."""


def ceiling(limit_s: float) -> float:
    """The wall-clock backstop of a work limit of `limit_s` seconds."""
    return max(CEILING_FACTOR * limit_s, MIN_CEILING_S)


class Waiter(Protocol):
    """Told how a call of its caller is being served, by the queue that holds it."""

    def rate(self, rate: float | None) -> None:
        """0: the call waits (queued, or its rows done while the rest of its batch decodes); 1/n: it is being
        computed in a batch of n rows; None: the queue is done with it (served, cancelled or closed)."""


WAITER: ContextVar[Waiter | None] = ContextVar("masgraph_waiter", default=None)
"""Who is charged for a call made in this context (the scheduler sets it per LLM call)."""


class Queued:
    """One item a queue holds for the current context's `WAITER`: made when the item enters the queue (waiting);
    `serving(rows)` when it is computed in a batch of that many rows, `waiting()` when it waits again, `done()`
    when the queue is done with it (idempotent; later calls do nothing)."""

    __slots__ = ("waiter",)

    def __init__(self) -> None:
        self.waiter = WAITER.get()
        if self.waiter is not None:
            self.waiter.rate(0.0)

    def serving(self, rows: int) -> None:
        if self.waiter is not None:
            self.waiter.rate(1.0 / max(rows, 1))

    def waiting(self) -> None:
        if self.waiter is not None:
            self.waiter.rate(0.0)

    def done(self) -> None:
        if self.waiter is not None:
            waiter, self.waiter = self.waiter, None
            waiter.rate(None)


class WorkClock:
    """The time limit of a node attempt or an episode: `limit_s` of work, `ceiling(limit_s)` of wall time.

    Work accrues at a rate between 0 and 1 set by the clock's members: a node's members are its LLM calls in a
    queue (0 while waiting, 1/n while computed in a batch of n rows) and the node takes the lowest of their rates
    (1 with none); an episode's members are its node steps in flight and it takes the highest (1 with none: the
    episode's own routing). Arm it with `async with asyncio.timeout_at(clock.deadline()) as t: clock.timer = t`
    (and `clock.timer = None` on leaving); it reschedules the timer whenever its rate changes. Runs on the event
    loop's thread."""

    __slots__ = ("limit_s", "ceiling_s", "now", "start", "mark", "rate", "worked_s", "stopped_s", "members",
                 "highest", "timer", "parent", "at_ceiling", "closed")

    def __init__(self, limit_s: float, parent: WorkClock | None = None, highest: bool = False):
        self.now = asyncio.get_running_loop().time if parent is None else parent.now  # the timer's clock
        self.start = self.mark = self.now()
        self.limit_s, self.ceiling_s = limit_s, ceiling(limit_s)
        self.rate = 1.0
        self.worked_s = 0.0
        """Work up to `mark` (the last change of rate)."""
        self.stopped_s = 0.0
        """Seconds at rate 0 (waiting) up to `mark`."""
        self.members: dict[object, float] = {}
        self.highest = highest
        self.timer: asyncio.Timeout | None = None
        self.parent = parent
        self.at_ceiling = False
        """Whether the current deadline is the wall-clock ceiling (not the work budget)."""
        self.closed = False
        if parent is not None:
            if parent.highest and parent.rate == 1.0:  # (the hot path: one more working member changes nothing)
                parent.members[self] = 1.0
            else:
                parent.set(self, 1.0)

    def set(self, member: object, rate: float | None) -> None:
        """A member's rate (None: it is gone); the clock's own rate follows, and its parent's and timer."""
        if self.closed:
            return
        if rate is None:
            self.members.pop(member, None)
        else:
            self.members[member] = rate
        new = (max if self.highest else min)(self.members.values()) if self.members else 1.0
        if new == self.rate:
            return
        self._advance()
        self.rate = new
        if self.parent is not None:
            self.parent.set(self, new)
        if self.timer is not None:
            try:
                self.timer.reschedule(self.deadline())
            except RuntimeError:  # it has fired already, or been left
                pass

    def _advance(self) -> None:
        now = self.now()
        dt = now - self.mark
        self.worked_s += dt * self.rate
        if self.rate == 0.0:
            self.stopped_s += dt
        self.mark = now

    def close(self) -> None:
        """The attempt ended: it leaves its parent, and nothing more changes this clock."""
        if self.closed:
            return
        self._advance()
        if self.parent is not None:
            self.parent.set(self, None)
        self.closed, self.parent, self.timer = True, None, None

    # ---- readings ---------------------------------------------------------------------------------
    def deadline(self) -> float:
        """When the timer fires (loop time): when the work budget is spent at the current rate, or at the
        wall-clock ceiling."""
        wall = self.start + self.ceiling_s
        work = wall if self.rate <= 0.0 else self.mark + (self.limit_s - self.worked_s) / self.rate
        self.at_ceiling = work >= wall
        return min(work, wall)

    def waited_s(self) -> float:
        """Seconds at rate 0 so far (waiting in a queue)."""
        live = 0.0 if self.closed or self.rate != 0.0 else self.now() - self.mark
        return self.stopped_s + live

    def work_s(self) -> float:
        """Work so far: what the limit counts."""
        live = 0.0 if self.closed else (self.now() - self.mark) * self.rate
        return self.worked_s + live

    def describe(self, what: str) -> str:
        """Why `what` (a "node", an "episode") timed out, for the step's or trace's error."""
        waited, elapsed = self.waited_s(), (self.mark if self.closed else self.now()) - self.start
        if self.at_ceiling:
            return (f"{what} timed out at its wall-clock ceiling of {self.ceiling_s}s ({waited:.1f}s of it waiting in "
                    f"the backend's queue, {self.work_s():.1f}s of work): does the backend still serve queued calls? "
                    f"(its {self.limit_s}s limit counts work only; the ceiling, {CEILING_FACTOR:g}x the limit and at "
                    f"least {MIN_CEILING_S:g}s, counts waiting too)")
        said = f"node timed out after {self.limit_s}s" if what == "node" else f"{what} exceeded {self.limit_s}s"
        if elapsed - self.work_s() < 0.05:  # all of it was work: the message of a node that never queued
            return said
        return (f"{said} of work ({elapsed:.1f}s wall: {waited:.1f}s of it waiting in the backend's queue, and time "
                "in batches counted as a share of the batch; see `work_s`)")


class CallWait:
    """The `Waiter` of one LLM call: sets its node's clock's rate as the call waits and is served, and adds up the
    seconds it waited (`queue_s`)."""

    __slots__ = ("clock", "queue_s", "r", "t")

    def __init__(self, clock: WorkClock | None):
        self.clock, self.queue_s = clock, 0.0
        self.r: float | None = None
        self.t = 0.0

    def rate(self, rate: float | None) -> None:
        now = time.perf_counter()
        if self.r == 0.0:
            self.queue_s += now - self.t
        self.r, self.t = rate, now
        if self.clock is not None:
            self.clock.set(self, rate)


@contextmanager
def not_working(clock: WorkClock | None) -> Iterator[None]:
    """Time inside does not count as work on `clock` (a node waiting for its turn at something shared, as a call
    waits in a queue); it still counts towards the clock's wall-clock ceiling."""
    wait = CallWait(clock)
    wait.rate(0.0)
    try:
        yield
    finally:
        wait.rate(None)
