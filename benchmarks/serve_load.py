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

    .venv/bin/python benchmarks/serve_load.py [--graph graphs/agentflow.yaml] [--bursts 100 300] [--busy 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ERROR_CODES = (429, 503, 504)
"""What a request the server cannot answer may end as; each with an OpenAI error body."""


@dataclass
class Cell:
    """One burst against one fresh server: what each request ended as."""

    n: int
    busy: int
    wall_s: float = 0.0
    answers: dict[int, str] = field(default_factory=dict)  # question index -> answer text
    refused: Counter = field(default_factory=Counter)  # status -> count (with an OpenAI error body)
    bad: list[str] = field(default_factory=list)  # anything else: bare 500s, bodies that are not OpenAI errors
    overflow_s: list[float] = field(default_factory=list)  # time to each 429
    answer_s: list[float] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@contextlib.contextmanager
def server(bundle: str, concurrency: int, queue: int, log: Path):
    port = _free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", bundle, "--port", str(port),
                                 "--deterministic", "--max-concurrency", str(concurrency), "--max-queue", str(queue),
                                 "--no-store", "--log-level", "warning"], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not start; its log: {log}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


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
                if e.status_code == 429:
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
        await asyncio.gather(*(one(client, i, q) for i, q in enumerate(questions)))
        cell.wall_s = time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


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
                  f"{len(cell.bad)}  429 in max {max(cell.overflow_s, default=0):.2f}s  wall {cell.wall_s:.0f}s",
                  flush=True)
            for b in cell.bad[:5]:
                print(f"   bad: {b}", flush=True)
    rows = ["| requests | busy loops | answered | 429 | 503 | 504 | bare 500 / not an OpenAI error | 429 latency max | "
            "answer latency p50 / max | wall | answers equal to quiet |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for c in cells:
        quiet = next(q for q in cells if q.n == c.n and q.busy == 0)
        both = sorted(set(quiet.answers) & set(c.answers))
        same = sum(quiet.answers[i] == c.answers[i] for i in both)
        rows.append(f"| {c.n} | {c.busy} | {len(c.answers)} | {c.refused[429]} | {c.refused[503]} | {c.refused[504]} | "
                    f"{len(c.bad)} | {max(c.overflow_s, default=0):.2f} s | {pct(c.answer_s, 50):.1f} s / "
                    f"{max(c.answer_s, default=0):.1f} s | {c.wall_s:.0f} s | {same}/{len(both)} |")
        verdicts.append(not c.bad and max(c.overflow_s, default=0) < 1.0 and same == len(both)
                        and len(c.answers) + sum(c.refused.values()) == c.n)
    text = "\n".join(rows) + (f"\n\nserver: `--deterministic --max-concurrency {args.concurrency} --max-queue "
                              f"{args.queue}` (so {args.concurrency + args.queue} admitted per burst at most); "
                              "target: 0 bare 500s, every failure a 429/503/504 with an OpenAI error body, 429 in "
                              "< 1 s, admitted answers equal to the quiet run's: "
                              + ("MET" if all(verdicts) else "MISSED") + "\n")
    print(text)
    if not args.no_record:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(f"\n### Serving under load: bursts of `openai`-client requests, quiet and beside busy loops "
                    f"({time.strftime('%Y-%m-%d %H:%M')})\n\n`python benchmarks/serve_load.py --graph {args.graph} "
                    f"--task {args.task} --bursts {' '.join(map(str, args.bursts))} --busy {args.busy} "
                    f"--concurrency {args.concurrency} --queue {args.queue}` — an exported bundle of the graph "
                    f"(untrained adapters), SmolLM2-135M on this 2-core CPU, a fresh server per cell.\n\n{text}")


if __name__ == "__main__":
    main()
