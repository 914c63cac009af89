"""`import masgraph` makes torch's OpenMP threads sleep when they wait (OMP_WAIT_POLICY=PASSIVE), so a busy machine
does not collapse decoding; a policy or spin count the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

OMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
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


@pytest.mark.parametrize(("env", "policy"), [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                             ({"GOMP_SPINCOUNT": "1000"}, None)])
def test_import_sets_a_passive_wait_policy_unless_the_user_chose_one(env, policy):
    got = _python("import os, masgraph; print(os.environ.get('OMP_WAIT_POLICY'))", **env)
    assert got == str(policy)


@pytest.mark.slow
def test_torch_threads_in_a_masgraph_process_do_not_spin_while_waiting():
    # two of each, the least our waits cost and the most spinning did: a busy machine preempts a spinning thread
    # (less CPU to spin) and bills our process for its own work at bad moments; quiet: ~0.012 s vs ~0.45 s, at load
    # (a fresh-clone make test beside two busy loops): 0.079 vs 0.33 once, so the bound is a factor of 3
    spinning = max(float(_python(SPIN.format(first=""), GOMP_SPINCOUNT="300000")) for _ in range(2))  # libgomp's
    ours = min(float(_python(SPIN.format(first="\nimport masgraph"))) for _ in range(2))
    assert ours < spinning / 3, (ours, spinning)
