"""Load on `masgraph serve`: an exported bundle asked by N concurrent `openai` clients, quiet and beside busy loops.

What a user sees when more requests arrive than the server can hold (issue 30): every request must end as an answer
or as a 429 / 503 / 504 whose body is an OpenAI error object (never a bare 500); overflow is refused at once (429
with Retry-After, < 1 s); and, in deterministic mode, the answers of admitted requests do not depend on the load.

One bundle (`masgraph export GRAPH`) is served with `--deterministic --max-concurrency C --max-queue Q`, so C + Q
requests are admitted and the rest of a burst overflows. For each burst size N (100, 300) the same N questions are
sent at once by one `openai.AsyncOpenAI` client (max_retries=0: the SDK would otherwise retry 429s itself), once on a
quiet machine and once beside `--busy` processes that each spin on a core. A fresh server is started for every
(N, load) cell so no cell warms another. Questions that were admitted in both the quiet and the busy cell must get
byte-identical answers.

How fast overflow is refused is measured twice. The burst's own refusals, as the openai client sees them, include
that client's work for all N requests at once on the same 2 cores as the server (measured: a bare socket client
saw the same server refuse a 300-burst in 0.46-0.53 s where the openai client saw 2-2.3 s). So the target is read
on probes: while the admitted episodes run, 10 single requests one second apart from a bare HTTP/1.1 client.

    .venv/bin/python benchmarks/serve_load.py [--graph graphs/agentflow.yaml] [--bursts 100 300] [--busy 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from results_file import results_file
from serve_throughput import pct  # benchmarks/ is on sys.path when this file runs
from serve_throughput import server as serve_process

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ERROR_CODES = (429, 503, 504)
"""What a request the server cannot answer may end as; each with an OpenAI error body."""
OVERFLOW_CODES = ("queue_full", "too_many_connections")
"""Refusals that must come at once: the queue is full (429) or the connection cap is reached (503)."""


@dataclass
class Cell:
    """One burst against one fresh server: what each request ended as."""

    n: int
    busy: int
    wall_s: float = 0.0
    answers: dict[int, str] = field(default_factory=dict)  # question index -> answer text
    refused: Counter = field(default_factory=Counter)  # status -> count (with an OpenAI error body)
    bad: list[str] = field(default_factory=list)  # anything else: bare 500s, bodies that are not OpenAI errors
    overflow_s: list[float] = field(default_factory=list)  # time to each refusal at once (queue or connections full)
    probe_s: list[float] = field(default_factory=list)  # time to a probe's refusal while the server is full
    codes: Counter = field(default_factory=Counter)  # the error bodies' codes
    answer_s: list[float] = field(default_factory=list)


@contextlib.contextmanager
def spinners(n: int):
    """n processes that each spin on a core (a busy machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def server(bundle: str, concurrency: int, queue: int, log: Path):
    """`masgraph serve BUNDLE --deterministic` with the cell's admission limits (serve_throughput's server)."""
    return serve_process(bundle, "--deterministic", "--max-concurrency", str(concurrency), "--max-queue", str(queue),
                         log=log)


def _openai_error(body: object) -> bool:
    """An OpenAI error object: {"error": {"message": str, "type": str, ...}}."""
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


async def burst(url: str, model: str, questions: list[str], cell: Cell) -> None:
    """Send every question at once; sort each outcome into the cell."""

    async def one(client: openai.AsyncOpenAI, i: int, q: str) -> None:
        t0 = time.perf_counter()
        try:
            r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}])
        except openai.APIStatusError as e:
            dt = time.perf_counter() - t0
            body = e.response.json() if e.response.headers.get("content-type", "").startswith(
                "application/json") else None
            if e.status_code in ERROR_CODES and _openai_error(body):
                cell.refused[e.status_code] += 1
                code = body["error"].get("code")
                cell.codes[f"{e.status_code} {code}"] += 1
                if code in OVERFLOW_CODES:
                    cell.overflow_s.append(dt)
            else:
                cell.bad.append(f"{e.status_code}: {e.response.text[:200]!r}")
            return
        except openai.APIError as e:  # a connection dropped, a read timeout: never acceptable
            cell.bad.append(f"{type(e).__name__}: {e}")
            return
        cell.answer_s.append(time.perf_counter() - t0)
        cell.answers[i] = r.choices[0].message.content or ""

    limits = httpx.Limits(max_connections=len(questions) + 8, max_keepalive_connections=len(questions) + 8)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(probe(url, model, cell), *(one(client, i, q) for i, q in enumerate(questions)))
        cell.wall_s = time.perf_counter() - t0


async def probe(url: str, model: str, cell: Cell, start_s: float = 5.0, n: int = 10, every_s: float = 1.0) -> None:
    """While the burst's admitted episodes run (the server is full), send `n` single requests from a bare HTTP/1.1
    client (a socket: no SDK work on this 2-core machine in the time measured) and time each refusal. The burst's
    own refusal times also hold the openai client's work for all its requests at once."""
    host, port = url.removeprefix("http://").split(":")
    await asyncio.sleep(start_s)
    for k in range(n):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"probe {k}"}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(60):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(head + body)
                await writer.drain()
                raw = await reader.read()
                writer.close()
        except (TimeoutError, OSError) as e:
            cell.bad.append(f"probe {k}: {type(e).__name__}: {e}")
            continue
        dt = time.perf_counter() - t0
        status, _, rest = raw.partition(b"\r\n")
        try:
            err = json.loads(rest.partition(b"\r\n\r\n")[2])
        except ValueError:
            err = None
        code = err["error"].get("code") if _openai_error(err) else None
        if code in OVERFLOW_CODES:
            cell.probe_s.append(dt)
        else:
            cell.bad.append(f"probe {k}: {status.decode(errors='replace')} {rest[-200:]!r}")
        await asyncio.sleep(every_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", default="graphs/agentflow.yaml")
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--bursts", type=int, nargs="+", default=[100, 300])
    ap.add_argument("--busy", type=int, default=2, help="spinning processes in the busy cells (default 2)")
    ap.add_argument("--concurrency", type=int, default=16, help="serve --max-concurrency (default 16)")
    ap.add_argument("--queue", type=int, default=32, help="serve --max-queue (default 32)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    os.chdir(ROOT)
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.tasks import get_task

    model = compile_spec(load_spec(args.graph)).spec.name
    questions = [it.question for it in get_task(args.task).items("test", max(args.bursts), 0)]
    work = Path(tempfile.mkdtemp(prefix="serve-load-"))
    bundle, log = work / "bundle", work / "serve.log"
    subprocess.run([sys.executable, "-m", "masgraph.cli", "export", args.graph, "--out", str(bundle)], check=True,
                   stdout=subprocess.DEVNULL)
    cells: list[Cell] = []
    for n in args.bursts:
        for load in (0, args.busy):
            cell = Cell(n, load)
            with server(str(bundle), args.concurrency, args.queue, log) as url, spinners(load):
                asyncio.run(burst(url, model, questions[:n], cell))
            cells.append(cell)
            print(f"N={n:<4} busy={load}  answered {len(cell.answers)}  refused {dict(cell.refused)}  bad "
                  f"{len(cell.bad)}  codes {dict(cell.codes)}  refused at once in p50 {pct(cell.overflow_s, 50):.2f}s "
                  f"max {max(cell.overflow_s, default=0):.2f}s  probes p50 {pct(cell.probe_s, 50):.2f}s max "
                  f"{max(cell.probe_s, default=0):.2f}s  wall {cell.wall_s:.0f}s",
                  flush=True)
            for b in cell.bad[:5]:
                print(f"   bad: {b}", flush=True)
    rows = ["| requests | busy loops | answered | refusals (status code: count) | bare 500 / not an OpenAI error | "
            "burst's refusals at once, openai client: p50 / max | probes of the full server: p50 / max | "
            "answer latency p50 / max | wall | answers equal to quiet |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for c in cells:
        quiet = next(q for q in cells if q.n == c.n and q.busy == 0)
        both = sorted(set(quiet.answers) & set(c.answers))
        same = sum(quiet.answers[i] == c.answers[i] for i in both)
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(c.codes.items())) or "none"
        rows.append(f"| {c.n} | {c.busy} | {len(c.answers)} | {codes} | {len(c.bad)} | {pct(c.overflow_s, 50):.2f} s / "
                    f"{max(c.overflow_s, default=0):.2f} s | {pct(c.probe_s, 50):.2f} s / "
                    f"{max(c.probe_s, default=0):.2f} s | {pct(c.answer_s, 50):.1f} s / "
                    f"{max(c.answer_s, default=0):.1f} s | {c.wall_s:.0f} s | {same}/{len(both)} |")
        verdicts.append(not c.bad and c.probe_s and max(c.probe_s) < 1.0 and same == len(both)
                        and len(c.answers) + sum(c.refused.values()) == c.n)
    text = "\n".join(rows) + (f"\n\nserver: `--deterministic --max-concurrency {args.concurrency} --max-queue "
                              f"{args.queue}` (so {args.concurrency + args.queue} admitted per burst at most); "
                              "target: 0 bare 500s, every failure a 429/503/504 with an OpenAI error body, a request "
                              "to the full server refused (queue_full, too_many_connections) in < 1 s (the probes), "
                              "admitted answers equal to the quiet run's: "
                              + ("MET" if all(verdicts) else "MISSED") + "\n")
    print(text)
    if not args.no_record:
        with open(results_file("serve"), "a") as f:
            f.write(f"\n### Serving under load: bursts of `openai`-client requests, quiet and beside busy loops "
                    f"({time.strftime('%Y-%m-%d %H:%M')})\n\n`python benchmarks/serve_load.py --graph {args.graph} "
                    f"--task {args.task} --bursts {' '.join(map(str, args.bursts))} --busy {args.busy} "
                    f"--concurrency {args.concurrency} --queue {args.queue}` — an exported bundle of the graph "
                    f"(untrained adapters), SmolLM2-135M on this 2-core CPU, a fresh server per cell.\n\n{text}")


if __name__ == "__main__":
    main()
