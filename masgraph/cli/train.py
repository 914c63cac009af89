"""`masgraph train`: train a graph's node policies, its topology, or both, as its `train:` section says."""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from masgraph.cli import ray_learners
from masgraph.cli.common import (
    check_splits,
    load_graph,
    load_task,
    removed_if_left_empty,
    require_terminal_if,
    warn_sink_errors,
    with_backend,
    with_device,
)
from masgraph.cli.flags import backend_args, model_flag, non_negative_int, positive_float, positive_int
from masgraph.cli.interrupt import drive_then_close
from masgraph.cli.learners import (
    agree_linear_kernel,
    agreed_dtype,
    follow,
    join,
    leading,
    learner_args,
    learner_device,
    relaunch,
    shared_run_dir,
    writes,
)
from masgraph.cli.progress import TrainProgress
from masgraph.cli.ray_setup import ray_args, ray_config
from masgraph.errors import MasgraphError, SpecError

if TYPE_CHECKING:
    from masgraph.graph import Graph
    from masgraph.registry import Registry


HELP = "train the graph's node policies (Flow-GRPO), its topology (HRPO), or both"


def add_arguments(t: argparse.ArgumentParser) -> None:
    from masgraph.runtime.runner import RunConfig

    t.add_argument("graph", help="graph YAML file (its `train:` section configures the run)")
    t.add_argument("--task", help="built-in task name, FILE.py:ClassName, or data:FILE (.jsonl / .json items, or a "
                   ".yaml task file) (default: train.task)")
    t.add_argument("--algorithm", help="flow_grpo (node adapters), hrpo (topology, nodes frozen) or joint (both); "
                   "default: train.algorithm")
    t.add_argument("--steps", type=positive_int, help="optimizer steps (default: train.steps)")
    t.add_argument("--queries-per-step", type=positive_int,
                   help="training queries per step (default: train.queries_per_step)")
    t.add_argument("--eval-n", type=positive_int, help="held-out items per evaluation (default: train.eval_n)")
    t.add_argument("--eval-every", type=non_negative_int,
                   help="held-out evaluation every N steps (and at step 0 and the end); 0 = end only")
    t.add_argument("--minutes", type=positive_float,
                   help="training wall-clock budget (default: train.max_minutes, none)")
    t.add_argument("--seed", type=non_negative_int,
                   help="seed of data order, sampling and LoRA init (default: train.seed)")
    t.add_argument("--resume", help="continue a training run directory from its latest checkpoint")
    t.add_argument("--report-to", nargs="+", choices=["tensorboard", "wandb", "mlflow", "none"], metavar="TRACKER",
                   help="experiment trackers (tensorboard, wandb, mlflow; offline, in the run dir) or none "
                        "(default: train.report_to)")
    model_flag(t, "--runs-dir", RunConfig, "runs_dir", help="where run directories go (default %(default)s/)")
    t.add_argument("--watch", action="store_true", help="watch the training live in the TUI (see `masgraph watch`)")
    model_flag(t, "--progress-every", TrainProgress, "every_s", type=positive_float, metavar="SECONDS",
               help="when stderr is not a terminal (a log, a pipe): a progress line at most this often during a "
                    "step's rollouts, update and evaluation (default %(default)g; a terminal gets one live line)")
    backend_args(t)
    ray_args(t)
    learner_args(t)
    t.set_defaults(fn=cmd_train)


def train_graph(graph: Graph, registry: Registry, args: argparse.Namespace) -> Graph:
    """The graph with its `train:` section as the command line changes it (`--algorithm`, `--steps`, ...),
    validated like the YAML; the section's shared knobs carry over to another algorithm's section."""
    spec = graph.spec
    train = spec.train
    if train is None:
        if registry.default_algorithm is None:
            raise MasgraphError("no training algorithm is registered (is masgraph's trainers package installed?)")
        train = registry.algorithm(registry.default_algorithm).config()
    overrides = {k: v for k, v in {"steps": args.steps, "task": args.task, "queries_per_step": args.queries_per_step,
                                    "eval_n": args.eval_n, "eval_every": args.eval_every, "seed": args.seed,
                                    "max_minutes": args.minutes}.items() if v is not None}
    if args.report_to is not None:
        overrides["report_to"] = [t for t in args.report_to if t != "none"]
    model, base = type(train), train.model_dump()
    if args.algorithm is not None and args.algorithm != train.algorithm:
        if args.resume:
            raise MasgraphError(f"--algorithm cannot change a resumed run's algorithm ({train.algorithm}); start a "
                                "new run instead")
        model = registry.algorithm(args.algorithm).config
        base = {k: v for k, v in base.items() if k in model.model_fields} | {"algorithm": args.algorithm}
        overrides["algorithm"] = args.algorithm
    if not overrides and spec.train is not None:
        return graph
    from pydantic import ValidationError

    from masgraph.graph import compile_spec
    from masgraph.loader import problems_from

    try:  # validated like the YAML
        train = model.model_validate({**base, **overrides})
    except ValidationError as exc:
        raise SpecError(problems_from(exc, prefix=("train",), model=model), "command-line options") from None
    return compile_spec(spec.model_copy(update={"train": train}), args.graph)


def cmd_train(args: argparse.Namespace) -> int:
    from masgraph.registry import default_registry
    from masgraph.rundir.checkpoint import checkpoint_adapters, checkpoint_dtype, resolve_checkpoint
    from masgraph.rundir.store import new_run_dir

    if (code := relaunch(args, sys.argv[1:])) is not None:  # --learners N: this same command under torchrun
        return code
    require_terminal_if(args.watch)  # before the model loads
    ray = ray_config(args)
    graph = with_device(load_graph(args.graph), args.device, args.graph)
    graph = with_backend(graph, args.backend, args.api_base, args.graph)
    spec = graph.spec
    registry = default_registry()  # the trainers register their algorithms (the core never imports them)
    graph = train_graph(graph, registry, args)
    train = graph.spec.train
    if train.task is None:
        raise MasgraphError("no task: pass --task or set `train: {task: ...}` in the graph")
    task = load_task(train.task)
    check_splits(task, train.seed)  # before the model loads
    ray_ranks = ray_learners.launch(args, sys.argv[1:], ray, learner_device(graph).type)  # --ray --learners N
    dp, graph = join(args, graph)  # under torchrun: this learner rank (rank 0 trains, the others join updates)
    if args.shard and dp is None and ray_ranks is None:
        raise MasgraphError("--shard splits the base across learner ranks: give --learners 2 or more (or run under "
                            "torchrun); one learner holds the whole base")
    run_dir = Path(args.resume) if args.resume else shared_run_dir(
        dp, lambda: new_run_dir(args.runs_dir, f"{spec.name}-train"))
    if writes(dp):
        print(f"loading {spec.name}; run dir {run_dir}", file=sys.stderr)
    checkpoint = resolve_checkpoint(run_dir) if args.resume else None
    if checkpoint is not None:
        checkpoint_adapters(checkpoint, graph.spec)  # a broken or foreign one is reported before the model loads
    dtype = agreed_dtype(dp, graph, checkpoint_dtype(checkpoint) if checkpoint else "auto")
    agree_linear_kernel(dp, graph)
    # a resumed run keeps the dtype it was trained in; metrics.jsonl is the loop's own sink
    trainer = registry.algorithm(train.algorithm).trainer()
    progress = None if args.watch or not writes(dp) else TrainProgress(train.steps, every_s=args.progress_every,
                                                     algorithm=train.algorithm)
    with nullcontext() if args.resume or not writes(dp) else removed_if_left_empty(run_dir):
        loop = trainer(graph, task, run_dir, dtype=dtype, sinks=[progress] if progress else [], ray=ray,
                       **({"shard": True} if args.shard else {}))
    learner = loop.learner
    if hasattr(learner, "device") and writes(dp):  # rank 0 speaks for the learner ranks
        from masgraph.device import describe

        print(f"learner on {describe(learner.device)}, {learner.dtype}", file=sys.stderr)
    if not writes(dp):
        return follow(loop, dp, checkpoint, run_dir)
    if checkpoint is not None:
        loop.load(checkpoint)
        print(f"resumed from {checkpoint} (step {loop.step})", file=sys.stderr)

    # an interrupted run saves its last completed step before loop.run returns; aclose stops a vLLM server it started
    with leading(dp, run_dir):
        code = drive_then_close(loop.run, loop.aclose, run_dir, args.watch, progress)
    if ray_ranks is not None and (failed := ray_ranks.wait()):
        raise MasgraphError("; ".join(failed))
    if code:
        print(f"interrupted at step {loop.step}; checkpoint in {run_dir}/checkpoints "
              f"(continue with --resume {run_dir})", file=sys.stderr)
        return code
    warn_sink_errors(loop.sink_errors)
    print(f"done: {loop.step} steps; metrics {run_dir / 'metrics.jsonl'}; checkpoints {run_dir / 'checkpoints'}")
    return 0
