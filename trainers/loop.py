"""The training loop around an algorithm: rollouts through the same Runner/Scheduler as `masgraph run`,
updates on a learner, weight sync to the rollout backends, held-out evaluation, atomic checkpoints, exact
resume; train-step, evaluation and checkpoint events to sinks (metrics.jsonl is one)."""

from __future__ import annotations

import asyncio
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from masgraph.backends.base import SyncedBackend
from masgraph.device import deterministic_kernels, resolve_device
from masgraph.errors import MasgraphError, Problem, SpecError
from masgraph.events import CheckpointSaved, Credited, Emitter, EvalFinished, Sink, TrainStep
from masgraph.graph import Graph, compile_spec
from masgraph.learn import data_parallel
from masgraph.learn.counterfactual import META
from masgraph.learn.learner import Learner, LoraConfigSpec, SavedAdapter, WeightSync
from masgraph.learn.serving import local_learner, rollout_kind, serve_learner
from masgraph.metric_keys import EPISODES_TEST, topology_p
from masgraph.registry import default_registry
from masgraph.rundir.layout import METRICS
from masgraph.rundir.metrics import MetricsSink
from masgraph.rundir.store import RunStore
from masgraph.rundir.trackers import TrackerSink
from masgraph.runtime.cancel import in_thread
from masgraph.runtime.ray_engine import RayConfig
from masgraph.runtime.runner import RunConfig, Runner, mean, summarize
from masgraph.spec import GraphSpec
from masgraph.tasks import Task, TaskSplitWarning, task_ref
from masgraph.threads import released_team
from masgraph.topology.policy import TopologyPolicy
from masgraph.topology.space import DecisionSpace
from masgraph.trace import EVALUATION, Trace
from masgraph.trainers.algorithm import TrainAlgorithm, TrainContext
from masgraph.trainers.checkpoints import Checkpoints, TrainState, truncate_metrics
from masgraph.trainers.checks import LEARNABLE_BACKENDS
from masgraph.trainers.config import LoraTrainBase, TrainSpec
from masgraph.trainers.diagnostics import step_diagnostics


def base_model(spec: GraphSpec, needs_trainable: bool = True) -> str:
    """The one base model training loads: the trainable policies' `model` (any hf/vllm policy's when training only
    the topology). Every hf/vllm policy is served from it (trainable ones as LoRA adapters on it), so all must name
    it, and the trainable ones must share one backend (the one the weight-sync step publishes to)."""
    hf = {n: p for n, p in spec.policies.items() if p.backend in LEARNABLE_BACKENDS}
    trainable = [n for n, p in hf.items() if p.trainable] or ([] if needs_trainable else list(hf))
    if not trainable:
        raise SpecError([Problem("policies", "no hf policy is `trainable: true`, so there is nothing to train",
                                 "set `trainable: true` and an `adapter:` on the hf policy to train")])
    model = hf[trainable[0]].model
    problems = [Problem(f"policies.{n}.model", f"{p.model!r} differs from {model!r} of trainable policy "
                        f"{trainable[0]!r}; training serves every hf policy from one base model (trainable ones "
                        "as LoRA adapters on it)", f"set `model: {model}` here (or train on {p.model!r} throughout)")
                for n, p in hf.items() if p.model != model]
    first = hf[trainable[0]]
    problems += [Problem(f"policies.{n}.backend", f"{p.backend!r} differs from {first.backend!r} of trainable policy "
                         f"{trainable[0]!r}; the trained adapters are published to one rollout backend",
                         f"set `backend: {first.backend}` here") for n in trainable
                 if (p := hf[n]).backend != first.backend or p.api_base != first.api_base]
    if problems:
        raise SpecError(problems)
    return model


def base_device(spec: GraphSpec) -> str:
    """The device the learner's weights live on: the one the local (hf, vllm) policies name (the learner serves
    them all from its weights, so they must agree; `--device` sets them all)."""
    served = {n: p for n, p in spec.policies.items() if p.backend in LEARNABLE_BACKENDS}
    if not served:
        return "auto"
    first = next((n for n, p in served.items() if p.trainable), next(iter(served)))
    device = served[first].device
    where = _same_device(device)
    problems = [Problem(f"policies.{n}.device", f"{p.device!r} differs from {device!r} of policy {first!r}; training "
                        "serves every local policy from the learner's one set of weights on one device",
                        f"set `device: {device}` here (or pass --device to set them all)")
                for n, p in served.items() if p.device != device and _same_device(p.device) != where]
    if problems:
        raise SpecError(problems)
    return device


def base_dtype(spec: GraphSpec, resumed: str = "auto") -> str:
    """The learner's weight dtype: `resumed` when given (a checkpoint's: a resumed run keeps the dtype it trained in),
    else the one the local policies pin, else `auto`. A pin that differs from it is a located error: the local
    policies all decode from the learner's one set of weights."""
    served = {n: p.dtype for n, p in spec.policies.items() if p.backend in LEARNABLE_BACKENDS and p.dtype != "auto"}
    first = next(iter(served), None)
    want = resumed if resumed != "auto" else served.get(first, "auto")
    why = "the dtype the run was given (a resumed run's checkpoint)" if resumed != "auto" else f"policy {first!r}"
    problems = [Problem(f"policies.{n}.dtype", f"{d!r} differs from {want!r} of {why}; training serves every local "
                        "policy from the learner's one set of weights",
                        f"set `dtype: {want}` here, or leave it `auto`")
                for n, d in served.items() if d != want]
    if problems:
        raise SpecError(problems)
    return want


def _same_device(name: str) -> torch.device:
    """A device setting resolved, `cuda` as the GPU it means (so `auto`, `cuda` and `cuda:0` compare equal there)."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class TrainLoop:
    """Trains a graph on a task with the algorithm its `train:` section names (the registered `TrainAlgorithm`, or
    `algorithm` given here); the run directory holds everything needed to resume.

    The loop names no algorithm: it rolls out the algorithm's `rollout_spec` in groups of its `group_size`, asks
    it for extra queries, hands it each step's traces (`train_step`) and checkpoints its `parts()`.

    The learner (default: an in-process `HFLearner` on the graph's base model) owns the adapters; after each
    update `WeightSync` publishes their new versions to the rollout backend and the evaluation backend (default:
    hf backends serving the learner's own model, evaluation's in deterministic mode). A given `backend` needs only
    `complete`, `aclose` and `publish`, and serves evaluation too unless `eval_backend` is given. Every training
    step, evaluation and checkpoint is an event to `sinks`; RUN/metrics.jsonl is always one of them. With `shard`
    (under 2+ learner ranks) the base's decoder layers are split across the ranks (FSDP2) and in-process rollouts and
    evaluation decode on a copy of the base of their own.

    Example:
        >>> loop = TrainLoop(graph, get_task("basic_arithmetic"), Path("runs/train-1"), sinks=[ListSink()])
        >>> asyncio.run(loop.run())
    """

    def __init__(self, graph: Graph, task: Task, run_dir: Path, learner: Learner | None = None,
                 backend: SyncedBackend | None = None, eval_backend: SyncedBackend | None = None,
                 dtype: str = "auto", sinks: Sequence[Sink] = (), ray: RayConfig | None = None,
                 algorithm: type[TrainAlgorithm] | None = None, shard: bool = False):
        if graph.spec.train is None:
            raise SpecError([Problem("train", "the graph has no `train:` section",
                                     "add `train: {task: basic_arithmetic}` (see TrainSpec for the knobs)")])
        self.graph, self.task, self.run_dir = graph, task, Path(run_dir)
        self.cfg: TrainSpec = graph.spec.train
        spec = graph.spec
        algorithm = algorithm or (graph.registry or default_registry()).algorithm(
            self.cfg.algorithm).implementation()
        torch.manual_seed(self.cfg.seed)  # LoRA init
        model = base_model(spec, needs_trainable=algorithm.trains_adapters)
        self.learner: Learner = learner or local_learner(model, dtype=base_dtype(spec, dtype),
                                                                device=base_device(spec))
        if self.cfg.deterministic and getattr(self.learner, "device", None) is not None:
            deterministic_kernels(self.learner.device)  # a GPU's repeatable kernels: exact runs and resumes
        trains_lora = isinstance(self.cfg, LoraTrainBase)  # else: the adapters stay as attached (zero-effect)
        if trains_lora and self.cfg.gradient_checkpointing:
            if not hasattr(self.learner, "gradient_checkpointing"):
                raise MasgraphError(f"train.gradient_checkpointing: the learner {type(self.learner).__name__} "
                                    "cannot recompute activations; drop the setting")
            self.learner.gradient_checkpointing(True)
        lora = (LoraConfigSpec(self.cfg.lora_rank, self.cfg.lora_alpha, tuple(self.cfg.lora_targets)) if trains_lora
                else LoraConfigSpec())
        for pol in spec.policies.values():
            if pol.trainable and pol.adapter not in self.learner.adapters():
                self.learner.add_adapter(pol.adapter, lora)
        if shard:  # before the algorithm's optimizers take the adapters' parameters (sharding replaces them)
            self._shard()
        self.trainable = spec.trainable_adapters()
        # a graph with a `topology:` section samples its topology from a policy (untrained unless the algorithm
        # learns it; evaluation takes its most likely topology)
        self.topology = (TopologyPolicy(DecisionSpace(graph), spec.topology.condition)
                         if spec.topology is not None else None)
        self.algo: TrainAlgorithm = algorithm.build(
            TrainContext(graph, self.cfg, self.learner, self.trainable, self.topology))
        self.group_size = self.algo.group_size
        rollout_spec = self.algo.rollout_spec(spec)
        train_graph = graph if rollout_spec is spec else compile_spec(rollout_spec)
        self.staleness: int = getattr(self.cfg, "max_staleness", 0)
        """1: the next step's rollouts decode while this step updates (on a backend apart from the learner)."""
        self.serving = serve_learner(spec, self.learner, train_graph, seed=self.cfg.seed,
                                     deterministic=self.cfg.deterministic, run_dir=self.run_dir,
                                     max_lora_rank=lora.rank, ray=ray, rollouts=backend,
                                     evaluation=eval_backend, apart=bool(self.staleness),
                                     batch=self.cfg.concurrency)
        self.backend, self.eval_backend = self.serving.rollouts, self.serving.evaluation
        # after an update the evaluation backend serves its new versions at once; the rollout backend too, unless
        # the next step's rollouts are decoding on it: then it gets them as the step after starts its rollouts
        self.sync = WeightSync(self.learner, [self.eval_backend] if self.staleness else
                               [self.backend, self.eval_backend])
        self.rollout_sync = WeightSync(self.learner, [self.backend] if self.staleness else [])
        self.sync()  # the backends serve every trained adapter from the start
        self.rollout_sync()
        self._next: asyncio.Task | None = None
        """The next step's rollouts (traces, data cursor after them, resampling rounds), decoding during an update."""
        self._behaviour: dict[str, int] = {}
        """The adapter versions the next step's rollouts decode with while `_next` runs (saved in `_staged`)."""
        self._kind = kind = rollout_kind(spec)
        common = {"seed": self.cfg.seed, "concurrency": self.cfg.concurrency, "deterministic": self.cfg.deterministic}
        self._rollout_config = RunConfig(split="train", samples=self.group_size, **common)
        self.rollouts = Runner(train_graph, self._rollout_config, backends={kind: self.backend}, topology=self.topology,
                               engine=self.serving.ray_engine)
        self._runners: list[tuple[GraphSpec, str, Runner]] = [(rollout_spec, "sample", self.rollouts)]
        """Each rollout graph and topology mode an algorithm has asked for (`rollout_spec_at`,
        `rollout_topology_at`), with its runner on the shared backend."""
        self.evaluator = Runner(graph, RunConfig(split="test", n=self.cfg.eval_n, topology="greedy", **common),
                                backends={kind: self.eval_backend}, topology=self.topology)
        self._rollouts_at(0)  # an algorithm whose first rollouts the serving cannot run fails here, not after loading
        wanted = self.cfg.steps * self.cfg.queries_per_step * (1 + self.algo.max_extra_rounds)
        self.items = task.items("train", wanted, self.cfg.seed)
        if not self.items:
            raise MasgraphError(f"task {task.name!r} gave no train items (seed {self.cfg.seed}); check its generate()")
        self.eval_items = task.items("test", self.cfg.eval_n, self.cfg.seed)  # every evaluation runs these
        if not self.eval_items:  # found now, not after the training time
            raise MasgraphError(f"task {task.name!r} has no held-out (test) items that differ from its train "
                                f"questions (seed {self.cfg.seed}); held-out evaluation needs some: make "
                                "generate('test', ...) ask other questions")
        if len(self.eval_items) < self.cfg.eval_n:
            held = len(self.eval_items)
            warnings.warn(f"task {task.name!r} holds out {held} item{'s' if held > 1 else ''}, fewer than "
                          f"train.eval_n {self.cfg.eval_n}: each evaluation runs {'those' if held > 1 else 'that'} "
                          f"{held}", TaskSplitWarning, stacklevel=2)
        self.step = 0
        self.cursor = 0  # next unused training item
        self.train_seconds = 0.0  # rollouts + updates so far, on the `budget_clock` (the `max_minutes` budget)
        self._rng = self.learner.rng_state()  # RNG states as of the last completed step (what a checkpoint stores)
        self._updating = False  # adapters are mid-update: the weights match no step
        self._store: RunStore | None = None  # the run's store while `run` runs (evaluations write their episodes)
        self.checkpoints = Checkpoints(self.run_dir)
        self._staged = self.checkpoints.root / ".behaviour"  # the adapters `_behaviour` names, for the checkpoints
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sinks: list[Sink] = [MetricsSink(self.run_dir / METRICS), *sinks]
        self._emit = Emitter(self.sinks)
        self._progress: list[Sink] = [s for s in sinks if callable(getattr(s, "phase", None))]
        """Sinks that follow progress inside a step (a `phase(name, step, total)` method, e.g. the CLI's
        TrainProgress): told each phase as it starts, and sent the episodes of the rollouts and evaluations."""

    def _shard(self) -> None:
        """Split the base's decoder layers across the learner ranks (`masgraph.learn.sharding`); every rank."""
        dp = data_parallel.current()
        if dp is None:
            raise MasgraphError("sharding the base needs 2 or more learner ranks (`--learners N`, or torchrun); "
                                "with one, drop it: the one learner holds the whole base")
        if not hasattr(self.learner, "shard"):
            raise MasgraphError(f"the learner {type(self.learner).__name__} cannot shard its base; drop the setting")
        self.learner.shard(dp)

    # ---- the loop ---------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Train from the current step to `steps`, checkpointing each finished step (and the last one when
        interrupted). Each step's metrics (and step 0's untrained evaluation) go to the sinks as a `TrainStep`."""
        config = {"train": self.cfg.model_dump(), "task": task_ref(self.task)}  # loadable again (topology, export)
        store = self._store = RunStore(self.run_dir, self.graph.spec, config)
        trackers = TrackerSink(self.cfg.report_to, self.run_dir, config)  # train.report_to: TensorBoard, W&B, MLflow
        self._emit.sinks += [store, trackers]  # train events join the episodes in events.jsonl, and the trackers
        last: dict[str, Any] = {}
        try:
            if self.step == 0 and self.cfg.eval_every and not (self.run_dir / METRICS).exists():
                self._record({"step": 0, **await self.evaluate()})  # the untrained graph
            while self.step < self.cfg.steps and not self.out_of_time():
                last = await self._one_step(store)
                try:
                    if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 or self.finished():
                        last.update(await self.evaluate())
                finally:  # an interrupted evaluation still records the step it followed
                    self._record(last)
                self.save()  # every finished step: a killed run resumes from it (see `save`)
        except BaseException:
            if self.step > 0 and not self._updating and not self._checkpoint_dir(self.step).exists():
                self.save()  # Ctrl-C (or a failure) keeps the last completed step, not the interrupted one
            raise
        finally:
            if self._next is not None:  # the next step's rollouts (out of time, interrupted): redone on resume
                self._next.cancel()
                await asyncio.wait([self._next])
                self._next = None
            shutil.rmtree(self._staged, ignore_errors=True)  # each checkpoint holds its own copy
            self._store = None
            self._emit.sinks.remove(store)
            self._emit.sinks.remove(trackers)
            trackers.close()
            store.close({"step": self.step, **last})
        return last

    async def aclose(self) -> None:
        """Stop what this loop started (a vLLM server, Ray workers); the in-process hf backends need nothing."""
        await self.serving.aclose()

    @property
    def sink_errors(self) -> int:
        """Events a sink failed to take (counted, never fatal)."""
        return self._emit.errors

    def _phase(self, name: str, step: int, total: int) -> None:
        """Tells the progress sinks that a phase of `step` starts: 'rollouts' / 'resampling' / 'evaluation' (of
        `total` episodes) or 'update' (of `total` episodes' calls). A sink that raises is counted, never fatal."""
        for sink in self._progress:
            try:
                sink.phase(name, step, total)  # type: ignore[attr-defined]
            except Exception:
                self._emit.errors += 1

    def _record(self, record: dict[str, Any]) -> None:
        """A step's metrics to the sinks (metrics.jsonl's line is `{"step": ..., **metrics}`)."""
        self._emit(TrainStep(step=record["step"], metrics={k: v for k, v in record.items() if k != "step"}))

    def out_of_time(self) -> bool:
        return self.cfg.max_minutes is not None and self.train_seconds >= 60 * self.cfg.max_minutes

    def _budget_clock(self) -> float:
        return time.process_time() if self.cfg.budget_clock == "cpu" else time.perf_counter()

    def finished(self) -> bool:
        return self.step >= self.cfg.steps or self.out_of_time()

    async def _one_step(self, store: RunStore) -> dict[str, Any]:
        """Rollouts and update of one step. Only a finished update commits the step (step, data cursor and
        RNG states move together), so a step interrupted in its rollouts leaves no trace in a checkpoint."""
        t0, c0 = time.perf_counter(), self._budget_clock()
        device = getattr(self.learner, "device", None)
        on_gpu = device is not None and device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        if self._next is not None:  # decoded during the last update
            pending, self._next = self._next, None
            traces, cursor, rounds = await pending
        else:
            traces, cursor, rounds = await self._collect(self.step, self.cursor, [store, *self._progress])
        t_roll = time.perf_counter() - t0
        overlap = bool(self.staleness) and self.step + 1 < self.cfg.steps
        if overlap:  # the next step's rollouts decode on the adapters as they are now, while this step updates
            self._stage_behaviour()
            self._next = asyncio.create_task(self._collect(self.step + 1, cursor, [store]))
        self._phase("update", self.step + 1, len(traces))
        self._updating = True  # no await until the commit but the update's own: a cancellation stops it uncommitted
        t_update = time.perf_counter()
        if (dp := data_parallel.current()) is not None:  # the other learner ranks join this update (cli/learners.py)
            dp.broadcast(self.step, "the next update's step")
        metrics = await in_thread(self._update, traces) if overlap else self._update(traces)
        t_update = time.perf_counter() - t_update
        scored = {t.episode_id: t.meta[META] for t in traces if t.meta.get(META)}  # kept for inspection
        for episode_id, calls in self.algo.credit().items():
            self._emit(Credited(step=self.step + 1, episode_id=episode_id, calls=calls,
                                counterfactual=scored.get(episode_id, [])))
        self.sync()  # later rollouts use the adapters' new versions (and are stamped with them)
        if self.topology is not None:
            metrics |= topology_metrics(self.topology, traces[::self.group_size])
        self.step, self.cursor, self._rng, self._updating = self.step + 1, cursor, self.learner.rng_state(), False
        elapsed = time.perf_counter() - t0
        self.train_seconds += self._budget_clock() - c0
        tokens = sum(t.completion_tokens for t in traces)
        return {"step": self.step, **metrics, "accuracy/train": summarize(traces)["accuracy"],
                **step_diagnostics(traces, set(self.trainable)), "resample_rounds": rounds,
                "time/rollout_s": t_roll, "time/update_s": t_update, "time/step_s": elapsed,
                "time/train_s": self.train_seconds,
                "tokens": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9),
                **({"memory/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30} if on_gpu else {})}

    def _update(self, traces: list[Trace]) -> dict[str, Any]:
        """The algorithm's update on this step's traces; the thread's OpenMP workers go at its end, so the decode
        thread's team waits as configured (masgraph/threads.py)."""
        with released_team():
            return self.algo.train_step(traces, self.step)

    async def _collect(self, step: int, cursor: int, sinks: list[Sink]) -> tuple[list[Trace], int, int]:
        """Step `step`'s rollouts from data cursor `cursor`, with the algorithm's resampling rounds: the traces, the
        cursor after them, and the rounds. The items depend only on the step's data, never on timing. In the
        foreground (the progress sinks among `sinks`) each phase is announced."""
        say = self._phase if any(s in sinks for s in self._progress) else (lambda *_: None)
        rollouts = self._rollouts_at(step)
        items = self.items[cursor:cursor + self.cfg.queries_per_step]
        cursor += len(items)
        say("rollouts", step + 1, len(items) * self.group_size)
        traces = await self.algo.rollouts(rollouts, self.task, items, sinks)
        rounds = 0
        while (missing := self.algo.extra_queries(traces, rounds)) > 0:
            extra = self.items[cursor:cursor + missing]
            if not extra:
                break
            cursor += len(extra)
            say("resampling", step + 1, len(extra) * self.group_size)
            traces += await self.algo.rollouts(rollouts, self.task, extra, sinks)
            rounds += 1
        return traces, cursor, rounds

    def _stage_behaviour(self) -> None:
        """Save the adapters as they are (the checkpoints copy them: the step after this one resumes its rollouts
        from them) and serve that copy to the rollout backend."""
        adapters = sorted(set(self.trainable.values()))
        shutil.rmtree(self._staged, ignore_errors=True)
        self.learner.save(str(self._staged), adapters)
        self._behaviour = {a: self.learner.version(a) for a in adapters}
        self._serve_rollouts({a: self._staged / a for a in adapters}, self._behaviour)

    def _serve_rollouts(self, saved: dict[str, Path], versions: dict[str, int]) -> None:
        """The rollout backend serves these saved adapters at these versions (each one it does not serve yet)."""
        for name, path in saved.items():
            if self.rollout_sync.published.get(name) != versions[name]:
                self.backend.publish(name, versions[name], SavedAdapter(path))
                self.rollout_sync.published[name] = versions[name]

    def _rollouts_at(self, step: int) -> Runner:
        """The runner of the graph the algorithm rolls step `step` out as (one per distinct graph, all on the same
        rollout backend, so a staged algorithm changes how rollouts sample without loading anything again)."""
        spec, mode = self.algo.rollout_spec_at(self.graph.spec, step), self.algo.rollout_topology_at(step)
        for known, known_mode, runner in self._runners:
            if (known is spec or known == spec) and known_mode == mode:
                return runner
        if self.serving.ray_engine is not None:
            raise MasgraphError(f"the {self.cfg.algorithm} algorithm rolls out step {step + 1} with another graph "
                                "or topology mode than step 1 (a staged schedule), but Ray rollout workers are built "
                                "for one; train without Ray, or use a schedule that keeps one rollout graph")
        runner = Runner(compile_spec(spec), replace(self._rollout_config, topology=mode),
                        backends={self._kind: self.backend}, topology=self.topology)
        self._runners.append((spec, mode, runner))
        return runner

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with the graph's own (greedy) sampling, and how often its outputs failed to parse.

        Served by the evaluation backend (the in-process one decodes deterministically), so the same adapters
        score the same; the RNG states are put back afterwards, so evaluating (or not) never changes what training
        samples next. Emits `EvalFinished`."""
        rng = self.learner.rng_state()
        self._phase("evaluation", self.step, len(self.eval_items))
        # stored in the run (events.jsonl, the episode index) marked with the step they evaluated: watch opens them
        sinks = [*self._progress, *([self._store] if self._store is not None else [])]
        try:
            result = await self.evaluator.run_items(self.task, self.eval_items, sinks=sinks, store=False,
                                                    meta={EVALUATION: self.step}, id_prefix=f"eval{self.step}-")
        finally:
            self.learner.set_rng_state(rng)
        summary = result.summary
        metrics = {"accuracy/test": summary["accuracy"],  # the task's verdict, over every held-out episode
                   EPISODES_TEST: float(summary["episodes"]),  # how many that is (fewer than eval_n: a small task)
                   "accuracy_finished/test": summary.get("accuracy_finished", summary["accuracy"]),
                   **{f"failures/test/{kind}": float(n) for kind, n in summary.get("failures", {}).items()},
                   "parse_error_rate/test": summary["parse_error_rate"],
                   "parse_failed_episodes/test": mean([any(s.parse_error for s in t.steps) for t in result.traces])}
        self._emit(EvalFinished(step=self.step, metrics=metrics))
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints.step_dir(step)

    def save(self) -> Path:
        """Checkpoint the last completed step (see `trainers/checkpoints.py`); emits `CheckpointSaved`. Every finished
        step is saved (a run killed with SIGKILL resumes from its last finished step); once it is whole, the earlier
        steps `checkpoint_every` does not keep are deleted, so a run keeps every Nth step and its newest one."""
        adapters = sorted(set(self.trainable.values()))
        ahead = self._next is not None  # the next step's rollouts decode with `_behaviour`: a resume does too
        state = TrainState(step=self.step, cursor=self.cursor, train_seconds=self.train_seconds,
                           versions={a: self.learner.version(a) for a in adapters}, adapters=adapters,
                           dtype=self.learner.dtype, behaviour=self._behaviour if ahead else None)
        final = self.checkpoints.save(state, self.learner, self.algo, self._rng, self._staged if ahead else None)
        self.checkpoints.drop_superseded(self.step, self.cfg.checkpoint_every)
        self._emit(CheckpointSaved(step=self.step, path=str(final)))
        return final

    def load(self, checkpoint: Path) -> None:
        """Restore a checkpoint written by `save` (adapter weights and versions, the algorithm's state, RNG, step,
        data cursor); a checkpoint that is corrupt, incomplete or of another graph is a MasgraphError naming what
        is wrong."""
        state = self.checkpoints.load(checkpoint, self.learner, self.algo, sorted(set(self.trainable.values())),
                                      self.cfg, n_items=len(self.items))
        self._rng = self.learner.rng_state()
        self.sync(force=True)  # the loaded weights replace what the backends served, whatever the versions
        behaviour = self.checkpoints.behaviour(checkpoint, state) if self.staleness else {}
        if behaviour:  # the next rollouts decode with the adapters the run's would have (the learner's own versions
            self.rollout_sync.published.clear()  # reach them as the step after starts its rollouts)
            self._serve_rollouts(behaviour, state.behaviour)
        else:
            self.rollout_sync(force=True)
        self.step = state.step
        self.cursor = state.cursor if state.cursor is not None else self.step * self.cfg.queries_per_step
        self.train_seconds = state.train_seconds
        truncate_metrics(self.run_dir / METRICS, self.step)


def topology_metrics(policy: TopologyPolicy, traces: list[Trace]) -> dict[str, float]:
    """Each decision's option probabilities (`topology/p/<decision>/<option>`); for a query-conditioned policy the
    mean over the step's queries, and per query type (`topology/type/<type>/<decision>/<option>`) when the task's
    items have one."""
    if not policy.conditioned or not traces:
        return {topology_p(d, o): p for d, opts in policy.probabilities().items() for o, p in opts.items()}
    out: dict[str, float] = {}
    groups: dict[str, list[Trace]] = {"": traces}
    for t in traces:
        if "type" in t.meta:
            groups.setdefault(str(t.meta["type"]), []).append(t)
    for kind, members in groups.items():
        probs = [policy.probabilities(t.query) for t in members]
        out |= {topology_p(d, o, kind or None): sum(p[d][o] for p in probs) / len(probs)
                for d, opts in probs[0].items() for o in opts}
    return out
