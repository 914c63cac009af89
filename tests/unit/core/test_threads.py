"""How torch's CPU threads wait and how many work (masgraph/threads.py): a short spin unless the user chose, and one
thread while other processes hold the cores; the deterministic mode keeps its count."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import pytest
import torch

from masgraph import threads
from masgraph.threads import AUTO, LoadGuard, configure_wait, threads_for


@pytest.mark.parametrize(("env", "chose", "spin"), [
    ({}, True, "30000"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, False, None),
    ({"GOMP_SPINCOUNT": "1000"}, False, "1000"),
    ({"OMP_NUM_THREADS": "1"}, False, None),
    ({AUTO: "auto", "GOMP_SPINCOUNT": "30000"}, True, "30000"),  # a child of a masgraph process
])
def test_masgraph_chooses_a_short_spin_unless_the_user_chose(env, chose, spin):
    got = dict(env)
    assert configure_wait(got) is chose
    assert got.get("GOMP_SPINCOUNT") == spin
    assert (got.get(AUTO) == "auto") is chose
    assert got.get("OMP_WAIT_POLICY") == env.get("OMP_WAIT_POLICY")


def test_threads_for_the_load():
    assert threads_for(0.0, 2, 2) == 2
    assert threads_for(0.4, 2, 2) == 2
    assert threads_for(1.9, 2, 2) == 1  # two busy loops
    assert threads_for(0.8, 8, 8) == 1
    assert threads_for(3.0, 1, 1) == 1


class Ticks:
    """A fake /proc reader: each call advances the machine by `busy` of 2 cores over 100 ticks, this process by
    `mine` of that."""

    def __init__(self):
        self.busy, self.mine, self.at = 0.0, 0.0, [0, 0, 0]

    def __call__(self):
        self.at = [self.at[0] + int(100 * self.busy), self.at[1] + 200, self.at[2] + int(100 * self.mine)]
        return tuple(self.at)


def _in_thread(fn):
    """Run `fn` in a fresh thread (torch's thread count is per thread; the test's own stays as it was)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        finally:
            torch.set_num_threads(full)  # the global default new threads start from, as before

    full = torch.get_num_threads()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


def test_the_guard_drops_to_one_thread_while_others_hold_the_cores_and_comes_back():
    ticks = Ticks()
    guard = LoadGuard(period_s=0.0, read=ticks, cores=2, full=2)

    def run():
        seen = []
        for busy, mine in [(0.3, 0.3), (2.0, 0.1), (2.0, 0.1), (1.0, 1.0), (0.2, 0.1)]:
            ticks.busy, ticks.mine = busy, mine
            seen.append((guard.apply(), torch.get_num_threads(), round(guard.others, 2)))
        return seen

    assert _in_thread(run) == [(2, 2, 0.0), (1, 1, 1.9), (1, 1, 1.9), (2, 2, 0.0), (2, 2, 0.1)]


def test_a_held_guard_and_full_threads_keep_the_full_count():
    ticks = Ticks()
    ticks.busy = 2.0
    guard = LoadGuard(period_s=0.0, read=ticks, cores=2, full=2)

    def run():
        seen = [guard.apply(), guard.apply(full=True)]
        guard.hold()
        seen.append(guard.apply())
        return seen

    assert _in_thread(run) == [1, 2, 2]


def test_full_threads_reaches_fit_threads(monkeypatch):
    ticks = Ticks()
    ticks.busy = 2.0
    monkeypatch.setattr(threads, "_guard", LoadGuard(period_s=0.0, read=ticks, cores=2, full=2))
    monkeypatch.setattr(threads, "_looked", True)

    def run():
        threads.fit_threads()
        seen = [torch.get_num_threads()]
        with threads.full_threads():
            threads.fit_threads()
            seen.append(torch.get_num_threads())
        threads.fit_threads()
        return seen + [torch.get_num_threads()]

    assert _in_thread(run) == [1, 2, 1]


@pytest.mark.skipif(threads.read_cpu_ticks() is None, reason="reads /proc (Linux)")
def test_the_guard_sees_other_processes_and_not_its_own_work():
    guard = LoadGuard(period_s=0.0)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.2)
        guard.measure()
        time.sleep(1.0)
        assert guard.measure() >= 0.9  # two spinning processes: about two cores, or all a busier machine has
    finally:
        for p in loops:
            p.kill()
            p.wait()


def _beside(guard: LoadGuard, work) -> int:  # noqa: ANN001
    """`guard.apply()`'s count on a fresh thread while another thread, which ran `work()` first, is still alive (a
    thread's id may be reused once it ends)."""
    ready, finish = threading.Event(), threading.Event()

    def other():
        work()
        ready.set()
        finish.wait(10)

    t = threading.Thread(target=other)
    t.start()
    ready.wait(10)
    try:
        return _in_thread(guard.apply)
    finally:
        finish.set()
        t.join()


def test_two_teams_of_this_process_share_the_count_and_an_update_counts_while_it_runs():
    assert threads_for(0.0, 2, 2, teams=2) == 1
    assert threads_for(0.0, 8, 8, teams=2) == 4
    guard = LoadGuard(period_s=0.0, read=Ticks(), cores=2, full=2)
    with contextlib.ExitStack() as stack:

        def update():  # fits its count once, then works for a long while (a logprob pass and its backward)
            stack.enter_context(guard.working())  # left when the test's stack closes, after the decode step
            guard.apply()

        assert _beside(guard, update) == 1  # a decode step beside the update
    guard._working.clear()  # the update left long ago
    assert _in_thread(guard.apply) == 2


def test_a_thread_done_with_its_phase_leaves_the_teams_at_once():
    """The rollouts' thread finishes its batch and the update starts on another thread: the update gets the full
    count from its first pass, not `WORKING_S` later (the decode thread's last fit would count it as working)."""
    decoded = LoadGuard(period_s=0.0, read=Ticks(), cores=2, full=2)
    assert _beside(decoded, decoded.apply) == 1  # within WORKING_S of its last fit the decode thread counts

    left = LoadGuard(period_s=0.0, read=Ticks(), cores=2, full=2)
    assert _beside(left, lambda: (left.apply(), left.leave())) == 2
