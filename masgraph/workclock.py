"""Work clocks: a node's and an episode's time limits measure their own work, not the time they wait for a turn.

The problem (issue 30, finding 3). Node (`timeout_s`, 120 s) and episode (`episode_timeout_s`) limits were
wall-clock, and a node's LLM call spends much of its wall time not being worked on: in the hf backend's batcher
queue (one worker thread runs one batch at a time, so a call that arrives while a batch runs waits for it), and
inside a batch, where its row is one of up to `max_batch_size` decoded together. Both grow with `--concurrency`
and with other work on the machine, and say nothing about the node: on a busy machine calls that take 2-6 s quiet
took 39-105 s and whole episodes timed out, so the limit turned load into failures that read like broken nodes.

What a user means by a node limit: "this node is stuck or runs away; give up on it" -- an agent that loops, a
tool that hangs, a call that never comes back. The limit should grow with what the node does, not with how many
episodes share the machine with it. So, per piece of a step:

- the agent's own code and its tool calls: the node's work, counted in full.
- a call waiting in a masgraph queue (the hf batcher's queue until its batch starts; the vllm backend's
  one-at-a-time gate in deterministic mode): not counted. The node is not running, cannot make the wait
  shorter, and the wait is unbounded by anything the node does. Recorded as `queue_s`.
- a call computed in a batch of n rows: counted as 1/n of the batch's time, the call's share. On a CPU a batch
  of 16 takes several times longer than a batch of 1 (it does 16 rows of work), and on the hf backend a batch's
  adapter/prompt groups decode one after another; charging the whole batch to every row would bill each node for
  the other episodes' rows, i.e. again for the concurrency. The share is what the machine spent on this call, so
  a node's work no longer depends on how many calls happened to be batched with it. (A backend that reports when
  each row starts, `Batcher(reports_starts=True)` with `hf_batcher.rows_started`, is charged per row group:
  waiting until the row's group starts, its group's share while it decodes.)
- a busier machine makes work itself slower, and that is counted (a wall-clock limit on work cannot tell load
  from a slow node), which is why the defaults leave room (120 s for a step whose calls take seconds).

Token budgets are not added: `max_tokens` already bounds every call's generation; a time limit is what catches
what tokens do not (hangs).

What each limit measures, precisely (`work_s` on a step and a trace is what it counted):

- a node's `timeout_s`, per attempt: its wall time with work accruing at a rate set by its LLM calls -- 0 while
  one waits in a queue, 1/n while one is computed in a batch of n, 1 otherwise (several calls at once: the
  lowest rate).
- `episode_timeout_s`: the episode's wall time with work accruing at the highest rate of the node steps it is
  running (1 between steps): in a fan-out, a branch waiting in the queue while another computes is still the
  episode working.
- the backstop: each limit also has a wall-clock ceiling, `ceiling(limit)` = `CEILING_FACTOR` (10) x the limit
  and at least `MIN_CEILING_S` (600 s), that counts all time. It catches a backend that never serves a queued
  call (a batch thread that hangs, so the queue never moves), and a batch that never finishes (which, shared by n
  rows, spends a node's budget n times slower).

Mechanics: a `WorkClock` owns an `asyncio.Timeout` and reschedules it whenever its rate changes. The scheduler
puts the current call's `CallWait` in the `WAITER` context variable; a queue marks each item with `Queued()`
(which reads it) and tells it `serving(rows)`, `waiting()` and `done()`.
"""

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
