"""Runs a command and takes its whole process group down when the process that started it dies, however it dies.

masgraph starts its vLLM server through this script with a pipe on stdin and keeps the pipe's write end. When
masgraph ends in any way (SIGKILL included, which no atexit hook sees), the kernel closes that end; this script then
reads EOF and sends SIGTERM to its process group (the server and every process it started: engine core, workers),
and SIGKILL to the command after a grace period. Whenever the command ends (so stopped, or crashed on its own), what
it left in the group gets SIGTERM, then SIGKILL after the grace period: no stuck engine core outlives it.
PR_SET_PDEATHSIG would fire when the starting *thread* ends, and a backend may be built on a worker thread, so a
pipe it is. Standard library only: it runs under the vLLM venv's python.

    python reaper.py GRACE_S -- COMMAND [ARG ...]     (start it as the leader of a new session)

The exit status is the command's (killed by a signal: this script dies of the same signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def main(argv: list[str]) -> int:
    grace_s, sep, command = float(argv[0]), argv[1], argv[2:]
    if sep != "--" or not command:
        print("usage: reaper.py GRACE_S -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    # the group's SIGTERM (from a stop, or from reap below) is for the command; this script waits for it to end.
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the command after exec.
    signal.signal(signal.SIGTERM, lambda *_: None)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def reap() -> None:
        while os.read(0, 4096):  # b"" at EOF: the starter has ended or let go (the raw fd: a daemon thread
            pass  # blocked in the buffered sys.stdin would abort the interpreter's shutdown)
        os.killpg(os.getpgrp(), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.poll() is None:
            child.kill()

    threading.Thread(target=reap, daemon=True).start()
    code = child.wait()
    clear_group(grace_s)
    if code < 0:  # pass the signal on, so the starter sees what killed the command
        if -code != signal.SIGKILL:  # SIGKILL has no handler to reset (and kills as it is)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def clear_group(grace_s: float) -> None:
    """SIGTERM whatever is left in this process group, then SIGKILL each member still there after `grace_s`
    (one by one: a SIGKILL to the group would end this script before it passes the exit status on)."""
    if not others():
        return
    os.killpg(os.getpgrp(), signal.SIGTERM)  # this script's handler ignores it
    deadline = time.monotonic() + grace_s
    while others() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in others():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def others() -> list[int]:
    """The live members of this process group other than this script (Linux /proc; elsewhere none are found)."""
    me, group, found = os.getpid(), os.getpgrp(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":  # a zombie is dead already, only not yet reaped
            found.append(int(entry))
    return found


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # no interpreter shutdown while the reaping thread waits on the pipe
