"""The `masgraph` command: run, validate, schema."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from masgraph.errors import MasgraphError, SpecError
from masgraph.events import EpisodeFinished, Event
from masgraph.tasks import is_correct

if TYPE_CHECKING:
    from masgraph.graph import Graph
    from masgraph.registry import Registry
    from masgraph.runner import Runner
    from masgraph.tasks import Item, Task


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return _whole_number(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def item_count(text: str) -> int:
    """argparse type of --n: a whole number from 1 to MAX_ITEMS (a task holds all its items in memory)."""
    from masgraph.tasks import MAX_ITEMS

    return _whole_number(text, 1, MAX_ITEMS)


def _whole_number(text: str, least: int, most: int | None = None) -> int:
    wanted = f">= {least}" if most is None else f"from {least} to {most:,}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number {wanted}, got {text!r}") from None
    if value < least or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"expected a whole number {wanted}, got {text!r}")
    return value


def plural(n: int, word: str) -> str:
    """'1 edge', '0 edges', '2 edges'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


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


class ProgressBar:
    """A sink that draws one status line: episodes done, accuracy, turns, tokens, rate."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 24):
        self.total, self.stream, self.width = total, stream, width
        self.done = self.correct = self.turns = self.tokens = self.failed = 0
        self.t0 = time.perf_counter()
        self.draw()

    def emit(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished) and event.trace.status != "cancelled":  # only episodes that ran out
            tr = event.trace
            self.done += 1
            self.correct += is_correct(tr)
            self.turns += tr.turns
            self.tokens += tr.completion_tokens
            self.failed += tr.status != "ok"
            self.draw()

    def draw(self) -> None:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        n = max(self.done, 1)
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        line = (f"\r[{bar}] {self.done}/{self.total}  acc {self.correct / n:.2f}  turns {self.turns / n:.1f}  "
                f"tok {self.tokens / n:.0f}  failed {self.failed}  {rate:.2f} ep/s")
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


def _load_graph(path: str, check_models: bool = True):
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec

    return compile_spec(load_spec(path), path, check_models=check_models)


def _load_task(name: str):
    from masgraph.tasks import resolve_task

    return resolve_task(name)


def with_device(graph: Graph, device: str | None, file: str) -> Graph:
    """The graph with every local-model policy (hf; vllm, whose weights a learner trains) on `device`
    (`--device cuda:1`); checked first, so a GPU that is not there is an error line before anything loads."""
    if device is None:
        return graph
    from masgraph.device import resolve_device
    from masgraph.graph import compile_spec

    resolve_device(device)
    spec = graph.spec
    policies = {n: p.model_copy(update={"device": device}) if p.backend in ("hf", "vllm") else p
                for n, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies}), file)


def with_backend(graph: Graph, kind: str | None, api_base: str | None, file: str) -> Graph:
    """The graph with every hf policy served by backend `kind` (`--backend vllm`), attached to `api_base` if given."""
    if kind is None:
        if api_base:
            raise MasgraphError("--api-base needs --backend (e.g. --backend vllm --api-base http://host:8000/v1)")
        return graph
    from masgraph.graph import compile_spec
    from masgraph.registry import default_registry

    if kind not in default_registry().backends:
        raise MasgraphError(f"--backend {kind}: not a registered backend; use one of "
                            f"{sorted(default_registry().backends)}")
    spec = graph.spec
    policies = {n: p.model_copy(update={"backend": kind, "api_base": api_base}) if p.backend == "hf" else p
                for n, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": policies}), file)


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.files:
        try:
            g = _load_graph(path, check_models=not args.no_model_check)
            print(f"ok  {path}  ({plural(len(g.spec.nodes), 'node')}, {plural(len(g.spec.edges), 'edge')})")
        except SpecError as exc:
            bad += 1
            print(str(exc), file=sys.stderr)
    return 1 if bad else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from masgraph.registry import default_registry
    from masgraph.spec import graph_json_schema

    if args.task_file:
        from masgraph.datatask import DataTaskSpec

        print(json.dumps(DataTaskSpec.model_json_schema(), indent=2))
        return 0
    reg = default_registry()
    print(json.dumps(graph_json_schema([a.config for a in reg.algorithms.values()], list(reg.backends)), indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from masgraph.agent import open_source
    from masgraph.checkpoint import checkpoint_adapters, has_learned_topology, resolve_checkpoint
    from masgraph.runner import RunConfig, Runner
    from masgraph.store import new_run_dir

    if args.watch:
        from masgraph.watch import require_terminal

        require_terminal()  # before the model loads
    ray = _ray_config(args)
    graph, bundle = open_source(args.graph)
    graph = with_backend(with_device(graph, args.device, args.graph), args.backend, args.api_base, args.graph)
    task = _load_task(args.task)
    if bundle is not None and args.checkpoint:
        raise MasgraphError(f"{args.graph} is a bundle with its own adapters; drop --checkpoint")
    checkpoint = resolve_checkpoint(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None:
        checkpoint_adapters(checkpoint)  # a broken checkpoint is reported before the model loads
    learned_from = bundle.path if bundle is not None and bundle.topology_file else checkpoint
    topology, mode = None, args.topology
    if graph.spec.topology is not None:
        from masgraph.topology.policy import load_policy

        topology = load_policy(graph, learned_from)
        mode = mode or ("greedy" if has_learned_topology(learned_from) else "sample")
        _print_topology(topology, mode)
    elif args.topology:
        raise MasgraphError(f"--topology {args.topology}: graph {graph.spec.name!r} has no `topology:` section, so "
                            "every episode runs the whole graph; drop the flag")
    elif has_learned_topology(checkpoint):
        print(f"note: {checkpoint} holds a learned topology, but {args.graph} has no `topology:` section; running "
              "the whole graph", file=sys.stderr)
    config = RunConfig(n=args.n, split=args.split, samples=args.samples, concurrency=args.concurrency,
                       seed=args.seed, deterministic=args.deterministic, runs_dir=args.runs_dir,
                       topology=mode or "sample")
    items = task.items(config.split, config.n, config.seed)
    if not items:
        raise MasgraphError(f"task {task.name!r} has no {config.split} items for seed {config.seed}; "
                            "check its generate() or pick the other --split")
    Path(config.runs_dir).mkdir(parents=True, exist_ok=True)  # an unwritable --runs-dir fails before the model loads
    print(f"loading {graph.spec.name} ({plural(len(graph.spec.nodes), 'node')}) ...", file=sys.stderr)
    run_dir = new_run_dir(config.runs_dir, graph.spec.name)  # now: a server a backend starts logs into it
    with _removed_if_left_empty(run_dir):
        runner = Runner(graph, config, topology=topology, log_dir=run_dir, engine=_ray_engine(ray, graph, config))
        if checkpoint is not None:
            print(f"serving adapters of {runner.load_checkpoint(checkpoint)}", file=sys.stderr)
        if bundle is not None:
            runner.engine.load_adapters(bundle.adapters)
            print(f"bundle {bundle.path}: adapters {sorted(bundle.adapters) or 'none'}", file=sys.stderr)
    return run_with_progress(runner, task, items, watch=args.watch, run_dir=run_dir)


@contextmanager
def _removed_if_left_empty(run_dir: Path) -> Iterator[None]:
    """Set-up of a run in a run dir just made: if it fails with nothing written there, the dir goes too (a failed
    start leaves no empty run dirs behind; one holding a server's log, which the error names, stays)."""
    try:
        yield
    except BaseException:
        try:
            run_dir.rmdir()  # only ever removes an empty directory
        except OSError:
            pass
        raise


def run_with_progress(runner: Runner, task: Task, items: list[Item], watch: bool = False,
                      run_dir: Path | None = None) -> int:
    """Run items with a progress bar (or the TUI, `watch`) and print the summary; Ctrl-C (exit 130) and SIGTERM
    (exit 143) cancel the run cleanly, and the summary then counts the episodes that finished."""
    from masgraph.store import new_run_dir

    if watch and run_dir is None:
        run_dir = new_run_dir(runner.config.runs_dir, runner.graph.spec.name)
    bar = None if watch else ProgressBar(len(items) * runner.config.samples)
    closed = True

    async def run() -> None:
        nonlocal closed
        try:
            await runner.run_items(task, items, sinks=[bar] if bar else [], run_dir=run_dir)
        except asyncio.CancelledError:  # Ctrl-C or SIGTERM: what finished is saved (run_items); do not wait long
            closed = await _closed_within(runner.aclose(), CLOSE_GRACE_S)  # for a model batch still computing
            raise
        except BaseException:
            await runner.aclose()
            raise
        await runner.aclose()

    code = _drive(run, run_dir, watch, bar)
    if not closed:
        print(NOT_CLOSED, file=sys.stderr)
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
    _warn_sink_errors(s.get("sink_errors", 0))
    return code


def _warn_sink_errors(n: int) -> None:
    if n:
        print(f"warning: {n} events could not be written by a sink (run store, metrics.jsonl or progress); "
              "check the disk: the run's files may be incomplete", file=sys.stderr)


CLOSE_GRACE_S = 2.0
"""After Ctrl-C or SIGTERM: how long a run waits for its backends to close (a model batch computing on its thread
stops at its next decode step, but a long prefill on a busy machine took 12-36 s) before it exits without them."""


async def _closed_within(close: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Awaits `close` for up to `seconds`: whether it finished (if not, it is left, and cancelled with the event
    loop's other tasks)."""
    task = asyncio.ensure_future(close)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if task in done:
        task.result()
    return task in done


class _Executor(ThreadPoolExecutor):
    """The event loop's default executor (asyncio.to_thread: tool calls, plain-def agents): once the run is
    interrupted, the loop's shutdown no longer waits for its threads (a sandboxed tool may run to its time limit)."""

    abandon = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=wait and not self.abandon, cancel_futures=cancel_futures or self.abandon)


_interrupted = False
"""Set when `_run_cancellable`'s run was stopped by Ctrl-C or SIGTERM: `main` then exits at once (`_exit_now`)."""


NOT_CLOSED = (f"note: not waiting for the backends to close (still busy after {CLOSE_GRACE_S:g} s: a model batch "
              "computing on its thread)")


def _drive(main: Callable[[], Coroutine[Any, Any, None]], run_dir: Path, watch: bool, display: Any) -> int:
    """`main` under the TUI when watching, else with Ctrl-C / SIGTERM handled (`_run_cancellable`); the progress
    display (None when watching) is closed afterwards. Shared by run and train."""
    try:
        if watch:
            from masgraph.watch import watch_while

            return watch_while(run_dir, main)
        return _run_cancellable(main)
    finally:
        if display is not None:
            display.close()


def _run_cancellable(main: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """asyncio.run(main()); Ctrl-C or SIGTERM cancels it (its `finally` blocks run). Returns 0, 130 or 143."""
    global _interrupted
    terminated = False
    executor = _Executor(thread_name_prefix="masgraph-io")

    async def guarded() -> None:
        loop, this = asyncio.get_running_loop(), asyncio.current_task()
        loop.set_default_executor(executor)

        def on_sigterm() -> None:
            nonlocal terminated
            terminated = executor.abandon = True
            this.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            await main()
        except asyncio.CancelledError:
            executor.abandon = True  # Ctrl-C (asyncio.run cancels this task) or SIGTERM
            raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        asyncio.run(guarded())
    except KeyboardInterrupt:
        _interrupted = True
        return 130
    except asyncio.CancelledError:
        if not terminated:
            raise
        _interrupted = True
        return 143
    return 0


def _exit_now(code: int) -> NoReturn:
    """Ends the process after an interrupted run, whose results are saved by now: runs the atexit hooks (a vLLM
    server's stop, log flushing) and exits without joining worker threads still computing (a model batch, a tool
    call: Python's exit would wait for each) or the interpreter's teardown (seconds on a busy machine)."""
    import atexit

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    atexit._run_exitfuncs()
    os._exit(code)


class TrainProgress:
    """Training progress on stderr (a sink of the loop's events): one line per training step, and, inside a step,
    what it does: rollouts and evaluations (episodes done of the total, tokens/s) and the update (time so far).

    On a terminal the in-step status is one line redrawn in place (once a second and as episodes finish). Otherwise
    (a log file, a pipe) there are no carriage returns: a status line is printed when `every_s` seconds have passed
    since the last line, so a log gets one line per `every_s` during a long phase and none for a quick one."""

    def __init__(self, steps: int, out: TextIO | None = None, every_s: float = 30.0, tty: bool | None = None):
        import threading

        self.steps, self._out, self.every_s, self._tty = steps, out, every_s, tty
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._phase: tuple[str, int, int, float] | None = None  # name, step, total, start
        self.done = self.tokens = 0
        self._shown = False  # a terminal shows a status line the next print must clear
        self._last = time.perf_counter()  # when a line was last printed

    @property
    def out(self) -> TextIO:
        return self._out or sys.stderr

    @property
    def tty(self) -> bool:
        if self._tty is None:
            try:
                self._tty = self.out.isatty()
            except (AttributeError, ValueError):
                self._tty = False
        return self._tty

    def phase(self, name: str, step: int, total: int) -> None:
        """A phase of `step` starts (called by the training loop): 'rollouts', 'resampling', 'evaluation' (of
        `total` episodes) or 'update' (of `total` episodes)."""
        with self._lock:
            self._phase, self.done, self.tokens = (name, step, total, time.perf_counter()), 0, 0
            if self.tty:
                self._draw()
        if self._ticker is None:  # the update blocks the event loop: a thread keeps the status going
            import threading

            self._ticker = threading.Thread(target=self._tick, name="masgraph-train-progress", daemon=True)
            self._ticker.start()

    def emit(self, event: Event) -> None:
        from masgraph.events import LLMCallFinished, TrainStep

        if isinstance(event, LLMCallFinished):
            with self._lock:
                self.tokens += event.completion_tokens
            return
        if isinstance(event, EpisodeFinished):
            with self._lock:
                self.done += 1
                if self.tty:
                    self._draw()
            return
        if not isinstance(event, TrainStep):
            return
        with self._lock:
            self._phase = None
            self._print(self._step_line(event))

    def close(self) -> None:
        """Stops the status line (clearing it on a terminal)."""
        self._stop.set()
        with self._lock:
            self._phase = None
            self._clear()
        if self._ticker is not None:
            self._ticker.join(timeout=2)

    def status(self) -> str:
        """The in-step status line ('' between phases)."""
        if self._phase is None:
            return ""
        name, step, total, t0 = self._phase
        elapsed = time.perf_counter() - t0
        clock = f"{int(elapsed // 60)}:{int(elapsed % 60):02d}"
        if name == "update":
            return f"step {step}/{self.steps}  update on {total} episodes  {clock}"
        return (f"step {step}/{self.steps}  {name} {self.done}/{total} episodes  "
                f"{self.tokens / max(elapsed, 1e-9):.1f} tok/s  {clock}")

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            with self._lock:
                if self._phase is None:
                    continue
                if self.tty:
                    self._draw()
                elif time.perf_counter() - self._last >= self.every_s:
                    self._print(self.status())

    def _draw(self) -> None:  # a terminal: the status line, redrawn in place
        self.out.write(f"\r{self.status()}\x1b[K")
        self.out.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._shown = False

    def _print(self, line: str) -> None:
        self._clear()
        print(line, file=self.out, flush=True)
        self._last = time.perf_counter()

    def _step_line(self, event: Any) -> str:
        m = event.metrics
        test = f"  acc(test) {m['accuracy/test']:.3f}" if "accuracy/test" in m else ""
        if event.step == 0:
            return f"step 0/{self.steps}  (untrained){test}"
        nodes = (f"kl {m.get('kl', 0):.4f}  loss {m.get('loss/total', 0):+.4f}  rows {m.get('rows', 0):.0f}  "
                 if "loss/total" in m or "topology/loss" not in m else "")
        return (f"step {event.step}/{self.steps}  reward {m.get('reward/mean', m.get('topology/reward', 0)):.3f}  "
                f"acc(train) {m.get('accuracy/train', 0):.3f}{test}  {nodes}{_topology_summary(m)}"
                f"{m['tokens_per_s']:.1f} tok/s  {m['time/train_s'] / 60:.1f} min")


def _topology_summary(m: dict) -> str:
    """`topology <decision>=<most likely option> <p> ...` from a step's topology metrics ('' without them)."""
    best: dict[str, tuple[float, str]] = {}
    for key, p in m.items():
        if key.startswith("topology/p/") and key.count("/") >= 3:
            _, _, decision, option = key.split("/", 3)
            best[decision] = max(best.get(decision, (-1.0, "")), (p, option))
    if not best:
        return ""
    return "topology " + " ".join(f"{d.split(':', 1)[-1]}={o} {p:.2f}" for d, (p, o) in best.items()) + "  "


def train_graph(graph: Graph, registry: Registry, args: argparse.Namespace) -> Graph:
    """The graph with its `train:` section as the command line changes it (`--algorithm`, `--steps`, ...),
    validated like the YAML; the section's shared knobs carry over to another algorithm's section."""
    spec = graph.spec
    train = spec.train or registry.algorithm(registry.default_algorithm or "flow_grpo").config()
    overrides = {k: v for k, v in {"steps": args.steps, "task": args.task, "queries_per_step": args.queries_per_step,
                                    "eval_n": args.eval_n, "eval_every": args.eval_every, "seed": args.seed,
                                    "max_minutes": args.minutes}.items() if v is not None}
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
    from masgraph.checkpoint import checkpoint_adapters, checkpoint_dtype, resolve_checkpoint
    from masgraph.registry import default_registry
    from masgraph.store import new_run_dir

    if args.watch:
        from masgraph.watch import require_terminal

        require_terminal()  # before the model loads
    ray = _ray_config(args)
    graph = with_device(_load_graph(args.graph), args.device, args.graph)
    graph = with_backend(graph, args.backend, args.api_base, args.graph)
    spec = graph.spec
    registry = default_registry()  # the trainers register their algorithms (the core never imports them)
    graph = train_graph(graph, registry, args)
    train = graph.spec.train
    if train.task is None:
        raise MasgraphError("no task: pass --task or set `train: {task: ...}` in the graph")
    task = _load_task(train.task)
    run_dir = Path(args.resume) if args.resume else new_run_dir(args.runs_dir, f"{spec.name}-train")
    print(f"loading {spec.name}; run dir {run_dir}", file=sys.stderr)
    checkpoint = resolve_checkpoint(run_dir) if args.resume else None
    if checkpoint is not None:
        checkpoint_adapters(checkpoint)  # a broken checkpoint is reported before the model loads
    dtype = checkpoint_dtype(checkpoint) if checkpoint else "auto"
    # a resumed run keeps the dtype it was trained in; metrics.jsonl is the loop's own sink
    trainer = registry.algorithm(train.algorithm).trainer()
    progress = None if args.watch else TrainProgress(train.steps, every_s=args.progress_every)
    with nullcontext() if args.resume else _removed_if_left_empty(run_dir):
        loop = trainer(graph, task, run_dir, dtype=dtype, sinks=[progress] if progress else [], ray=ray)
    learner = loop.learner
    if hasattr(learner, "device"):
        from masgraph.device import describe

        print(f"learner on {describe(learner.device)}, {learner.dtype}", file=sys.stderr)
    if checkpoint is not None:
        loop.load(checkpoint)
        print(f"resumed from {checkpoint} (step {loop.step})", file=sys.stderr)

    closed = True

    async def run_training() -> None:
        nonlocal closed
        try:
            await loop.run()  # an interrupted run saves its last completed step before this returns
        except asyncio.CancelledError:  # Ctrl-C or SIGTERM: do not wait long for a model batch still computing
            closed = await _closed_within(loop.aclose(), CLOSE_GRACE_S)
            raise
        except BaseException:
            await loop.aclose()
            raise
        await loop.aclose()  # a vLLM server it started

    code = _drive(run_training, run_dir, args.watch, progress)
    if not closed:
        print(NOT_CLOSED, file=sys.stderr)
    if code:
        print(f"interrupted at step {loop.step}; checkpoint in {run_dir}/checkpoints "
              f"(continue with --resume {run_dir})", file=sys.stderr)
        return code
    _warn_sink_errors(loop.sink_errors)
    print(f"done: {loop.step} steps; metrics {run_dir / 'metrics.jsonl'}; checkpoints {run_dir / 'checkpoints'}")
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    from masgraph.checkpoint import has_learned_topology, resolve_checkpoint
    from masgraph.topology.policy import load_policy
    from masgraph.topology.report import describe, draw

    run = Path(args.run)
    checkpoint = resolve_checkpoint(run)
    if not has_learned_topology(checkpoint):
        raise MasgraphError(f"{checkpoint} holds no topology policy; train with `algorithm: hrpo` or `joint` "
                            "on a graph with a `topology:` section")
    graph = _load_graph(str(run / "spec.yaml")) if (run / "spec.yaml").is_file() else None
    if graph is None:
        raise MasgraphError(f"{run} has no spec.yaml; pass the training run directory (RUN, not a checkpoint)")
    policy = load_policy(graph, checkpoint)
    if policy is None:
        raise MasgraphError(f"{run}/spec.yaml has no `topology:` section, so {checkpoint} cannot hold its topology "
                            "policy; pass the run directory the topology was trained in")
    queries = []
    if policy.conditioned:
        task = _run_task(run)
        queries = [it.question for it in task.items("test", args.queries, 0)] if task else []
    print(describe(policy, queries))
    print(f"wrote {draw(policy, args.out or run / 'topology.png', queries)}")
    return 0


def _print_topology(policy: Any, mode: str) -> None:
    """Which topology a run or a server follows, and how (stderr)."""
    print(f"topology: {'learned v' + str(policy.version) if policy.version else 'untrained prior'}, {mode}",
          file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    from masgraph.agent import Agent, open_source
    from masgraph.server import ServeConfig, check_bind, serve
    from masgraph.store import new_run_dir

    api_key = args.api_key or os.environ.get("MASGRAPH_API_KEY") or None
    check_bind(args.host, api_key, args.allow_public_without_key)
    check_port(args.host, args.port)  # a port in use: an error line now, not after the model has loaded
    conversations = None
    if args.conversations:  # an unusable directory fails now, not after the model has loaded
        from masgraph.memory.conversations import ConversationStores

        conversations = ConversationStores(args.conversations)
    graph, bundle = open_source(args.graph)
    graph = with_device(graph, args.device, args.graph)
    if args.topology and graph.spec.topology is None:
        raise MasgraphError(f"--topology {args.topology}: graph {graph.spec.name!r} has no `topology:` section; "
                            "drop the flag")
    store = None
    if not args.no_store:
        Path(args.runs_dir).mkdir(parents=True, exist_ok=True)  # unwritable: fails before the model loads
        store = new_run_dir(args.runs_dir, f"{graph.spec.name}-serve")
    config = ServeConfig(api_key=api_key, max_body_bytes=args.max_body_kb * 1024, max_concurrency=args.max_concurrency,
                         max_queue=args.max_queue, max_wait_s=args.max_wait, timeout_s=args.timeout, store=store,
                         max_connections=args.max_connections)
    print(f"loading {graph.spec.name} ({plural(len(graph.spec.nodes), 'node')}) ...", file=sys.stderr)
    with nullcontext() if store is None else _removed_if_left_empty(store):
        agent = Agent(graph, args.checkpoint, args.topology, args.deterministic, bundle=bundle)
    if conversations is not None:
        agent.engine.conversations = conversations
        print(f"conversation memories go to {args.conversations}", file=sys.stderr)
    if agent.topology is not None:
        _print_topology(agent.topology, agent.mode)
    if store is not None:
        print(f"traces go to {store} (--no-store to keep none)", file=sys.stderr)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving model {graph.spec.name!r} at http://{host}:{args.port}/v1 (OpenAI-compatible chat completions"
          f"{'; bearer key required' if api_key else ''}); Ctrl-C stops", file=sys.stderr)
    try:
        serve(agent, graph.spec.name, args.host, args.port, config, log_level=args.log_level)
    except SystemExit as exc:  # uvicorn could not start (logged above): the port was taken while the model loaded
        if exc.code != STARTUP_FAILURE:
            raise
        if store is not None:
            _remove_unused_store(store)
        raise MasgraphError(f"the server could not start at http://{host}:{args.port} (uvicorn's message above; "
                            f"{_port_fix(args.port)})") from None
    return 0


STARTUP_FAILURE = 3
"""uvicorn's exit status when its server could not start (e.g. the port is in use)."""


def check_port(host: str, port: int) -> None:
    """A MasgraphError unless `host`:`port` can be bound now, as uvicorn binds it (asyncio's create_server: every
    address the host resolves to, SO_REUSEADDR), so a port in use is one error line before the model loads.

    The check closes its sockets: a process that takes the port while the model loads is still possible (then the
    server's start fails and `cmd_serve` reports it). Handing the bound socket to uvicorn would close that window,
    but masgraph.server.serve takes no socket (it would need a `sock` argument passed on as
    uvicorn.Server(uvicorn.Config(app, ...)).run(sockets=[sock]))."""
    import errno
    import socket

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MasgraphError(f"--host {host}: not an address of this machine ({exc.strerror}); use e.g. 127.0.0.1 "
                            "(this machine only) or 0.0.0.0 (every interface)") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server does
            try:
                sock.bind(address)
            except OSError as exc:
                why = {errno.EADDRINUSE: "another process is listening there",
                       errno.EACCES: "a port below 1024 needs root",
                       errno.EADDRNOTAVAIL: "--host is not an address of this machine"}.get(exc.errno, "")
                raise MasgraphError(f"cannot serve at {host}:{port}: {exc.strerror or exc}"
                                    f"{f' ({why})' if why else ''}; {_port_fix(port)}") from None


def _port_fix(port: int) -> str:
    return f"pick another --port, or stop what uses port {port} (`ss -ltnp 'sport = :{port}'` shows it)"


def _remove_unused_store(store: Path) -> None:
    """Removes the trace dir of a server that never started: only what RunStore writes, and no episode in it."""
    from masgraph.store import INDEX

    files = {"spec.yaml", "config.json", "summary.json", "events.jsonl", INDEX}
    try:
        entries = list(store.iterdir())
        if all(p.name in files and p.is_file() for p in entries) and not any(
                p.stat().st_size for p in entries if p.name in ("events.jsonl", INDEX)):
            for p in entries:
                p.unlink()
            store.rmdir()
    except OSError:
        pass


def cmd_export(args: argparse.Namespace) -> int:
    from masgraph.bundle import export_bundle, load_bundle

    out = export_bundle(args.source, args.out, archive=args.archive)
    bundle = load_bundle(out)  # what was written loads (and the manifest matches)
    m = bundle.manifest
    ev = m.get("evaluation")
    print(f"exported {m['name']} to {out}")
    print(f"  adapters {sorted(m['adapters']) or 'none'}; topology "
          f"{'learned v' + str(m['topology']['version']) if m['topology'] else 'none'}; "
          f"base {', '.join(m['models']) or 'none'}")
    if ev:
        print(f"  held-out accuracy at step {ev['step']}: {ev['accuracy']:.3f} on {ev['n']} {ev['task']} items")
    print(f"serve it: masgraph serve {out}")
    return 0


def _run_task(run: Path) -> Task | None:
    """The task a training run trained on (from its config.json), if it can be loaded."""

    try:
        name = json.loads((run / "config.json").read_text())["config"].get("task")
        return _load_task(name) if name else None
    except (OSError, ValueError, KeyError, AttributeError, MasgraphError):
        return None


def cmd_watch(args: argparse.Namespace) -> int:
    from masgraph.watch import watch

    return watch(args.run, poll_s=args.poll)


def cmd_plot(args: argparse.Namespace) -> int:
    from masgraph.plot import plot_run, plot_topology

    if not (Path(args.run) / "metrics.jsonl").exists():
        raise MasgraphError(f"{args.run} has no metrics.jsonl (is it a `masgraph train` run directory?)")
    print(plot_run(args.run, args.out))
    topology = plot_topology(args.run)  # topology-training runs: decision probabilities per step
    if topology is not None:
        print(topology)
    return 0


def _ray_config(args: argparse.Namespace) -> Any:
    """`--ray [--workers N] [--address A]` as a RayConfig (None without --ray)."""
    if not args.ray:
        if args.workers is not None or args.address is not None or args.gpus_per_worker is not None:
            raise MasgraphError("--workers, --address and --gpus-per-worker need --ray")
        return None
    from masgraph.ray_rollouts import RayConfig, check_address, cluster_address, require_ray

    require_ray()  # before anything loads
    address, source = cluster_address(args.address)
    check_address(address, source)  # an address nothing answers at: seconds, not minutes of Ray's retries
    gpus = args.gpus_per_worker or 0.0
    if gpus > 1 and not float(gpus).is_integer():
        raise MasgraphError(f"--gpus-per-worker {gpus:g}: Ray shares a GPU between workers (at most 1) or gives each "
                            "whole GPUs; use e.g. 0.5, 1 or 2")
    config = RayConfig(workers=args.workers or 2, address=address, gpus_per_worker=gpus)
    where = f" on the cluster at {address} ({source})" if address else " on a local Ray started for this run"
    print(f"starting {config.workers} Ray rollout workers{where} ...", file=sys.stderr)
    return config


def _ray_engine(ray: Any, graph: Graph, config: Any) -> Any:
    """The Ray rollout engine for `masgraph run --ray` (None without it)."""
    if ray is None:
        return None
    from masgraph.engine import BackendOptions
    from masgraph.ray_rollouts import RayEngine

    return RayEngine(graph, ray, BackendOptions(config.deterministic, config.max_batch_size, config.batch_wait_ms,
                                                config.seed))


def _ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true", help="run episodes on Ray rollout workers (each its own model "
                   "replica; the learner stays here)")
    p.add_argument("--workers", type=positive_int, help="with --ray: rollout workers (default 2)")
    p.add_argument("--address", help="with --ray: a running Ray cluster (`ray start --head` prints it; `auto` finds "
                   "the one on this machine; `local`: a Ray started for this run); default: $RAY_ADDRESS if set, "
                   "else local")
    p.add_argument("--gpus-per-worker", type=positive_float, help="with --ray: GPUs each rollout worker reserves "
                   "(e.g. 1, or 0.5 for two per GPU; default 0: Ray hides the GPUs from a worker that reserves none)")


def _backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", help="serve every hf policy with this backend instead, e.g. vllm (a vLLM server: "
                   "started here unless --api-base; `make vllm` installs it)")
    p.add_argument("--api-base", help="with --backend vllm: attach to this running server (http://host:port/v1)")
    _device_arg(p)


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="where every hf policy's model runs: auto (the GPU when one is visible; the "
                   "default), cpu, cuda, cuda:N (overrides the policies' `device:`)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="masgraph", description="Multi-agent LLM graphs: run, validate, train.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a graph on a task and report accuracy")
    r.add_argument("graph", help="graph YAML file (see graphs/), or a bundle written by `masgraph export`")
    r.add_argument("--task", required=True, help="built-in task name, or FILE.py:ClassName")
    r.add_argument("--n", type=item_count, default=16, help="number of items (default 16)")
    r.add_argument("--split", default="test", choices=["train", "test"],
                   help="which of the task's splits (default test)")
    r.add_argument("--samples", type=positive_int, default=1, help="rollouts per item (default 1)")
    r.add_argument("--concurrency", type=positive_int, default=16, help="episodes in flight (default 16)")
    r.add_argument("--seed", type=non_negative_int, default=0, help="item and sampling seed (default 0)")
    r.add_argument("--deterministic", action="store_true",
                   help="bit-exact: each hf row decodes alone, per-request seeds")
    r.add_argument("--runs-dir", default="runs", help="where run directories go (default runs/)")
    r.add_argument("--checkpoint", help="serve trained adapters: a training run dir (latest) or RUN/checkpoints/step-N")
    r.add_argument("--topology", choices=["greedy", "sample"],
                   help="graphs with a `topology:` section: run the most likely topology per query, or sample one "
                        "(default: greedy with a checkpoint that learned one, else sample)")
    r.add_argument("--watch", action="store_true", help="watch the run live in the TUI (see `masgraph watch`)")
    _backend_args(r)
    _ray_args(r)
    r.set_defaults(fn=cmd_run)

    t = sub.add_parser("train", help="train the graph's node policies (Flow-GRPO), its topology (HRPO), or both")
    t.add_argument("graph", help="graph YAML file (its `train:` section configures the run)")
    t.add_argument("--task", help="task (default: train.task)")
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
    t.add_argument("--runs-dir", default="runs")
    t.add_argument("--watch", action="store_true", help="watch the training live in the TUI (see `masgraph watch`)")
    t.add_argument("--progress-every", type=positive_float, default=30.0, metavar="SECONDS",
                   help="when stderr is not a terminal (a log, a pipe): a progress line at most this often during a "
                        "step's rollouts, update and evaluation (default 30; a terminal gets one live line)")
    _backend_args(t)
    _ray_args(t)
    t.set_defaults(fn=cmd_train)

    w = sub.add_parser("watch", help="TUI over a run or training directory, live or finished: graph, episodes, "
                                     "training curves (keys: ? in the app)")
    w.add_argument("run", help="a run directory (runs/<graph>-<date>-<time>)")
    w.add_argument("--poll", type=positive_float, default=0.25, help="seconds between reads of the run (default 0.25)")
    w.set_defaults(fn=cmd_watch)

    pl = sub.add_parser("plot", help="PNG of reward and held-out accuracy per step of a training run")
    pl.add_argument("run", help="training run directory")
    pl.add_argument("--out", help="output PNG (default RUN/learning_curve.png)")
    pl.set_defaults(fn=cmd_plot)

    tp = sub.add_parser("topology", help="print a training run's learned topology distribution and draw it (PNG)")
    tp.add_argument("run", help="training run directory (algorithm hrpo or joint)")
    tp.add_argument("--queries", type=positive_int, default=4,
                    help="query-conditioned policies: held-out queries of the run's task to show (default 4)")
    tp.add_argument("--out", help="output PNG (default RUN/topology.png)")
    tp.set_defaults(fn=cmd_topology)

    ex = sub.add_parser("export", help="write a trained graph as a self-contained, deployable bundle")
    ex.add_argument("source", help="a training run dir (its latest checkpoint), RUN/checkpoints/step-N, or a graph "
                                   "YAML file")
    ex.add_argument("--out", required=True, help="bundle directory to create (must not exist or be empty)")
    ex.add_argument("--archive", action="store_true", help="write OUT.tar.gz instead of a directory")
    ex.set_defaults(fn=cmd_export)

    sv = sub.add_parser("serve", help="serve a graph behind an OpenAI-compatible endpoint (/v1/chat/completions)")
    sv.add_argument("graph", help="a bundle (`masgraph export`: a directory or .tar.gz) or a graph YAML file")
    sv.add_argument("--checkpoint", help="serve trained adapters (and topology): a training run dir or "
                                         "RUN/checkpoints/step-N")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000)")
    sv.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $MASGRAPH_API_KEY, else none)")
    sv.add_argument("--allow-public-without-key", action="store_true",
                    help="serve a non-loopback --host without an API key (refused otherwise)")
    sv.add_argument("--topology", choices=["greedy", "sample"], help="how the topology policy picks each question's "
                    "sub-graph (default: greedy when learned, sample for the untrained prior)")
    sv.add_argument("--deterministic", action="store_true", help="bit-exact answers whatever the load (slower)")
    _device_arg(sv)
    sv.add_argument("--max-concurrency", type=positive_int, default=32,
                    help="episodes running at once (default 32: one engine batch of every node's calls)")
    sv.add_argument("--max-queue", type=non_negative_int, default=256,
                    help="requests waiting for a slot beyond those; more get 429 with Retry-After at once "
                         "(default 256)")
    sv.add_argument("--max-wait", type=positive_float, help="longest a request waits in the queue, in s (503 with "
                    "Retry-After; default: --timeout)")
    sv.add_argument("--timeout", type=positive_float, default=300.0,
                    help="limit of one episode in s, from when it starts (504; default 300)")
    sv.add_argument("--max-connections", type=positive_int, help="open connections at once (503 beyond; default: "
                    "--max-concurrency + --max-queue + 64)")
    sv.add_argument("--max-body-kb", type=positive_int, default=1024, help="largest request body (413; default 1024)")
    sv.add_argument("--no-store", action="store_true", help="keep no traces (default: a run dir under --runs-dir)")
    sv.add_argument("--conversations", metavar="DIR", help="keep the fact stores of `scope: conversation` memory "
                    "nodes in DIR (one file per conversation; a restart continues them; default: in memory only)")
    sv.add_argument("--runs-dir", default="runs")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="server log level (info logs every request)")
    sv.set_defaults(fn=cmd_serve)

    v = sub.add_parser("validate", help="check graph YAML files")
    v.add_argument("files", nargs="+")
    v.add_argument("--no-model-check", action="store_true", help="do not check that models are installed")
    v.set_defaults(fn=cmd_validate)

    s = sub.add_parser("schema", help="print the JSON Schema of graph files (for editors)")
    s.add_argument("--task-file", action="store_true",
                   help="the schema of a data task file (`--task data:FILE.yaml`) instead")
    s.set_defaults(fn=cmd_schema)
    return p


def _warnings_as_lines() -> None:
    """masgraph's own warnings (a task whose test items were left out, ...) print as one `warning:` line on stderr,
    not Python's 'file:line: Category: ...' with the source line; other warnings are shown as Python shows them."""
    import warnings

    from masgraph.tasks import TaskSplitWarning

    shown = warnings.showwarning
    if getattr(shown, "masgraph", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (warnings' signature)
        if issubclass(category, TaskSplitWarning):
            print(f"warning: {message}", file=file or sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show.masgraph = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    """The `masgraph` command. User errors print one `error:` message (exit 2) and Ctrl-C exits 130, never with a
    traceback; a traceback means a bug in masgraph."""
    args = build_parser().parse_args(argv)
    _warnings_as_lines()
    try:
        code = args.fn(args)
        if _interrupted and argv is None:  # the `masgraph` command (not a call from Python): exit now
            _exit_now(code)
        return code
    except MasgraphError as exc:  # user errors: a located message, no traceback
        print(f"error: {exc}", file=sys.stderr)
    except BrokenPipeError:  # the reader went away (`masgraph ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except OSError as exc:
        if exc.filename is None:  # not about a path the user gave
            raise
        print(f"error: {exc.strerror or exc}: {exc.filename}", file=sys.stderr)
    except KeyboardInterrupt:  # before or after a run (during one, the run handles it and reports)
        print("interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
