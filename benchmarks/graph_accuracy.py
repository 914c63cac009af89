"""Greedy accuracy of every shipped graph on the README's tasks, through the `masgraph run` command.

The README's "what the embedded model can and cannot do" table comes from here: each graph x task is one
`masgraph run GRAPH --task TASK --n N --deterministic` (held-out test split, greedy as the graphs ship),
read back from the run's summary.json. The same items for every graph (same task, split, seed).

    .venv/bin/python benchmarks/graph_accuracy.py [--n 32] [--tasks basic_arithmetic lookup]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import results_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GRAPHS = ("agentflow", "single", "fanout")


def run_one(graph: str, task: str, n: int, seed: int, runs: str) -> dict:
    """One `masgraph run`; returns its summary.json."""
    cmd = [str(Path(sys.executable).parent / "masgraph"), "run", str(ROOT / "graphs" / f"{graph}.yaml"),
           "--task", task, "--n", str(n), "--seed", str(seed), "--concurrency", "16", "--deterministic",
           "--runs-dir", runs]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    run_dir = next(line.split(None, 2)[2] for line in out.stdout.splitlines() if line.startswith("run dir"))
    return json.loads((Path(run_dir) / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", nargs="+", default=["basic_arithmetic", "lookup"])
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as runs:
        for graph in GRAPHS:
            accs = []
            for task in args.tasks:
                t0 = time.perf_counter()
                s = run_one(graph, task, args.n, args.seed, runs)
                accs.append(s["accuracy"])
                failures = ", ".join(f"{k} {n}" for k, n in s.get("failures", {}).items() if n) or "none"
                print(f"{graph:10s} {task:18s} accuracy {s['accuracy']:.3f} (of finished "
                      f"{s.get('accuracy_finished') or 0:.3f}, reward {s['reward_mean']:.3f}, failures {failures}, "
                      f"parse errors {s['parse_error_rate']:.2f}, {time.perf_counter() - t0:.0f} s)", flush=True)
            rows.append((graph, accs))
    with open(results_file("graph_accuracy"), "a") as f:
        f.write(f"\n### Shipped graphs, greedy accuracy on held-out items ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — n={args.n} per task, seed {args.seed}, "
                "`masgraph run --deterministic`\n\n"
                f"| graph | {' | '.join(args.tasks)} |\n|---|{'---|' * len(args.tasks)}\n")
        for graph, accs in rows:
            f.write(f"| `{graph}` | {' | '.join(f'{a * 100:.1f} %' for a in accs)} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
