"""Rollouts on Ray workers: AgentFlow episodes/s in process (no Ray: the peer) vs 1 and 2 Ray rollout workers,
same items and concurrency, one run each. Each worker holds its own model and gets cores / workers torch threads.
On a 2-core machine two workers share the same two cores the in-process run uses alone: the ratio shows what Ray
costs here, not what it gains on more machines. Worker start-up (Ray + model load) is timed apart.

    .venv/bin/python benchmarks/ray_scaling.py [--n 48] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.runtime.engine import BackendOptions
from masgraph.runtime.ray_engine import RayConfig, RayEngine
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]


def timed(runner_for, n: int, concurrency: int) -> dict[str, float]:
    task = get_task("basic_arithmetic")
    with tempfile.TemporaryDirectory() as runs:
        warm = runner_for(RunConfig(n=4, concurrency=concurrency, runs_dir=runs, seed=99))
        asyncio.run(warm.run_task(task, store=False))
        runner = runner_for(RunConfig(n=n, concurrency=concurrency, runs_dir=runs))
        t0 = time.perf_counter()
        result = asyncio.run(runner.run_task(task, store=False))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "episodes_per_s": len(result.traces) / wall,
            "tokens_per_s": sum(t.completion_tokens for t in result.traces) / wall,
            "accuracy": result.summary["accuracy"]}


def main() -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    path = str(ROOT / "graphs/agentflow.yaml")
    graph = compile_spec(load_spec(path), path)
    engine = Runner(graph).engine
    rows = {"in process": timed(lambda c, e=engine: Runner(graph, c, engine=e), args.n, args.concurrency)}
    asyncio.run(engine.aclose())
    del engine
    starts = {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        engine = RayEngine(graph, RayConfig(workers=workers), BackendOptions())
        starts[workers] = time.perf_counter() - t0
        rows[f"ray {workers} worker{'s' if workers > 1 else ''}"] = timed(
            lambda c, e=engine: Runner(graph, c, engine=e), args.n, args.concurrency)
        asyncio.run(engine.aclose())
    print(f"AgentFlow on basic_arithmetic: {args.n} episodes, concurrency {args.concurrency}, {os.cpu_count()} "
          f"cores; Ray start-up (first includes ray.init) {starts[1]:.1f} s / {starts[2]:.1f} s, not in the times")
    base = rows["in process"]["episodes_per_s"]
    for name, r in rows.items():
        ratio = r["episodes_per_s"] / base
        print(f"  {name:14s} {r['wall_s']:6.1f} s  {r['episodes_per_s']:.2f} episodes/s ({ratio:.2f}x in process)  "
              f"{r['tokens_per_s']:.0f} tok/s  accuracy {r['accuracy']:.3f}")
    two, one = rows["ray 2 workers"]["episodes_per_s"], rows["ray 1 worker"]["episodes_per_s"]
    print(f"  ray 2 / 1 workers: {two / one:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
