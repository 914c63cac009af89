"""Overlapped rollouts: seconds per training step with `train.max_staleness: 1` against the on-policy loop (0).

Each arm is `masgraph train` in its own process on the same graph, task, seed and step count (the graph's own
model; held-out evaluation only the last one, on 1 item, not timed). Seconds per step is the run's training time
(`time/train_s`: rollouts + updates, evaluation excluded) over its steps; `time/rollout_s` is how long each step
waited for its rollouts (with overlap, only what the update did not hide). The arms alternate within a run
(0, 1, 0, 1 with `--runs 2`), so a machine that gets busier does not favour one.

    .venv/bin/python benchmarks/overlap.py --steps 4 --queries 2 --group 4 --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from train_variant import train_variant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def arm(graph: Path, task: str | None, staleness: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """One `masgraph train` run of `graph` with `max_staleness: staleness`; its timings."""
    t0 = time.perf_counter()
    run = train_variant(graph, {"max_staleness": staleness, "flow_grpo.group_size": args.group},
                        tmp / f"runs-{staleness}-{time.monotonic_ns()}", steps=args.steps, queries=args.queries,
                        seed=args.seed, task=task)
    wall = time.perf_counter() - t0
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m["step"] > 0]
    return {"s_per_step": steps[-1]["time/train_s"] / len(steps), "wall_s": wall,
            "rollout_wait_s": statistics.mean(m["time/rollout_s"] for m in steps),
            "update_s": statistics.mean(m["time/update_s"] for m in steps),
            "rows": statistics.mean(m["rows/trained"] for m in steps),
            "acc_train": statistics.mean(m["accuracy/train"] for m in steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", type=Path, default=ROOT / "graphs" / "agentflow.yaml")
    ap.add_argument("--task", default=None, help="default: the graph's train.task")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--queries", type=int, default=2, help="queries per step")
    ap.add_argument("--group", type=int, default=4, help="rollouts per query (flow_grpo.group_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1, help="runs of each arm, alternating")
    ap.add_argument("--no-record", action="store_true", help="print only (no entry in benchmarks/results)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    results: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for staleness in (0, 1):
                got = arm(args.graph.resolve(), args.task, staleness, args, Path(tmp))
                print(f"max_staleness {staleness}: {json.dumps({k: round(v, 2) for k, v in got.items()})}",
                      flush=True)
                results[staleness].append(got)
    end_load = os.getloadavg()[0]
    def cells(s: int, key: str, fmt: str = ".1f") -> str:
        return ", ".join(format(r[key], fmt) for r in results[s])

    rows = [f"| {s} | {cells(s, 's_per_step')} | {cells(s, 'rollout_wait_s')} | {cells(s, 'update_s')} | "
            f"{cells(s, 'acc_train', '.2f')} |" for s in (0, 1)]
    ratios = [b["s_per_step"] / a["s_per_step"] for a, b in zip(results[0], results[1])]
    graph = args.graph.resolve().relative_to(ROOT) if args.graph.resolve().is_relative_to(ROOT) else args.graph
    report = "\n".join([
        f"`python benchmarks/overlap.py --graph {graph}{f' --task {args.task}' if args.task else ''} --steps "
        f"{args.steps} --queries {args.queries} --group {args.group} --seed {args.seed} --runs {args.runs}`: "
        f"{os.cpu_count()} cores, load average {load:.1f} at the start and {end_load:.1f} at the end.", "",
        "| max_staleness | s/step (training time / steps), per run | rollout wait s/step | update s/step "
        "| train accuracy |", "|---|---|---|---|---|", *rows, "",
        f"overlapped / on-policy seconds per step: **{', '.join(f'{r:.2f}x' for r in ratios)}** (per run)."])
    print(report)
    if not args.no_record:
        sys.path.insert(0, str(HERE))
        from results_file import results_file

        with open(results_file("overlap"), "a") as f:
            f.write(f"\n### Overlapped rollouts vs on-policy ({time.strftime('%Y-%m-%d %H:%M')})\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
