"""Data-parallel learner scaling: Flow-GRPO update rows/s of 2 learner ranks (1 torch thread each, gloo) vs 1 rank
(1 thread), on the same step's rows, on the embedded SmolLM2-135M in fp32. Each rank is a process started as torchrun
starts them (env:// on localhost); rank 0 times each update between two barriers (the first update is a warm-up).

Rows are synthetic: `--rows` rows of one adapter in groups of 4, each a shared 64-token system prefix, 32 tokens of
its own and a 32-token completion; recorded logprobs are -1 (the clip acts on some tokens, which changes no cost).

    .venv/bin/python benchmarks/learner_scaling.py [--rows 16] [--updates 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def traces(rows: int, vocab: int = 49152) -> list:
    from masgraph.trace import LLMCall, Step, Trace

    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(64)]
    out = []
    for i in range(rows):
        prompt = system + [rng.randrange(vocab) for _ in range(32)]
        completion = [rng.randrange(vocab) for _ in range(32)]
        call = LLMCall(policy="p", adapter="answer", prompt_ids=prompt, completion_ids=completion,
                       logprobs=[-1.0] * 32, text="x", temperature=1.0)
        step = Step(episode_id=f"e{i}", index=0, node="answer", role="generator", turn=1, llm=[call])
        out.append(Trace(episode_id=f"e{i}", item_id=f"q{i // 4}", query="q", steps=[step], reward=float(i % 2)))
    return out


def worker(rows: int, updates: int, out: str) -> None:
    """One learner rank: `updates` + 1 updates of the same rows; rank 0 writes the timed seconds to `out`."""
    import torch
    import torch.distributed as dist

    from masgraph.backends.hf.learner import HFLearner
    from masgraph.learn.data_parallel import init_from_env
    from masgraph.learn.learner import LoraConfigSpec
    from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig

    dp = init_from_env(torch.device("cpu"))
    torch.manual_seed(0)
    learner = HFLearner("smollm2-135m", dtype="float32", threads=1, device="cpu")
    learner.add_adapter("answer", LoraConfigSpec())
    algo = FlowGRPO(learner, {"answer": "answer"}, FlowGRPOConfig(group_size=4))
    batch = traces(rows)
    seconds = []
    for i in range(updates + 1):
        if dp:
            dist.barrier()
        t0 = time.perf_counter()
        algo.update(batch, seed=f"0:{i}")
        if dp:
            dist.barrier()
        seconds.append(time.perf_counter() - t0)
    if dp is None or dp.writes:
        Path(out).write_text(json.dumps(seconds[1:]))
    if dp:
        dist.destroy_process_group()


def run(ranks: int, rows: int, updates: int, tmp: Path) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"ranks{ranks}.json"
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)} if ranks > 1 else {})}
        env.setdefault("XDG_CACHE_HOME", str(ROOT / ".cache"))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(out), "--rows", str(rows),
                                       "--updates", str(updates)], env=env))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a {ranks}-rank run failed")
    seconds = json.loads(out.read_text())
    print(f"{ranks} rank(s): update seconds {seconds}", file=sys.stderr, flush=True)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--updates", type=int, default=2, help="timed updates per run (after one warm-up)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--no-record", action="store_true", help="print only (no entry in benchmarks/results)")
    args = ap.parse_args()
    if args.worker:
        worker(args.rows, args.updates, args.worker)
        return 0
    import tempfile

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        times = {n: run(n, args.rows, args.updates, Path(tmp)) for n in (1, 2)}
    end_load = os.getloadavg()[0]
    rate = {n: args.rows / statistics.median(t) for n, t in times.items()}
    lines = [f"| {n} | {', '.join(f'{s:.1f}' for s in times[n])} | {rate[n]:.2f} |" for n in (1, 2)]
    report = "\n".join([
        f"`python benchmarks/learner_scaling.py --rows {args.rows} --updates {args.updates}`: SmolLM2-135M fp32, "
        f"{args.rows} rows (96 + 32 tokens), 1 torch thread per rank, gloo; {os.cpu_count()} cores, load average "
        f"{load:.1f} at the start and {end_load:.1f} at the end (other processes share the cores).", "",
        "| ranks | update seconds (timed, after 1 warm-up) | rows/s (median) |", "|---|---|---|", *lines, "",
        f"2 ranks / 1 rank: **{rate[2] / rate[1]:.2f}x**."])
    print(report)
    if not args.no_record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from results_file import results_file

        with open(results_file("learner_scaling"), "a") as f:
            f.write(f"\n### Learner scaling, 1 vs 2 ranks ({time.strftime('%Y-%m-%d %H:%M')})\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
