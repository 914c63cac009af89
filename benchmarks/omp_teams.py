"""A decode step on the batcher's thread, beside another thread's idle OpenMP team: kept (before) vs let go (now).

libgomp keeps each thread's team of workers for its next parallel region and counts the workers of every team;
when they outnumber the cores it cuts every wait to 100 spins, whatever `GOMP_SPINCOUNT` says. The thread that
loads the model (and later runs the update) has a team; the batcher's thread that decodes makes its own. Since
2026-12-05 a thread lets its workers go when it finishes a phase of kernels, and the event loop's thread when it
hands a batch to the batcher (masgraph/threads.py `release_team`). Arms, one process, same requests:

- "one thread": `generate` on the thread that loaded the model (no second team: the reference);
- "batcher, caller's team kept": `complete` through the batcher's thread with `release_team` turned off;
- "batcher, teams let go": `complete` as masgraph runs it.

Each arm generates `--tokens` and a third of that; the difference over the extra tokens is the time of the decode
steps (the prompt pass cancels out). Arms alternate over `--repeats`; the median is reported, every repeat printed.

    .venv/bin/python benchmarks/omp_teams.py [--rows 32] [--tokens 96] [--dtype auto] [--repeats 3]
"""

# ruff: noqa: E402, I001  (`import masgraph` sets torch's thread wait policy before torch loads)
from __future__ import annotations

import masgraph  # noqa: F401

import argparse
import asyncio
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from results_file import results_file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32, help="rows decoding at once (4 questions x rows/4 samples)")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", type=Path, default=results_file("omp_teams"))
    args = p.parse_args()
    from masgraph import threads
    from masgraph.backends.base import Request
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf import backend as hf_backend
    from masgraph.spec import SamplingSpec

    backend = HFBackend("smollm2-135m", dtype=args.dtype, max_batch_size=args.rows)
    backend.layout.eos_ids.clear()  # every row runs to its max_tokens
    system = "You answer questions directly. Reply with one line: \"Answer: ...\"."
    messages = [[{"role": "system", "content": system}, {"role": "user", "content": f"Calculate {q * 37} + {q * 91}."}]
                for q in range(4) for _ in range(args.rows // 4)]
    release = threads.release_team

    def requests(n: int) -> list[Request]:
        sampling = SamplingSpec(temperature=0.7, max_tokens=n)
        return [Request(m, sampling=sampling, seed=i) for i, m in enumerate(messages)]

    def one_thread(n: int) -> None:
        backend.generate(requests(n))

    def batcher(n: int, keep: bool) -> None:
        for module in (threads, hf_backend):  # `released_team` calls the first, `complete` the second
            module.release_team = (lambda: None) if keep else release
        try:
            torch.ones(1 << 22).sin_()  # the caller's thread has a team, as after loading the model or an update
            asyncio.run(backend.complete(requests(n)))
        finally:
            threads.release_team = hf_backend.release_team = release

    arms = {"one thread": one_thread, "batcher, caller's team kept": lambda n: batcher(n, True),
            "batcher, teams let go": lambda n: batcher(n, False)}
    short = args.tokens // 3
    for run in arms.values():
        run(4)  # warm: the batcher's thread, the prefix cache
    times: dict[str, list[float]] = {name: [] for name in arms}
    for repeat in range(args.repeats):
        for name, run in arms.items():
            t0 = time.perf_counter()
            run(args.tokens)
            t1 = time.perf_counter()
            run(short)
            t2 = time.perf_counter()
            ms = ((t1 - t0) - (t2 - t1)) / (args.tokens - short) * 1000
            times[name].append(ms)
            print(f"repeat {repeat + 1}: {name}: {ms:.1f} ms per decode step", flush=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    ref = med["one thread"]
    rows = [f"| {name} | {med[name]:.1f} | {med[name] / ref:.2f}x | {', '.join(f'{v:.1f}' for v in times[name])} |"
            for name in arms]
    print("\n".join(rows))
    command = " ".join([Path(sys.executable).name, *sys.argv])
    with open(args.record, "a") as f:
        f.write(f"\n### Decode step beside another thread's OpenMP team, smollm2-135m {backend.weights.dtype}, "
                f"{args.rows} rows ({datetime.now():%Y-%m-%d %H:%M})\n\n`{command}`"
                f" — {torch.get_num_threads()} threads, T 0.7, steps {short + 1}-{args.tokens}, median of "
                f"{args.repeats} alternating repeats.\n\n| arm | ms per decode step | vs one thread | each repeat |\n"
                "|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
