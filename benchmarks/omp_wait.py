"""How torch's CPU threads wait, on a quiet and on a busy machine: passive (masgraph's default) vs libgomp's own.

torch's CPU kernels run on OpenMP threads. libgomp's default makes a thread that reaches a barrier spin for
300,000 iterations before it sleeps; when every core is taken by other work, the spinning threads hold the cores
the thread they wait for needs, and each barrier costs a scheduler time slice. `OMP_WAIT_POLICY=PASSIVE` (set by
`import masgraph` unless the user set a policy or GOMP_SPINCOUNT) makes waiting threads sleep at once.

Each arm decodes the same requests on the embedded model in a fresh process (the policy is read once, when
libgomp loads): one batch of 8 rows (the batched path) and the same 8 rows one at a time (deterministic mode's
path), `--tokens` new tokens each; the load is `--busy` spinning processes beside it. Arms alternate; every
repeat is printed; the ratio is default / passive wall time (> 1: passive is faster).

    .venv/bin/python benchmarks/omp_wait.py [--busy 0 2 6] [--repeats 3] [--tokens 16] [--spin 1000 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ARMS = {"masgraph default": {},  # what `import masgraph` chooses (masgraph/threads.py)
        "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
        "libgomp default": {"GOMP_SPINCOUNT": "300000"}}  # libgomp's default spin; masgraph leaves it alone
"""The arms every run has; `--spin N ...` adds an arm per spin count (`GOMP_SPINCOUNT=N`), `--arm` any other."""
THREAD_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MASGRAPH_THREADS")
"""Removed from this process's environment in every arm (each arm sets its own)."""
CHILD = r"""
import json, sys, time
from masgraph.backends.base import Request
from masgraph.backends.hf import HFBackend
from masgraph.spec import SamplingSpec
tokens = int(sys.argv[1])
out = {}
for deterministic in (False, True):
    b = HFBackend(deterministic=deterministic)
    reqs = [Request([{"role": "user", "content": f"What is {i} + {3 * i}? Explain."}], "p", None,
                    SamplingSpec(max_tokens=tokens, temperature=1.0), seed=i, key=(i,)) for i in range(8)]
    b.generate(reqs[:1])  # warm
    t = time.perf_counter()
    b.generate(reqs)
    out["one at a time" if deterministic else "batch of 8"] = time.perf_counter() - t
print(json.dumps(out))
"""


def child(env: dict[str, str], tokens: int, timeout: float) -> dict[str, float] | None:
    base = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tokens)], env={**base, **env}, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        raise SystemExit(f"error: the decode child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2, 6], help="spinning processes beside each arm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600, help="seconds before an arm counts as did-not-finish")
    ap.add_argument("--spin", type=int, nargs="*", default=[], metavar="N",
                    help="also spin N iterations before sleeping (GOMP_SPINCOUNT=N), one arm per N")
    ap.add_argument("--arm", nargs="*", default=[], metavar="NAME:VAR=VALUE,...",
                    help="another arm with these environment variables, e.g. '1 thread:OMP_NUM_THREADS=1'")
    args = ap.parse_args()
    arms = {**ARMS, **{f"spin {n}": {"GOMP_SPINCOUNT": str(n)} for n in args.spin}}
    for arm in args.arm:
        name, _, pairs = arm.partition(":")
        arms[name] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    print(f"cores {os.cpu_count()}, {args.tokens} new tokens x 8 rows, embedded model, {args.repeats} repeats")
    for busy in args.busy:
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1 if busy else 0)
            walls: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
            for r in range(args.repeats):
                for arm, env in (arms.items() if r % 2 == 0 else reversed(arms.items())):
                    got = child(env, args.tokens, args.timeout)
                    shown = ({k: round(v, 2) for k, v in got.items()} if got
                             else f"did not finish in {args.timeout:g} s")
                    print(f"  busy {busy}, repeat {r + 1}, {arm}: {shown}", flush=True)
                    for k, v in (got or {"batch of 8": args.timeout, "one at a time": args.timeout}).items():
                        walls[arm].setdefault(k, []).append(v)
            for path in ("batch of 8", "one at a time"):
                d = statistics.median(walls["libgomp default"][path])
                shown = ", ".join(f"{arm} {statistics.median(walls[arm][path]):.2f} s "
                                  f"({d / statistics.median(walls[arm][path]):.2f}x)" for arm in arms)
                print(f"busy {busy}: {path} (median; in brackets libgomp default / arm, > 1: the arm is faster): "
                      f"{shown}")
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()


if __name__ == "__main__":
    main()
