"""Replay one training step of a Flow-GRPO run from the checkpoint before it, then score the held-out items.

The step's rollouts are read back from the run's events (with their counterfactual scores, as the update read
them; `memory_signal.step_batches`), the adapter, optimizer and RNG state come from `RUN/checkpoints/step-(N-1)`,
and the update runs with the run's knobs or with others (`--set`). Printed: the update's metrics beside the ones
the run recorded for that step (so the replay's fidelity shows), then the held-out greedy accuracy after it, on the
items and seed the run was scored on. What it answers: did this one update cause a drop, and would another knob
have moved the policy less on the very same rollouts?

    .venv/bin/python benchmarks/replay_step.py runs/bench-learns-memory-memory_updates-s1-... --step 16
    .venv/bin/python benchmarks/replay_step.py RUN --step 16 --set ppo.dual_clip=3

A diagnostic (loads the model; a copy of the run directory is used, the run itself is left untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

from learns import knob_overrides
from memory_signal import step_batches
from pydantic import ValidationError

from masgraph.errors import MasgraphError
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.rundir.checkpoint import checkpoint_dtype, resolve_checkpoint
from masgraph.rundir.store import read_jsonl
from masgraph.tasks import get_task
from masgraph.trainers.config import with_overrides
from masgraph.trainers.loop import TrainLoop

SHOWN = ("rows/trained", "kl/old_k3", "loss/clip_frac", "kl/ref_k3", "grad_norm", "loss/total", "groups/informative")


def replay(run: Path, step: int, overrides: dict) -> dict[str, float]:
    """The update of `step` redone from the checkpoint before it with `overrides`; its metrics and the held-out
    accuracy after it."""
    config = json.loads((run / "config.json").read_text())
    train = config["config"]["train"]
    checkpoint = resolve_checkpoint(run / "checkpoints" / f"step-{step - 1}")
    spec = load_spec(run / "spec.yaml")
    fg = with_overrides(spec.train.flow_grpo, overrides)
    cfg = spec.train.model_copy(update={"flow_grpo": fg, "seed": train["seed"], "eval_n": train["eval_n"]})
    graph = compile_spec(spec.model_copy(update={"train": cfg}), run / "spec.yaml")
    traces = step_batches(run).get(step)
    if not traces:
        raise MasgraphError(f"{run} has no credit lines for step {step} (its rollouts are not in events.jsonl)")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / run.name  # `load` truncates the copy's metrics, not the run's
        copy.mkdir()
        shutil.copy(run / "metrics.jsonl", copy / "metrics.jsonl")
        loop = TrainLoop(graph, get_task(config["config"]["task"]), copy, dtype=checkpoint_dtype(checkpoint))
        loop.load(checkpoint)
        metrics = loop.algo.train_step(traces, loop.step)
        loop.sync()
        loop.step += 1
        metrics |= asyncio.run(loop.evaluate())
        asyncio.run(loop.aclose())
    return metrics


def _metric(metrics: dict, key: str) -> str:
    """`key`'s value (or the first per-adapter `key/...` one), formatted; '-' when absent."""
    value = next((v for k, v in metrics.items() if k == key or k.startswith(key + "/")), None)
    return "-" if value is None else f"{value:.4g}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a training run directory (a checkpoint every step, events.jsonl)")
    p.add_argument("--step", type=int, required=True, help="the step to replay (its checkpoint before: step-(N-1))")
    p.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE", help="flow_grpo knobs in place of the run's")
    args = p.parse_args()
    if not (args.run / "config.json").is_file() or not (args.run / "spec.yaml").is_file():
        print(f"error: {args.run} is not a training run directory (no config.json and spec.yaml)", file=sys.stderr)
        return 1
    try:
        got = replay(args.run, args.step, knob_overrides(args.set))
    except ValidationError as exc:
        print(f"error: --set {' '.join(args.set)}: {exc}", file=sys.stderr)
        return 1
    except MasgraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    recorded = next((m for m in read_jsonl(args.run / "metrics.jsonl") if m.get("step") == args.step), {})
    knobs = " ".join(args.set) or "the run's knobs"
    print(f"== {args.run}, step {args.step} replayed with {knobs}")
    for key in SHOWN:
        print(f"  {key:20s} replay {_metric(got, key):>10}   run {_metric(recorded, key):>10}")
    print(f"  held-out accuracy after it: {got['accuracy/test']:.3f} "
          f"(run: {recorded.get('accuracy/test', 'not scored at that step')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
