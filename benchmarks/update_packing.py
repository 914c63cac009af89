"""One Flow-GRPO update on real rollouts, packed (merged turns, shared prompts: masgraph/learn/packing.py) vs the
layout before packing (the prefix common to a pass's rows alone), same rows, same starting adapters.

Rolls out a graph once on the embedded model (queries x samples episodes, the graph's trainable adapters at a fixed
random start, so the update has something to push), then runs the update in alternating arms, each from the same
adapter weights and a fresh optimizer, and prints per arm: rows, sequences and tokens (received vs computed) of the
gradient passes, seconds per update, the loss and each adapter's weights after it (equal across arms up to fp32).

    .venv/bin/python benchmarks/update_packing.py                       # agentflow, basic_arithmetic, 2 x 8
    .venv/bin/python benchmarks/update_packing.py --graph graphs/mixed_router.yaml --task mixed_routes --queries 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from datetime import datetime
from pathlib import Path

import torch
from results_file import results_file

from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.graph import compile_spec
from masgraph.learn.learner import LoraConfigSpec, WeightSync
from masgraph.loader import load_spec
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.tasks import get_task
from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, build_rows

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", default=str(ROOT / "graphs" / "agentflow.yaml"))
    ap.add_argument("--task", default="basic_arithmetic")
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="updates per arm, alternating")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    spec = load_spec(args.graph)
    trainable = spec.trainable_adapters()
    train = spec.train
    lora = LoraConfigSpec(train.lora_rank, train.lora_alpha, tuple(train.lora_targets)) if train else LoraConfigSpec()
    torch.manual_seed(0)
    learner = HFLearner("smollm2-135m", dtype="float32")
    for adapter in sorted(set(trainable.values())):
        learner.add_adapter(adapter, lora)
        with torch.no_grad():  # a non-zero adapter: its own policy, not the base
            for p in learner.parameters(adapter):
                p.add_(0.02 * torch.randn_like(p))
    start = {a: [p.detach().clone() for p in learner.parameters(a)] for a in set(trainable.values())}
    base = train.flow_grpo if train else FlowGRPOConfig()
    # every row trained, whatever the rewards: the layouts are compared on all the rows a step can hold
    config = base.model_copy(update={"batching": base.batching.model_copy(update={"zero_variance": "keep"})})
    graph = compile_spec(FlowGRPO(learner, trainable, config).rollout_spec(spec))  # sampling as training samples
    backend = HFBackend(learner.weights, seed=1)
    WeightSync(learner, [backend])()
    runner = Runner(graph, RunConfig(n=args.queries, split="train", samples=args.samples, concurrency=16),
                    backends={"hf": backend})
    t0 = time.perf_counter()
    traces = asyncio.run(runner.run_task(get_task(args.task), store=False)).traces
    rollout_s = time.perf_counter() - t0
    rows = build_rows(traces, trainable, config)
    print(f"{len(traces)} episodes in {rollout_s:.0f} s, {len(rows)} rows")

    arms: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):
        for pack in (False, True):
            with torch.no_grad():
                for a, ps in start.items():
                    for p, s in zip(learner.parameters(a), ps):
                        p.copy_(s)
            learner.pack = pack
            algo = FlowGRPO(learner, trainable, config)
            t = time.perf_counter()
            m = algo.update(traces, seed=0)
            m["seconds"] = time.perf_counter() - t
            m["weights"] = {a: [p.detach().clone() for p in learner.parameters(a)] for a in start}
            arms[pack].append(m)
            print(f"pack={pack}: {m['seconds']:.1f} s, sequences {m.get('rows/sequences')}, tokens computed "
                  f"{m.get('rows/tokens_computed')} of {m.get('rows/tokens_received')}, loss {m['loss/total']:.6f}")
    old, new = arms[False], arms[True]
    diff = max((a - b).abs().max().item() for ad in start for a, b in zip(old[0]["weights"][ad], new[0]["weights"][ad]))
    ratio = min(m["seconds"] for m in new) / min(m["seconds"] for m in old)
    print(f"time packed/unpacked {ratio:.2f}x (fastest each); adapter weights max |diff| {diff:.2e}")
    if args.no_record:
        return
    load = os.getloadavg()[0]
    lines = [f"\n### Update packed vs unpacked: {Path(args.graph).name}, {args.task}, {args.queries} x {args.samples} "
             f"({datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores, load {load:.1f})",
             f"`python benchmarks/update_packing.py --graph {_shown(args.graph)} --task {args.task} "
             f"--queries {args.queries} --samples {args.samples} --repeats {args.repeats}` — smollm2-135m fp32, CPU, "
             f"{torch.get_num_threads()} torch threads; rollouts {rollout_s:.0f} s for {len(traces)} episodes.", "",
             "| layout | rows | sequences | tokens received | tokens computed | s / update | loss |",
             "|---|---|---|---|---|---|---|"]
    for name, ms in (("before packing", old), ("packed", new)):
        m = ms[0]
        times = ", ".join(f"{x['seconds']:.1f}" for x in ms)
        lines.append(f"| {name} | {m['rows/trained']:.0f} | {m.get('rows/sequences', 0):.0f} | "
                     f"{m.get('rows/tokens_received', 0):.0f} | {m.get('rows/tokens_computed', 0):.0f} | "
                     f"{times} | {m['loss/total']:.6f} |")
    lines += ["", f"- time packed / before: **{ratio:.2f}x** (fastest update each); adapter weights after the update "
                  f"max |diff| {diff:.1e} (fp32 summation order)"]
    with results_file("update_packing").open("a") as f:
        f.write("\n".join(lines) + "\n")


def _shown(graph: str) -> str:
    """The graph's path as the recorded command gives it: relative to the repository when it is inside."""
    path = Path(graph).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    main()
