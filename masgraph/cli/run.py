"""`masgraph run`: run a graph on a task and report accuracy."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from masgraph.cli.common import (
    load_task,
    plural,
    print_topology,
    removed_if_left_empty,
    require_terminal_if,
    warn_sink_errors,
    with_backend,
    with_device,
)
from masgraph.cli.flags import backend_args, item_count, model_flag, non_negative_int, positive_int
from masgraph.cli.interrupt import drive_then_close
from masgraph.cli.progress import ProgressBar
from masgraph.cli.ray_setup import ray_args, ray_config, ray_engine
from masgraph.errors import MasgraphError

if TYPE_CHECKING:
    from masgraph.runtime.runner import Runner
    from masgraph.tasks import Item, Task


HELP = "run a graph on a task and report accuracy"


def add_arguments(r: argparse.ArgumentParser) -> None:
    from masgraph.runtime.runner import RunConfig

    r.add_argument("graph", help="graph YAML file (see graphs/), or a bundle written by `masgraph export`")
    r.add_argument("--task", required=True,
                   help="built-in task name, FILE.py:ClassName, or data:FILE (.jsonl / .json items, or a .yaml "
                        "task file)")
    model_flag(r, "--n", RunConfig, "n", type=item_count, help="number of items (default %(default)s)")
    model_flag(r, "--split", RunConfig, "split", choices=["train", "test"],
               help="which of the task's splits (default %(default)s)")
    model_flag(r, "--samples", RunConfig, "samples", type=positive_int, help="rollouts per item (default %(default)s)")
    model_flag(r, "--concurrency", RunConfig, "concurrency", type=positive_int,
               help="episodes in flight (default %(default)s)")
    model_flag(r, "--seed", RunConfig, "seed", type=non_negative_int,
               help="item and sampling seed (default %(default)s)")
    model_flag(r, "--deterministic", RunConfig, "deterministic", action="store_true",
               help="bit-exact: each hf row decodes alone, per-request seeds")
    model_flag(r, "--runs-dir", RunConfig, "runs_dir", help="where run directories go (default %(default)s/)")
    r.add_argument("--checkpoint", help="serve trained adapters: a training run dir (latest) or RUN/checkpoints/step-N")
    r.add_argument("--topology", choices=["greedy", "sample"],
                   help="graphs with a `topology:` section: run the most likely topology per query, or sample one "
                        "(default: greedy with a checkpoint that learned one, else sample)")
    r.add_argument("--watch", action="store_true", help="watch the run live in the TUI (see `masgraph watch`)")
    backend_args(r)
    ray_args(r)
    r.set_defaults(fn=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from masgraph.rundir.checkpoint import checkpoint_adapters, has_learned_topology, resolve_checkpoint
    from masgraph.rundir.store import new_run_dir
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.serve.agent import open_source

    require_terminal_if(args.watch)  # before the model loads
    ray = ray_config(args)
    graph, bundle = open_source(args.graph)
    graph = with_backend(with_device(graph, args.device, args.graph), args.backend, args.api_base, args.graph)
    task = load_task(args.task)
    if bundle is not None and args.checkpoint:
        raise MasgraphError(f"{args.graph} is a bundle with its own adapters; drop --checkpoint")
    checkpoint = resolve_checkpoint(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None:
        checkpoint_adapters(checkpoint, graph.spec)  # a broken or foreign one is reported before the model loads
    learned_from = bundle.path if bundle is not None and bundle.topology_file else checkpoint
    topology, mode = None, args.topology
    if graph.spec.topology is not None:
        from masgraph.topology.policy import load_policy

        topology = load_policy(graph, learned_from)
        mode = mode or ("greedy" if has_learned_topology(learned_from) else "sample")
        print_topology(topology, mode)
    elif args.topology:
        raise MasgraphError(f"--topology {args.topology}: graph {graph.spec.name!r} has no `topology:` section, so "
                            "every episode runs the whole graph; drop the flag")
    elif has_learned_topology(checkpoint):
        print(f"note: {checkpoint} holds a learned topology, but {args.graph} has no `topology:` section; running "
              "the whole graph", file=sys.stderr)
    config = RunConfig(n=args.n, split=args.split, samples=args.samples, concurrency=args.concurrency,
                       seed=args.seed, deterministic=args.deterministic, runs_dir=args.runs_dir,
                       **({"topology": mode} if mode else {}))
    items = task.items(config.split, config.n, config.seed)
    if not items:
        raise MasgraphError(f"task {task.name!r} has no {config.split} items for seed {config.seed}; "
                            "check its generate() or pick the other --split")
    if len(items) < config.n:  # a small data file: say what the run evaluates
        held = getattr(task, "split_note", None) if config.split == "test" else None
        print(f"note: task {task.name!r} has {plural(len(items), config.split + ' item')}, fewer than --n "
              f"{config.n}{f' ({held})' if held else ''}: the run has {len(items)}", file=sys.stderr)
    Path(config.runs_dir).mkdir(parents=True, exist_ok=True)  # an unwritable --runs-dir fails before the model loads
    print(f"loading {graph.spec.name} ({plural(len(graph.spec.nodes), 'node')}) ...", file=sys.stderr)
    run_dir = new_run_dir(config.runs_dir, graph.spec.name)  # now: a server a backend starts logs into it
    with removed_if_left_empty(run_dir):
        runner = Runner(graph, config, topology=topology, log_dir=run_dir, engine=ray_engine(ray, graph, config))
        if checkpoint is not None:
            print(f"serving adapters of {runner.load_checkpoint(checkpoint)}", file=sys.stderr)
        if bundle is not None:
            runner.engine.load_adapters(bundle.adapters)
            print(f"bundle {bundle.path}: adapters {sorted(bundle.adapters) or 'none'}", file=sys.stderr)
    return run_with_progress(runner, task, items, watch=args.watch, run_dir=run_dir)


def run_with_progress(runner: Runner, task: Task, items: list[Item], watch: bool = False,
                      run_dir: Path | None = None) -> int:
    """Run items with a progress bar (or the TUI, `watch`) and print the summary; Ctrl-C (exit 130) and SIGTERM
    (exit 143) cancel the run cleanly, and the summary then counts the episodes that finished."""
    from masgraph.rundir.store import new_run_dir

    if watch and run_dir is None:
        run_dir = new_run_dir(runner.config.runs_dir, runner.graph.spec.name)
    bar = None if watch else ProgressBar(len(items) * runner.config.samples)

    async def work() -> None:  # an interrupted run saves what finished (run_items)
        await runner.run_items(task, items, sinks=[bar] if bar else [], run_dir=run_dir)

    code = drive_then_close(work, runner.aclose, run_dir, watch, bar)
    result = runner.last_result
    if result is None:
        print("interrupted before the run started", file=sys.stderr)
        return code
    s = result.summary
    if code:
        print(f"interrupted: {s['episodes']} episodes finished, {s['cancelled']} cancelled", file=sys.stderr)
    print(f"graph {s['graph']}  task {s['task']}  episodes {s['episodes']}")
    if s["episodes"]:
        print(accuracy_line(s))
    print(f"run dir  {result.run_dir}")
    warn_sink_errors(s.get("sink_errors", 0))
    return code


def accuracy_line(s: dict[str, Any]) -> str:
    """A run summary's accuracy (over all episodes, and over the finished ones when some failed), mean reward,
    turns, tokens and failures by kind: a timeout or error is an infrastructure failure, not a wrong answer."""
    acc = f"accuracy {s['accuracy']:.3f} ({s['correct']}/{s['episodes']})"
    if s["finished"] != s["episodes"]:
        finished = "n/a" if s["accuracy_finished"] is None else f"{s['accuracy_finished']:.3f}"
        acc += f"  of finished {finished} ({s['correct']}/{s['finished']})"
    kinds = ", ".join(f"{kind} {n}" for kind, n in s["failures"].items() if n)
    return (f"{acc}  reward {s['reward_mean']:.3f}  turns {s['turns_mean']:.2f}  "
            f"completion tokens {s['completion_tokens_mean']:.1f}  failures {kinds or 'none'}")
