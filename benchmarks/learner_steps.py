"""The learning benchmark's first steps with 1 and with 2 data-parallel learner ranks (and, with `--shard`, 2 ranks
holding the base sharded with FSDP2): the same run?

Each arm is `masgraph train GRAPH --learners N` in deterministic mode (rollouts decoded row by row, so they depend only
on the adapters), same seed, task and steps; rank 0 rolls out, both ranks compute the update on their share of the
rows and all-reduce the gradients. Prints each step's loss, train accuracy and rows per arm, and the largest adapter
difference after the last step. The ranks' gradient sums differ from one process's in fp32 rounding only, so the
steps should agree to ~1e-6 in the loss; a sampled token that flips on that rounding would show as a diverging step.
A step that trained no row compares nothing, and the table says so.

    .venv/bin/python benchmarks/learner_steps.py --steps 3 --queries 2 --group 4 [--shard]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from train_variant import train_variant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = ("loss/total", "accuracy/train", "rows/trained", "reward/mean")


ARMS = {"1 rank": ["--learners", "1"], "2 ranks": ["--learners", "2"], "2 sharded": ["--learners", "2", "--shard"]}


def arm(graph: Path, name: str, args: argparse.Namespace, tmp: Path) -> Path:
    """One deterministic `masgraph train` run of arm `name` (1 torch thread per rank); its run directory."""
    return train_variant(graph, {"deterministic": True, "flow_grpo.group_size": args.group},
                         tmp / f"runs-{name.replace(' ', '-')}", steps=args.steps, queries=args.queries,
                         seed=args.seed, task=args.task, more=ARMS[name], env={"OMP_NUM_THREADS": "1"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", type=Path, default=ROOT / "graphs" / "agentflow.yaml")
    ap.add_argument("--task", default=None, help="default: the graph's train.task")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--queries", type=int, default=2, help="queries per step")
    ap.add_argument("--group", type=int, default=4, help="rollouts per query (flow_grpo.group_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", action="store_true", help="also 2 ranks with the base sharded (FSDP2: --shard)")
    ap.add_argument("--no-record", action="store_true", help="print only (no entry in benchmarks/results)")
    args = ap.parse_args()
    from safetensors.torch import load_file

    load, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        names = [n for n in ARMS if args.shard or n != "2 sharded"]
        runs = {n: arm(args.graph.resolve(), n, args, Path(tmp)) for n in names}
        metrics = {n: [m for m in map(json.loads, (r / "metrics.jsonl").read_text().splitlines()) if m["step"] > 0]
                   for n, r in runs.items()}
        weights = {n: load_file(next((r / "checkpoints" / f"step-{args.steps}").rglob("adapter_model.safetensors")))
                   for n, r in runs.items()}
    one = weights["1 rank"]
    diffs = {n: max(float((one[k] - w[k]).abs().max()) for k in one) for n, w in weights.items() if n != "1 rank"}
    rows = [f"| {steps[0]['step']}{'' if steps[0]['rows/trained'] else ' (no row trained: nothing compared)'} | "
            + " | ".join(" / ".join(f"{m[k]:.6g}" for m in steps) for k in KEYS) + " |"
            for steps in zip(*metrics.values())]
    graph = args.graph.resolve()
    shown = graph.relative_to(ROOT) if graph.is_relative_to(ROOT) else graph
    report = "\n".join([
        f"`python benchmarks/learner_steps.py --graph {shown}{f' --task {args.task}' if args.task else ''} --steps "
        f"{args.steps} --queries {args.queries} --group {args.group} --seed {args.seed}{' --shard' * args.shard}`: "
        "deterministic mode, 1 torch "
        f"thread per process, gloo; {os.cpu_count()} cores, load average {load:.1f} at the start, "
        f"{(time.perf_counter() - t0) / 60:.0f} min in all.", "",
        "| step | " + " | ".join(f"{k} ({' / '.join(names)})" for k in KEYS) + " |",
        "|---" * (len(KEYS) + 1) + "|", *rows, "",
        f"Adapters after step {args.steps}: " + ", ".join(f"max |1 rank - {n}| **{d:.2e}**" for n, d in diffs.items())
        + f" (the adapters' own entries are up to {max(float(w.abs().max()) for w in one.values()):.2e})."])
    print(report)
    if not args.no_record:
        sys.path.insert(0, str(HERE))
        from results_file import results_file

        with open(results_file("learner_scaling"), "a") as f:
            f.write(f"\n### The first steps with {', '.join(names)} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                    f"{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
