"""Credit below the trajectory (issue 27): episode-only Flow-GRPO vs step-level credit vs branching, side by side.

On `lookup` (two-hop questions: person -> city -> country; 0 % greedy on every shipped graph, because the verifier
stops after the first hop) with `graphs/agentflow.yaml`, each arm trains the planner and verifier adapters for the
same --minutes of this process's CPU time per seed, and is scored greedy on the same held-out items as its own
untrained baseline; pass@k (k samples per item at the training temperature) is measured before training and for
each trained run, since a 135M model may not reach a greedy answer at all.

    episode    credit.advantage: episode                     (Flow-GRPO as AgentFlow ships it)
    step       credit.advantage: episode+step                (GiGPO's anchor-state groups per call, credit.py)
    branching  credit.advantage: episode+step, branch_width  (ARPO-style forks at the least certain step)

    .venv/bin/python benchmarks/credit.py --seeds 0 1 2 --minutes 15 [--arms episode step branching]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from learns import train
from results_file import results_file

from masgraph.backends.hf import HFBackend
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import get_task, is_correct
from masgraph.trainers.flow_grpo import sampling_spec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARMS = {"episode": {"credit": {"advantage": "episode"}}, "step": {"credit": {"advantage": "episode+step"}},
        "branching": {"credit": {"advantage": "episode+step"}, "branch_width": 1}}


def pass_at_k(graph_path: str, task: str, n: int, k: int, seed: int, checkpoint: str | None = None) -> float:
    """pass@k on held-out items with the trainable policies at the training temperature (the base model, or the
    adapters of `checkpoint`: a training run directory)."""
    spec = load_spec(graph_path)
    graph = compile_spec(sampling_spec(spec, spec.train.flow_grpo.temperature))
    hf = next(p for p in spec.policies.values() if p.backend == "hf")
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(graph, RunConfig(split="test", n=n, samples=k, seed=seed, concurrency=32, runs_dir=runs),
                        backends={"hf": HFBackend(hf.model, seed=seed, device=hf.device)})
        if checkpoint:
            runner.load_checkpoint(checkpoint)
        result = asyncio.run(runner.run_task(get_task(task)))
    solved: dict[str, bool] = {}
    for t in result.traces:
        solved[t.item_id] = solved.get(t.item_id, False) or is_correct(t)
    return sum(solved.values()) / len(solved)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="graphs/agentflow.yaml")
    p.add_argument("--task", default="lookup")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--minutes", type=float, default=15.0, help="training budget per run, CPU minutes")
    p.add_argument("--eval-n", type=int, default=30, help="held-out items (lookup has 30 held-out people)")
    p.add_argument("--passk-n", type=int, default=16)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--no-before", action="store_true",
                   help="skip the untrained pass@k (already measured for these seeds in an earlier entry)")
    p.add_argument("--record", type=Path, default=results_file("credit"))
    args = p.parse_args()
    t0 = time.perf_counter()
    before = None if args.no_before else pass_at_k(args.graph, args.task, args.passk_n, args.k, args.seeds[0])
    shown = "not measured in this run" if before is None else f"{before:.1%}"
    print(f"untrained pass@{args.k} {shown} (n={args.passk_n}, {time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            r = train(args.graph, args.task, seed, args.minutes, args.eval_n, check_rule=False, flow_grpo=ARMS[arm],
                      clock="cpu")
            after = pass_at_k(args.graph, args.task, args.passk_n, args.k, args.seeds[0], str(ROOT / r["run_dir"]))
            rows.append({"arm": arm, "seed": seed, **r, "passk": after})
            print(f"[{arm} s{seed}] greedy {r['base']:.3f} -> {r['trained']:.3f} after {r['steps']} steps; "
                  f"pass@{args.k} {shown} -> {after:.3f}", flush=True)
    lines = [f"| arm | seed | steps | greedy before | greedy after | pass@{args.k} after | parse-failed after | run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['seed']} | {r['steps']} | {r['base']:.1%} | **{r['trained']:.1%}** | "
                     f"{r['passk']:.1%} | {r['trained_parse_fail']:.1%} | `{r['run_dir']}` |")
    for arm in args.arms:
        got = [r["trained"] for r in rows if r["arm"] == arm]
        sd = statistics.stdev(got) if len(got) > 1 else 0.0
        lines.append(f"| **{arm}** mean (sd) | | | | **{statistics.mean(got):.1%}** ({100 * sd:.1f}) | | | |")
    table = "\n".join(lines)
    print(table)
    with open(args.record, "a") as f:
        f.write(f"\n### Credit: episode vs step vs branching on `{args.task}` ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — `{args.graph}`, {args.minutes:g} CPU-min "
                f"of training per run, {args.eval_n} held-out items greedy; untrained pass@{args.k} **{shown}** "
                f"(n={args.passk_n}); pass@{args.k} after on the same items.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
