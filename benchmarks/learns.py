"""It learns: Flow-GRPO raises the held-out greedy accuracy of a shipped graph on a built-in task.

The rule that picks the task is stated before any training and checked by this script, in this run:
the shipped graph's greedy held-out accuracy (the untrained baseline, `--eval-n` items) must be ≤ 30 %
and its pass@8 (8 samples per item at the training temperature, `--passk-n` items) must be ≥ 30 %;
otherwise the script stops before training. Each seed then trains for `--minutes` of training
wall-clock (rollouts + updates; evaluation not counted) and evaluates greedy on the same held-out items
as its own untrained baseline. Baseline and trained graph are the same YAML, prompts and answer parser;
only the LoRA adapters differ.

`--compare GRAPH` spends the same budget training a second graph (e.g. the single-node monolithic
policy, `graphs/single.yaml`) on the first seed, so "is the graph worth it" is answered in the same run.

`--steps N` stops each run after N steps (or its minutes, whichever comes first); `--device cuda` puts every
hf policy on the GPU (default: as the graph says, `auto`); `--model` replaces every hf policy's model (a name, a
directory, or random:SHAPE from benchmarks/models.py: only to smoke-test this script, nothing is learned).

    .venv/bin/python benchmarks/learns.py --seeds 0 1 --compare graphs/single.yaml
    .venv/bin/python benchmarks/learns.py --seeds 0 1 --steps 10 --device cuda --passk-n 0   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from models import resolve
from results_file import results_file

from masgraph.backends.hf import HFBackend
from masgraph.events import Event, TrainStep
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.rundir.checkpoint import checkpoint_dtype, resolve_checkpoint
from masgraph.rundir.store import read_jsonl
from masgraph.runtime.runner import RunConfig, Runner
from masgraph.spec import GraphSpec
from masgraph.tasks import get_task, is_correct
from masgraph.trainers.config import with_overrides
from masgraph.trainers.flow_grpo import sampling_spec
from masgraph.trainers.loop import TrainLoop

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GREEDY_MAX, PASSK_MIN, K = 0.30, 0.30, 8


class RuleFailed(Exception):
    """The task does not qualify (greedy above the cap); raised before any training."""


class Progress:
    """Prints each step's metrics; stops the run (cancels it) when the untrained accuracy breaks the rule."""

    def __init__(self, name: str, seed: int, check_rule: bool):
        self.name, self.seed, self.check_rule = name, seed, check_rule
        self.failed: RuleFailed | None = None
        self.run: asyncio.Task | None = None

    def emit(self, event: Event) -> None:
        if not isinstance(event, TrainStep):
            return
        m = {"step": event.step, **event.metrics}
        tag = f"  [{self.name} s{self.seed}]"
        if m["step"] == 0:
            print(f"{tag} untrained: acc {m['accuracy/test']:.3f}  parse-failed episodes "
                  f"{m['parse_failed_episodes/test']:.3f}", flush=True)
            if self.check_rule and m["accuracy/test"] > GREEDY_MAX and self.run is not None:
                self.failed = RuleFailed(f"greedy accuracy {m['accuracy/test']:.3f} > {GREEDY_MAX}: "
                                         "the task does not qualify")
                self.run.cancel()  # a sink cannot raise into the loop; it stops the run before the first step
        else:
            print(f"{tag} step {m['step']}  reward {m.get('reward/mean', 0):.3f}  informative "
                  f"{m['groups/informative']:.0f}  kl {m.get('kl/ref_k3', 0):.4f}  {m['time/train_s'] / 60:.1f} min"
                  + (f"  acc(test) {m['accuracy/test']:.3f}" if "accuracy/test" in m else ""), flush=True)


def place(spec: GraphSpec, model: str | None, device: str | None) -> GraphSpec:
    """The graph with every hf policy on `model` and `device` (None: as the graph says)."""
    update = {k: v for k, v in (("model", model), ("device", device)) if v is not None}
    if not update:
        return spec
    return spec.model_copy(update={"policies": {n: p.model_copy(update=update) if p.backend == "hf" else p
                                                for n, p in spec.policies.items()}})


def pass_at_k(graph_path: str, task_name: str, n: int, k: int, seed: int, model: str | None = None,
              device: str | None = None) -> tuple[float, float]:
    """pass@k and mean sampled accuracy with the trainable policies at the training temperature."""
    spec = place(load_spec(graph_path), model, device)
    graph = compile_spec(sampling_spec(spec, spec.train.flow_grpo.temperature))
    hf = next(p for p in spec.policies.values() if p.backend == "hf")
    backend = HFBackend(hf.model, seed=seed, device=hf.device)
    with tempfile.TemporaryDirectory() as runs:
        runner = Runner(graph, RunConfig(split="test", n=n, samples=k, seed=seed, concurrency=32, runs_dir=runs),
                        backends={"hf": backend})
        result = asyncio.run(runner.run_task(get_task(task_name)))
    solved: dict[str, list[bool]] = {}
    for t in result.traces:
        solved.setdefault(t.item_id, []).append(is_correct(t))  # the task's verdict, as `masgraph run` counts
    return (sum(any(v) for v in solved.values()) / len(solved),
            sum(sum(v) for v in solved.values()) / len(result.traces))


async def _run(loop: TrainLoop, progress: Progress) -> None:
    """The training run; a rule failure (the progress sink cancelled it) is raised as RuleFailed."""
    progress.run = asyncio.current_task()
    try:
        await loop.run()
    except asyncio.CancelledError:
        if progress.failed is not None:
            raise progress.failed from None
        raise


def knob_overrides(pairs: list[str]) -> dict:
    """`--set KNOB=VALUE ...` as flow_grpo overrides; a KNOB under a section is written with its path
    (`credit.advantage=episode+step`, `ppo.kl_coef=0`), the old flat names (`advantage=...`) load too, with a
    warning naming the new one. A VALUE that parses as JSON is taken as JSON (numbers, `node_temperature={"memory":
    1.0}`), any other as a string (pydantic validates both like the YAML)."""
    out: dict = {}
    for pair in pairs:
        knob, sep, value = pair.partition("=")
        if not sep or not knob or "" in knob.split("."):
            raise SystemExit(f"error: --set takes KNOB=VALUE or SECTION.KNOB=VALUE (got {pair!r})")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        *sections, name = knob.split(".")
        where = out
        for section in sections:
            where = where.setdefault(section, {})
            if not isinstance(where, dict):
                raise SystemExit(f"error: --set {pair!r}: {section} is given a value of its own too")
        where[name] = parsed
    return out


def train(graph_path: str, task_name: str, seed: int, minutes: float, eval_n: int, check_rule: bool,
          flow_grpo: dict | None = None, steps: int | None = None, model: str | None = None,
          device: str | None = None, runs_dir: Path = ROOT / "runs", clock: str = "wall",
          edit: Callable[[GraphSpec], GraphSpec] | None = None, checkpoint_every: int = 10_000,
          resume: Path | None = None, max_staleness: int | None = None) -> dict:
    """One training run (baseline eval, `minutes` of training or `steps` steps, whichever ends first, final eval);
    returns its metrics. `flow_grpo` overrides knobs of the graph's `train.flow_grpo` (validated like the YAML);
    `clock` is what `minutes` counts (`wall`, or the process's `cpu` time); `edit` changes the loaded graph
    (a benchmark's variant of a shipped one); `max_staleness` sets `train.max_staleness`. `resume` continues that
    run directory from its latest checkpoint (`graph_path` is then its spec.yaml): `minutes` is the whole budget,
    the time its checkpoint spent included."""
    spec = place(load_spec(graph_path), model, device)
    spec = edit(spec) if edit else spec
    fg = with_overrides(spec.train.flow_grpo, flow_grpo or {})
    cfg = spec.train.model_copy(update={"flow_grpo": fg, "seed": seed, "max_minutes": minutes, "budget_clock": clock,
                                        "steps": steps or 10_000, "eval_every": 10_000, "eval_n": eval_n,
                                        "checkpoint_every": checkpoint_every,
                                        **({} if max_staleness is None else {"max_staleness": max_staleness})})
    graph = compile_spec(spec.model_copy(update={"train": cfg}), graph_path)
    run_dir = resume or runs_dir / f"bench-learns-{spec.name}-{task_name}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    progress = Progress(spec.name, seed, check_rule)
    checkpoint = resolve_checkpoint(resume) if resume is not None else None
    dtype = checkpoint_dtype(checkpoint) if checkpoint else "auto"  # a resumed run keeps its dtype
    loop = TrainLoop(graph, get_task(task_name), run_dir, dtype=dtype, sinks=[progress])
    if checkpoint is not None:
        loop.load(checkpoint)
        print(f"  [{spec.name} s{seed}] resumed {resume} at step {loop.step}, {loop.train_seconds / 60:.1f} of "
              f"{minutes:g} min spent", flush=True)
    asyncio.run(_run(loop, progress))
    del loop
    gc.collect()
    rows = read_jsonl(run_dir / "metrics.jsonl")  # a resumed run's earlier steps too
    base, last = rows[0], rows[-1]
    shown = run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir
    return {"graph": spec.name, "seed": seed, "run_dir": str(shown), "steps": last["step"],
            "train_min": last["time/train_s"] / 60, "base": base["accuracy/test"], "trained": last["accuracy/test"],
            "base_parse_fail": base["parse_failed_episodes/test"],
            "trained_parse_fail": last["parse_failed_episodes/test"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="graphs/agentflow.yaml")
    p.add_argument("--task", default=None, help="default: the graph's train.task")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--passk-n", type=int, default=32,
                   help="items for the pass@8 check; 0 skips it (when an earlier run of this script measured it)")
    p.add_argument("--compare", help="also train this graph (same task, budget, first seed)")
    p.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE",
                   help="override train.flow_grpo knobs of every trained graph, e.g. credit.parse_penalty=0.5")
    p.add_argument("--steps", type=int, default=None, help="stop each run after this many steps (and --minutes)")
    p.add_argument("--max-staleness", type=int, default=None, choices=(0, 1),
                   help="train.max_staleness of every trained graph (1: rollouts overlap the update; default: as the "
                        "graph says)")
    p.add_argument("--device", default=None,
                   help="every hf policy's device: auto, cpu, cuda, cuda:N (default: as the graph says)")
    p.add_argument("--model", default=None, help="every hf policy's model (default: as the graph says); "
                   "random:SHAPE (benchmarks/models.py) only smoke-tests this script")
    p.add_argument("--record", type=Path, default=results_file("learns"),
                   help="markdown file the results section is appended to (default benchmarks/results/learns.md)")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs",
                   help="where the run directories and bench-learns-last.json go (default runs/)")
    args = p.parse_args()
    model = resolve(args.model, args.device or "auto") if args.model else None
    where = {"steps": args.steps, "model": model, "device": args.device, "runs_dir": args.runs_dir,
             "max_staleness": args.max_staleness}
    overrides = knob_overrides(args.set)
    task = args.task or load_spec(args.graph).train.task
    print(f"rule: greedy ≤ {GREEDY_MAX:.0%} (n={args.eval_n}) and pass@{K} ≥ {PASSK_MIN:.0%} (n={args.passk_n})",
          flush=True)
    t0 = time.perf_counter()
    passk, sampled = (pass_at_k(args.graph, task, args.passk_n, K, args.seeds[0], model, args.device)
                      if args.passk_n else (None, None))
    if passk is None:
        print(f"pass@{K} not measured in this run (--passk-n 0)", flush=True)
    else:
        print(f"pass@{K} {passk:.3f} (mean sampled accuracy {sampled:.3f}, {time.perf_counter() - t0:.0f} s)",
              flush=True)
    if passk is not None and passk < PASSK_MIN:
        print(f"pass@{K} below {PASSK_MIN}: the task does not qualify; not training", flush=True)
        return 1
    results = []
    try:
        for i, seed in enumerate(args.seeds):
            results.append(train(args.graph, task, seed, args.minutes, args.eval_n, check_rule=i == 0,
                                 flow_grpo=overrides, **where))
        if args.compare:
            results.append(train(args.compare, task, args.seeds[0], args.minutes, args.eval_n, check_rule=False,
                                 flow_grpo=overrides, **where))
    except RuleFailed as e:
        print(e, flush=True)
        return 1
    lines = ["| graph | seed | steps | train min | greedy before | greedy after | gain (points) | "
             "parse-failed episodes before → after | run |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['graph']} | {r['seed']} | {r['steps']} | {r['train_min']:.1f} | {r['base']:.1%} | "
                     f"{r['trained']:.1%} | **{100 * (r['trained'] - r['base']):+.1f}** | "
                     f"{r['base_parse_fail']:.1%} → {r['trained_parse_fail']:.1%} | `{r['run_dir']}` |")
    table = "\n".join(lines)
    print(table)
    with open(args.record, "a") as f:
        f.write(f"\n### It learns: Flow-GRPO on `{task}` ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — rule (stated before training): greedy ≤ "
                f"{GREEDY_MAX:.0%} and pass@{K} ≥ {PASSK_MIN:.0%}; "
                + (f"measured pass@{K} **{passk:.1%}** (n={args.passk_n}, mean sampled accuracy {sampled:.1%})"
                   if passk is not None else f"pass@{K} not re-measured in this run (see the earlier entry)")
                + ", greedy = the untrained row below "
                f"(n={args.eval_n} held-out items). Budget {args.minutes:g} min of training wall-clock per run"
                + (f" or {args.steps} steps, whichever ends first" if args.steps else "")
                + (f"; hf policies on `{args.device}`" if args.device else "")
                + (f"; `train.max_staleness: {args.max_staleness}`" if args.max_staleness is not None else "")
                + (f"; model `{args.model}`" if args.model else "") + ".\n\n"
                f"{table}\n")
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    (args.runs_dir / "bench-learns-last.json").write_text(json.dumps({"passk": passk, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
