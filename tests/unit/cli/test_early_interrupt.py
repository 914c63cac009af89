"""Ctrl-C while `masgraph` starts (issue 58 #13): its imports and parser take a second or more on a busy machine
(torch among them), and a SIGINT then was a KeyboardInterrupt traceback and exit -2; now it is `interrupted` and
exit 130, as during a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMMAND = Path(sys.executable).parent / "masgraph"


def _importing_masgraph(pid: int) -> bool:
    """Whether the process runs masgraph's imports: pydantic's extension is mapped (masgraph.cli's first imports
    load it; Python's own start-up, `site` included, does not, and a SIGINT there is Python's, not masgraph's)."""
    try:
        return "pydantic_core" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not COMMAND.exists(), reason="the masgraph console script is not installed beside this python")
@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.0])
def test_ctrl_c_while_masgraph_starts_is_one_line_and_exit_130(root, tmp_path, delay_s):
    proc = subprocess.Popen(
        [str(COMMAND), "run", str(root / "graphs" / "single.yaml"), "--task", "basic_arithmetic", "--n", "1",
         "--runs-dir", str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job starts it ignored
    deadline = time.monotonic() + 30
    while not _importing_masgraph(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]  # HEAD: -2 and a traceback
    assert err.strip().splitlines()[-1] == "interrupted"
