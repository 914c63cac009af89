"""Serving throughput on the real embedded model: `masgraph serve` vs offline `masgraph run`, same graph, same items.

Arms (each runs the same `--n` held-out questions of `--task`; episodes/s = n / wall time of the batch):
- offline   the Runner (what `masgraph run` uses) in this process, `--concurrency C`
- served    a `masgraph serve GRAPH` process asked by C concurrent HTTP clients (httpx, keep-alive); per-request
            latency p50 / p99
- naive     the same server with `--max-concurrency 1`: one episode at a time, so no batching across requests
            (what a server that calls the model per request behind a lock does), at the highest C

Target (issue 11): served ≥ 0.8x offline at 16 clients. The offline arm and the server never run at the same time
(2 cores); each arm warms up on 2 questions first.

    .venv/bin/python benchmarks/serve_throughput.py [--graph graphs/agentflow.yaml] [--n 64] [--clients 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from results_file import results_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def offline(graph_path: str, task_name: str, questions: list, clients: list[int]) -> dict[int, float]:
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import get_task

    graph, task = compile_spec(load_spec(graph_path)), get_task(task_name)
    out = {}
    runner = None
    for c in clients:
        with tempfile.TemporaryDirectory() as runs:
            config = RunConfig(n=len(questions), concurrency=c, runs_dir=runs)
            runner = Runner(graph, config, engine=runner.engine if runner else None)
            asyncio.run(runner.run_items(task, questions[:2], store=False))  # warm-up
            t0 = time.perf_counter()
            asyncio.run(runner.run_items(task, questions, store=False))
            out[c] = len(questions) / (time.perf_counter() - t0)
            print(f"offline   C={c:<3} {out[c]:.2f} episodes/s", flush=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(graph_path: str, *extra: str, log: Path | None = None):
    """A `masgraph serve GRAPH *extra` process on a free port until the block ends (its output appended to `log`)."""
    port = _free_port()
    with open(log, "ab") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as out:
        proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", graph_path, "--port", str(port),
                                 "--no-store", "--log-level", "warning", *extra], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not start ({graph_path})"
                                 + (f"; its log: {log}" if log is not None else ""))
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


async def ask_all(url: str, model: str, questions: list[str], clients: int) -> tuple[float, list[float], int]:
    """(episodes/s, per-request latencies, errors) of asking every question with `clients` concurrent clients."""
    gate, latencies, errors = asyncio.Semaphore(clients), [], 0

    async def one(c: httpx.AsyncClient, q: str) -> None:
        nonlocal errors
        async with gate:
            t0 = time.perf_counter()
            r = await c.post(f"{url}/v1/chat/completions", json={"model": model, "messages": [
                {"role": "user", "content": q}]})
            latencies.append(time.perf_counter() - t0)
            errors += r.status_code != 200

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=900, limits=limits) as c:
        await asyncio.gather(*(one(c, q) for q in questions[:2]))  # warm-up
        latencies.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, q) for q in questions))
        return len(questions) / (time.perf_counter() - t0), latencies, errors


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile of `xs` (nearest rank); NaN for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", default="graphs/agentflow.yaml")
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    os.chdir(ROOT)
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.tasks import get_task

    model = compile_spec(load_spec(args.graph)).spec.name
    items = get_task(args.task).items("test", args.n, 0)
    questions = [it.question for it in items]
    off = offline(args.graph, args.task, items, args.clients)
    served: dict[int, tuple[float, list[float], int]] = {}
    with server(args.graph) as url:
        for c in args.clients:
            served[c] = asyncio.run(ask_all(url, model, questions, c))
            print(f"served    C={c:<3} {served[c][0]:.2f} episodes/s  p50 {statistics.median(served[c][1]):.1f}s  "
                  f"p99 {pct(served[c][1], 99):.1f}s  errors {served[c][2]}", flush=True)
    top = max(args.clients)
    with server(args.graph, "--max-concurrency", "1", "--max-queue", str(args.n + 8)) as url:
        naive = asyncio.run(ask_all(url, model, questions, top))
        print(f"naive     C={top:<3} {naive[0]:.2f} episodes/s  p50 {statistics.median(naive[1]):.1f}s  "
              f"p99 {pct(naive[1], 99):.1f}s  errors {naive[2]}", flush=True)
    rows = ["| clients | offline episodes/s | served episodes/s | served / offline | p50 latency | p99 latency | "
            "errors |", "|---|---|---|---|---|---|---|"]
    for c in args.clients:
        eps, lat, err = served[c]
        rows.append(f"| {c} | {off[c]:.2f} | {eps:.2f} | **{eps / off[c]:.2f}x** | {statistics.median(lat):.1f} s | "
                    f"{pct(lat, 99):.1f} s | {err} |")
    gain, p50, p99 = served[top][0] / naive[0], statistics.median(naive[1]), pct(naive[1], 99)
    rows.append(f"| {top}, naive server (one episode at a time) | — | {naive[0]:.2f} | served batched / naive "
                f"**{gain:.2f}x** | {p50:.1f} s | {p99:.1f} s | {naive[2]} |")
    verdict = ("target served ≥ 0.8x offline at 16 clients: "
               + (("MET" if served[16][0] / off[16] >= 0.8 else "MISSED") + f" ({served[16][0] / off[16]:.2f}x)"
                  if 16 in served else "not measured (no 16 in --clients)"))
    text = "\n".join(rows) + "\n\n" + verdict + "\n"
    print(text)
    if not args.no_record:
        with open(results_file("serve"), "a") as f:
            f.write(f"\n### Serving throughput: `masgraph serve` vs offline `masgraph run` "
                    f"({time.strftime('%Y-%m-%d %H:%M')})\n\n`python benchmarks/serve_throughput.py --graph "
                    f"{args.graph} --task {args.task} --n {args.n} --clients {' '.join(map(str, args.clients))}` — "
                    f"{args.n} held-out questions per arm, SmolLM2-135M on this CPU, offline and served never at the "
                    f"same time.\n\n{text}")


if __name__ == "__main__":
    main()
