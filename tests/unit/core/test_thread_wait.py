"""`import masgraph` makes torch's OpenMP threads spin briefly before they sleep (GOMP_SPINCOUNT=30000, a tenth of
libgomp's default; masgraph/threads.py), so idle waits burn little CPU; a policy or spin count the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

OMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MASGRAPH_THREADS", "OMP_NUM_THREADS")
# CPU seconds of a process that runs 50 short parallel reductions with pauses between: threads that spin after each
# one burn CPU while the main thread sleeps; threads that sleep at once burn almost none
SPIN = """
import time{first}
import torch
torch.set_num_threads(2)
x = torch.ones(2_000_000)
c0 = time.process_time()
for _ in range(50):
    x.sum()
    time.sleep(0.005)
print(time.process_time() - c0)
"""


def _python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in OMP}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize(("env", "wait"), [({}, "None 30000"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),
                                           ({"GOMP_SPINCOUNT": "1000"}, "None 1000")])
def test_import_sets_a_short_spin_unless_the_user_chose_how_threads_wait(env, wait):
    got = _python("import os, masgraph; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))",
                  **env)
    assert got == wait


@pytest.mark.slow
def test_torch_threads_in_a_masgraph_process_spin_far_less_than_libgomps_default_while_waiting():
    # two of each, the least our waits cost and the most spinning did: a busy machine preempts a spinning thread
    # (less CPU to spin) and bills our process for its own work at bad moments; beside a fresh-clone make test and
    # two busy loops: 0.13 s (spin 30000) vs 0.41-0.65 s (libgomp's 300000; passive: 0.05), so the bound is a half
    spinning = max(float(_python(SPIN.format(first=""), GOMP_SPINCOUNT="300000")) for _ in range(2))  # libgomp's
    ours = min(float(_python(SPIN.format(first="\nimport masgraph"))) for _ in range(2))
    assert ours < spinning / 2, (ours, spinning)
