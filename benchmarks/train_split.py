"""Where a training step's time goes: rollouts vs the update (and the rest: weight sync, bookkeeping), for the
AgentFlow graph trained with Flow-GRPO, rollouts on the in-process hf backend and on a vLLM server, one run each.
Read from the runs' metrics.jsonl (`time/rollout_s`, `time/step_s`); steps without an update (no informative
group) are listed but left out of the update mean. The basis of the written GPU estimate in results/scale_out.md.

    .venv/bin/python benchmarks/train_split.py [--steps 4] [--queries 2]     # the vllm side needs `make vllm`
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(backend: str | None, steps: int, queries: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "-m", "masgraph.cli", "train", str(ROOT / "graphs/agentflow.yaml"), "--task",
               "basic_arithmetic", "--steps", str(steps), "--queries-per-step", str(queries), "--eval-every", "0",
               "--eval-n", "1", "--runs-dir", runs, *(["--backend", backend] if backend else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        [run] = [p for p in Path(runs).iterdir() if p.is_dir()]
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--queries", type=int, default=2)
    args = ap.parse_args()
    print(f"AgentFlow Flow-GRPO on basic_arithmetic: {args.steps} steps x {args.queries} queries x group 8")
    for backend in ("hf", "vllm"):
        steps = train(None if backend == "hf" else backend, args.steps, args.queries)
        for m in steps:
            roll, total = m["time/rollout_s"], m["time/step_s"]
            print(f"  {backend:5s} step {m['step']}: rollouts {roll:5.1f} s  rest {total - roll:5.1f} s  "
                  f"{'update' if m.get('loss/optimizer_steps') else 'no update'}  tokens {m['tokens']}")
        updated = [m for m in steps if m.get("loss/optimizer_steps")]
        roll = sum(m["time/rollout_s"] for m in steps) / len(steps)
        rest = sum(m["time/step_s"] - m["time/rollout_s"] for m in updated) / max(len(updated), 1)
        tokens = sum(m["tokens"] for m in steps) / len(steps)
        print(f"  {backend:5s} mean: rollouts {roll:.1f} s/step ({tokens:.0f} tokens), update + sync {rest:.1f} s/step "
              f"(over {len(updated)} updating steps): rollouts are {roll / (roll + rest):.0%} of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
