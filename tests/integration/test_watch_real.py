"""`masgraph run --watch` on the real model, in a real pseudo-terminal: the TUI comes up, shows the run live until it
ends, quits on `q`, and the run's summary and files are complete."""

from __future__ import annotations

import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parent.parent.parent
ANSI = re.compile(rb"\x1b\[[0-9;?<>=]*[a-zA-Z]|\x1b[()][A-Z0-9]|\x1b[=>]")


def drive(argv: list[str], until: bytes, limit_s: float, env: dict[str, str]) -> tuple[int, str, str]:
    """Run argv on a pty of 80x24; press `q` once the screen (ANSI stripped) shows `until`.
    Returns (exit code, what the screen showed before q, everything)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the pty
        os.chdir(ROOT)
        os.execve(argv[0], argv, env)
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    out, shown, t0, pressed = b"", "", time.monotonic(), False
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:  # the child closed the pty
                break
            if not data:
                break
            out += data
        if not pressed and until in ANSI.sub(b"", out):
            shown = ANSI.sub(b"", out).decode(errors="replace")
            time.sleep(0.5)
            os.write(fd, b"q")
            pressed = True
        if time.monotonic() - t0 > limit_s:
            os.kill(pid, 9)
            break
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), shown, ANSI.sub(b"", out).decode(errors="replace")


@pytest.mark.skipif(sys.platform != "linux", reason="pty")
def test_run_watch_shows_the_real_run_live_and_quits(tmp_path):
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="80", LINES="24")
    argv = [str(Path(sys.executable).parent / "masgraph"), "run", "graphs/agentflow.yaml", "--task",
            "basic_arithmetic", "--n", "4", "--concurrency", "4", "--runs-dir", str(tmp_path), "--watch"]
    # "ended" is drawn once summary.json exists, a poll after the last row ("4 done" can show while still live)
    code, shown, everything = drive(argv, b"ended", limit_s=600, env=env)
    assert shown, f"the TUI never showed the run ended; output:\n{everything[-2000:]}"
    assert "Episodes [2]" in shown and "4 done" in shown  # the app's tabs and the 4 episodes, drawn by the TUI
    assert code == 0, everything[-2000:]
    assert "episodes 4" in everything and "run dir" in everything  # the CLI's summary after the TUI closed
    [run_dir] = tmp_path.iterdir()
    assert (run_dir / "summary.json").exists()
    assert len((run_dir / "episodes.jsonl").read_text().splitlines()) == 4
