"""The training loop around an algorithm: rollouts through the same Runner/Scheduler as `masgraph run`,
updates on a learner, weight sync to the rollout backends, held-out evaluation, atomic checkpoints, exact
resume; train-step, evaluation and checkpoint events to sinks (metrics.jsonl is one)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from masgraph.backends.base import SyncedBackend
from masgraph.backends.hf_learner import HFLearner
from masgraph.checkpoint import TOPOLOGY_FILE, checkpoint_adapters, read_state
from masgraph.device import deterministic_kernels, resolve_device
from masgraph.errors import MasgraphError, Problem, SpecError
from masgraph.events import CheckpointSaved, Emitter, EvalFinished, Sink, TrainStep
from masgraph.graph import Graph, compile_spec
from masgraph.learner import Learner, LoraConfigSpec, WeightSync
from masgraph.metrics import MetricsSink
from masgraph.ray_rollouts import RayConfig
from masgraph.runner import RunConfig, Runner, mean, summarize
from masgraph.serving import rollout_kind, serve_learner
from masgraph.spec import GraphSpec
from masgraph.store import RunStore
from masgraph.tasks import Task
from masgraph.topology.policy import TopologyPolicy
from masgraph.topology.space import DecisionSpace
from masgraph.trace import Trace
from masgraph.trainers.checks import LEARNABLE_BACKENDS
from masgraph.trainers.config import TrainSpec
from masgraph.trainers.flow_grpo import FlowGRPO, informative_queries
from masgraph.trainers.hrpo import HRPO

# fault injection for the crash tests: seconds to sleep in the middle of writing a checkpoint
_PAUSE_ENV = "MASGRAPH_CHECKPOINT_PAUSE_S"


def sampling_graph(spec: GraphSpec, temperature: float) -> Graph:
    """The graph as training rolls it out: trainable policies sample at `temperature`, the rest as written."""
    hot = {n: p.model_copy(update={"sampling": p.sampling.model_copy(update={"temperature": temperature})})
           if p.trainable else p for n, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": hot}))


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


def _same_device(name: str) -> torch.device:
    """A device setting resolved, `cuda` as the GPU it means (so `auto`, `cuda` and `cuda:0` compare equal there)."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device



class TrainLoop:
    """Trains a graph's trainable policies on a task; the run directory holds everything needed to resume.

    The learner (default: an in-process `HFLearner` on the graph's base model) owns the adapters; after each
    update `WeightSync` publishes their new versions to the rollout backend and the evaluation backend (default:
    hf backends serving the learner's own model, evaluation's in deterministic mode). A given `backend` needs only
    `complete`, `aclose` and `publish`, and serves evaluation too unless `eval_backend` is given. Every training
    step, evaluation and checkpoint is an event to `sinks`; RUN/metrics.jsonl is always one of them.

    Example:
        >>> loop = TrainLoop(graph, get_task("basic_arithmetic"), Path("runs/train-1"), sinks=[ListSink()])
        >>> asyncio.run(loop.run())
    """

    def __init__(self, graph: Graph, task: Task, run_dir: Path, learner: Learner | None = None,
                 backend: SyncedBackend | None = None, eval_backend: SyncedBackend | None = None,
                 dtype: str = "auto", sinks: Sequence[Sink] = (), ray: RayConfig | None = None):
        if graph.spec.train is None:
            raise SpecError([Problem("train", "the graph has no `train:` section",
                                     "add `train: {task: basic_arithmetic}` (see TrainSpec for the knobs)")])
        self.graph, self.task, self.run_dir = graph, task, Path(run_dir)
        self.cfg: TrainSpec = graph.spec.train
        spec = graph.spec
        torch.manual_seed(self.cfg.seed)  # LoRA init
        algorithm = self.cfg.algorithm
        self.trains_nodes, self.trains_topology = algorithm in ("flow_grpo", "joint"), algorithm in ("hrpo", "joint")
        model = base_model(spec, needs_trainable=self.trains_nodes)
        self.learner: Learner = learner or HFLearner(model, dtype=dtype, device=base_device(spec))
        if self.cfg.deterministic and getattr(self.learner, "device", None) is not None:
            deterministic_kernels(self.learner.device)  # a GPU's repeatable kernels: exact runs and resumes
        if self.cfg.gradient_checkpointing:
            if not hasattr(self.learner, "gradient_checkpointing"):
                raise MasgraphError(f"train.gradient_checkpointing: the learner {type(self.learner).__name__} "
                                    "cannot recompute activations; drop the setting")
            self.learner.gradient_checkpointing(True)
        kind = rollout_kind(spec)
        # training rollouts sample the trained policies; evaluation uses the graph as written (greedy), and the
        # topology policy's most likely topology
        train_graph = sampling_graph(spec, self.cfg.flow_grpo.temperature) if self.trains_nodes else graph
        self.serving = serve_learner(spec, self.learner, train_graph, seed=self.cfg.seed,
                                     deterministic=self.cfg.deterministic, run_dir=self.run_dir,
                                     max_lora_rank=self.cfg.lora_rank, ray=ray, rollouts=backend,
                                     evaluation=eval_backend)
        self.backend, self.eval_backend = self.serving.rollouts, self.serving.evaluation
        lora = LoraConfigSpec(self.cfg.lora_rank, self.cfg.lora_alpha, tuple(self.cfg.lora_targets))
        for pol in spec.policies.values():
            if pol.trainable and pol.adapter not in self.learner.adapters():
                self.learner.add_adapter(pol.adapter, lora)
        self.sync = WeightSync(self.learner, [self.backend, self.eval_backend])
        self.sync()  # the rollout backends serve every trained adapter from the start
        self.trainable = {n: spec.policies[s.policy].adapter for n, s in spec.nodes.items()
                          if s.policy and spec.policies[s.policy].trainable}
        self.algo = FlowGRPO(self.learner, self.trainable, self.cfg.flow_grpo)
        self.topology, self.hrpo = _topology_trainer(graph, self.cfg)
        self.group_size = self.cfg.hrpo.group_size if algorithm == "hrpo" else self.cfg.flow_grpo.group_size
        common = {"seed": self.cfg.seed, "concurrency": self.cfg.concurrency, "deterministic": self.cfg.deterministic}
        self.rollouts = Runner(train_graph, RunConfig(split="train", samples=self.group_size, **common),
                               backends={kind: self.backend}, topology=self.topology, engine=self.serving.ray_engine)
        self.evaluator = Runner(graph, RunConfig(split="test", n=self.cfg.eval_n, topology="greedy", **common),
                                backends={kind: self.eval_backend}, topology=self.topology)
        fg = self.cfg.flow_grpo
        rounds = 1 + (fg.resample_rounds if fg.zero_variance == "resample" else 0)
        self.items = task.items("train", self.cfg.steps * self.cfg.queries_per_step * rounds, self.cfg.seed)
        if not self.items:
            raise MasgraphError(f"task {task.name!r} gave no train items (seed {self.cfg.seed}); check its generate()")
        if not task.items("test", self.cfg.eval_n, self.cfg.seed):  # found now, not after the training time
            raise MasgraphError(f"task {task.name!r} has no held-out (test) items that differ from its train "
                                f"questions (seed {self.cfg.seed}); held-out evaluation needs some: make "
                                "generate('test', ...) ask other questions")
        self.step = 0
        self.cursor = 0  # next unused training item
        self.train_seconds = 0.0  # rollouts + updates so far, on the `budget_clock` (the `max_minutes` budget)
        self._rng = self.learner.rng_state()  # RNG states as of the last completed step (what a checkpoint stores)
        self._updating = False  # adapters are mid-update: the weights match no step
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sinks: list[Sink] = [MetricsSink(self.run_dir / "metrics.jsonl"), *sinks]
        self._emit = Emitter(self.sinks)

    # ---- the loop ---------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Train from the current step to `steps`; checkpoint on schedule, at the end and when interrupted. Each
        step's metrics (and step 0's untrained evaluation) go to the sinks as a `TrainStep`."""
        store = RunStore(self.run_dir, self.graph.spec, {"train": self.cfg.model_dump(), "task": self.task.name})
        self._emit.sinks.append(store)  # train events join the episodes in events.jsonl
        last: dict[str, Any] = {}
        try:
            if self.step == 0 and self.cfg.eval_every and not (self.run_dir / "metrics.jsonl").exists():
                self._record({"step": 0, **await self.evaluate()})  # the untrained graph
            while self.step < self.cfg.steps and not self.out_of_time():
                last = await self._one_step(store)
                try:
                    if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 or self.finished():
                        last.update(await self.evaluate())
                finally:  # an interrupted evaluation still records the step it followed
                    self._record(last)
                if self.step % self.cfg.checkpoint_every == 0 or self.finished():
                    self.save()
        except BaseException:
            if self.step > 0 and not self._updating and not self._checkpoint_dir(self.step).exists():
                self.save()  # Ctrl-C (or a failure) keeps the last completed step, not the interrupted one
            raise
        finally:
            self._emit.sinks.remove(store)
            store.close({"step": self.step, **last})
        return last

    async def aclose(self) -> None:
        """Stop what this loop started (a vLLM server, Ray workers); the in-process hf backends need nothing."""
        await self.serving.aclose()

    @property
    def sink_errors(self) -> int:
        """Events a sink failed to take (counted, never fatal)."""
        return self._emit.errors

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
        q, fg = self.cfg.queries_per_step, self.cfg.flow_grpo
        t0, c0 = time.perf_counter(), self._budget_clock()
        device = getattr(self.learner, "device", None)
        on_gpu = device is not None and device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        cursor = self.cursor + q
        traces = (await self.rollouts.run_items(self.task, self.items[self.cursor:cursor], sinks=[store],
                                                store=False)).traces
        rounds = 0
        while self.trains_nodes and fg.zero_variance == "resample" and rounds < fg.resample_rounds:
            missing = q - len(informative_queries(traces, fg))
            extra = self.items[cursor:cursor + missing] if missing > 0 else []
            if not extra:
                break
            cursor += len(extra)
            traces += (await self.rollouts.run_items(self.task, extra, sinks=[store], store=False)).traces
            rounds += 1
        t_roll = time.perf_counter() - t0
        self._updating = True  # no await until the commit: a cancellation cannot land in between
        metrics: dict[str, Any] = {}
        schedule = getattr(self.cfg, "schedule", "simultaneous")
        if self.trains_nodes and (schedule == "simultaneous" or self.step % 2 == 0):
            metrics |= self.algo.update(traces, seed=f"{self.cfg.seed}:{self.step}")
            self.sync()  # later rollouts use the new adapter versions (and are stamped with them)
        if self.hrpo is not None and (schedule == "simultaneous" or self.step % 2 == 1 or not self.trains_nodes):
            g = self.group_size
            metrics |= self.hrpo.update([traces[i:i + g] for i in range(0, len(traces), g)])
        if self.topology is not None:
            metrics |= topology_metrics(self.topology, traces[::self.group_size])
        self.step, self.cursor, self._rng, self._updating = self.step + 1, cursor, self.learner.rng_state(), False
        elapsed = time.perf_counter() - t0
        self.train_seconds += self._budget_clock() - c0
        tokens = sum(t.completion_tokens for t in traces)
        return {"step": self.step, **metrics, "accuracy/train": summarize(traces)["accuracy"],
                "informative_groups": float(len(informative_queries(traces, fg))), "resample_rounds": rounds,
                "time/rollout_s": t_roll, "time/step_s": elapsed, "time/train_s": self.train_seconds,
                "tokens": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9),
                **({"memory/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30} if on_gpu else {})}

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with the graph's own (greedy) sampling, and how often its outputs failed to parse.

        Served by the evaluation backend (the in-process one decodes deterministically), so the same adapters
        score the same; the RNG states are put back afterwards, so evaluating (or not) never changes what training
        samples next. Emits `EvalFinished`."""
        rng = self.learner.rng_state()
        try:
            result = await self.evaluator.run_task(self.task, store=False)
        finally:
            self.learner.set_rng_state(rng)
        metrics = {"accuracy/test": result.summary["accuracy"],
                   "parse_error_rate/test": result.summary["parse_error_rate"],
                   "parse_failed_episodes/test": mean([any(s.parse_error for s in t.steps) for t in result.traces])}
        self._emit(EvalFinished(step=self.step, metrics=metrics))
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step-{step}"

    def save(self) -> Path:
        """Write adapters (PEFT format), optimizer states, RNG states, step and data cursor of the last
        completed step; atomic rename."""
        final = self._checkpoint_dir(self.step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        adapters = sorted(set(self.trainable.values()))
        self.learner.save(str(tmp / "adapters"), adapters)
        if os.environ.get(_PAUSE_ENV):
            time.sleep(float(os.environ[_PAUSE_ENV]))
        torch.save({a: opt.state_dict() for a, opt in self.algo.optimizers.items()}, tmp / "optimizer.pt")
        torch.save(self._rng, tmp / "rng.pt")
        if self.hrpo is not None:
            torch.save(self.hrpo.state_dict(), tmp / TOPOLOGY_FILE)
        (tmp / "state.json").write_text(json.dumps({
            "step": self.step, "cursor": self.cursor, "train_seconds": self.train_seconds,
            "versions": {a: self.learner.version(a) for a in adapters}, "adapters": adapters,
            "dtype": self.learner.dtype}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (self.run_dir / "checkpoints" / "latest.tmp").write_text(final.name)
        os.replace(self.run_dir / "checkpoints" / "latest.tmp", self.run_dir / "checkpoints" / "latest")
        self._emit(CheckpointSaved(step=self.step, path=str(final)))
        return final

    def load(self, checkpoint: Path) -> None:
        """Restore a checkpoint written by `save` (adapter weights, optimizers, RNG, step, versions); a
        checkpoint that is corrupt, incomplete or of another graph is a MasgraphError naming what is wrong."""
        state = _read_state(checkpoint)
        trained = sorted(set(self.trainable.values()))
        if state["adapters"] != trained:
            raise MasgraphError(f"checkpoint {checkpoint} holds adapters {state['adapters']} but this graph trains "
                                f"{trained}; resume with the graph the run was trained with")
        for name, path in checkpoint_adapters(checkpoint).items():
            self._check_lora_shape(name, path)
            try:
                self.learner.load_adapter(name, str(path), version=state["versions"].get(name))
            except Exception as exc:  # safetensors / peft raise several kinds for a truncated or foreign file
                raise MasgraphError(f"cannot load adapter {name!r} from {path} ({type(exc).__name__}: {exc}); "
                                    f"{_EARLIER}") from exc
        optimizers, rng = (_load_torch(checkpoint / f) for f in ("optimizer.pt", "rng.pt"))
        try:
            for a in trained:
                self.algo.optimizers[a].load_state_dict(optimizers[a])
            self.learner.set_rng_state(rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise MasgraphError(f"checkpoint {checkpoint} does not match this graph's trainer ({exc}); "
                                f"{_EARLIER}") from exc
        if self.hrpo is not None:
            try:
                self.hrpo.load_state_dict(_load_torch(checkpoint / TOPOLOGY_FILE))
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise MasgraphError(f"{checkpoint / TOPOLOGY_FILE} does not match this graph's topology ({exc}); "
                                    f"{_EARLIER}") from exc
        self._rng = self.learner.rng_state()
        self.sync(force=True)  # the loaded weights replace what the backends served, whatever the versions
        self.step = state["step"]
        self.cursor = state.get("cursor", self.step * self.cfg.queries_per_step)
        self.train_seconds = state.get("train_seconds", 0.0)
        _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)


    def _check_lora_shape(self, name: str, path: Path) -> None:
        """The saved adapter has the LoRA shape the graph trains: loading another shape would replace the
        parameters the optimizers hold, and training would silently stop. Its targets are compared with what the
        graph's `lora_targets` resolved to on this model, as the adapter attached for them records them (Phi3's
        `qkv_proj` for q_proj/v_proj; `all-linear` expanded to module names), which is what a checkpoint saves."""
        def sort(targets: Any) -> Any:  # peft keeps a list of names, or one regex string
            return sorted(targets) if isinstance(targets, (list, tuple, set)) else targets

        try:
            saved = json.loads((path / "adapter_config.json").read_text())
            got = (saved["r"], saved["lora_alpha"], sort(saved["target_modules"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MasgraphError(f"cannot read {path / 'adapter_config.json'} ({exc}); {_EARLIER}") from exc
        targets = self.cfg.lora_targets
        if isinstance(self.learner, HFLearner) and name in self.learner.weights.adapters():
            targets = self.learner.weights.lora_targets(name)  # resolved on this architecture
        want = (self.cfg.lora_rank, self.cfg.lora_alpha, sort(targets))
        if got != want:
            raise MasgraphError(
                f"adapter {name!r} in {path} has LoRA rank, alpha, targets {got} but the graph trains {want}; "
                "resume with the `train:` lora_rank / lora_alpha / lora_targets the run was started with")


def _topology_trainer(graph: Graph, cfg: Any) -> tuple[TopologyPolicy | None, HRPO | None]:
    """A graph with a `topology:` section gets a topology policy (trained by HRPO when the algorithm learns the
    topology; otherwise it keeps sampling from its untrained, uniform prior)."""
    if graph.spec.topology is None:
        return None, None
    policy = TopologyPolicy(DecisionSpace(graph), graph.spec.topology.condition)
    return policy, (HRPO(policy, cfg.hrpo) if cfg.algorithm in ("hrpo", "joint") else None)


def topology_metrics(policy: TopologyPolicy, traces: list[Trace]) -> dict[str, float]:
    """Each decision's option probabilities (`topology/p/<decision>/<option>`); for a query-conditioned policy the
    mean over the step's queries, and per query type (`topology/type/<type>/<decision>/<option>`) when the task's
    items have one."""
    if not policy.conditioned or not traces:
        return {f"topology/p/{d}/{o}": p for d, opts in policy.probabilities().items() for o, p in opts.items()}
    out: dict[str, float] = {}
    groups: dict[str, list[Trace]] = {"": traces}
    for t in traces:
        if "type" in t.meta:
            groups.setdefault(str(t.meta["type"]), []).append(t)
    for kind, members in groups.items():
        probs = [policy.probabilities(t.query) for t in members]
        prefix = f"topology/type/{kind}" if kind else "topology/p"
        out |= {f"{prefix}/{d}/{o}": sum(p[d][o] for p in probs) / len(probs)
                for d, opts in probs[0].items() for o in opts}
    return out


_EARLIER = "resume from an earlier checkpoint (RUN/checkpoints/step-N) or delete this one"


def _read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's state.json, checked to hold what `TrainLoop.load` needs, or a MasgraphError with the fix."""
    state = read_state(checkpoint)
    bad = [k for k, t in {"step": int, "versions": dict}.items() if not isinstance(state.get(k), t)]
    if bad:
        raise MasgraphError(f"{checkpoint / 'state.json'} is missing or has malformed {' and '.join(bad)}; "
                            f"{_EARLIER}")
    return state


def _load_torch(path: Path) -> Any:
    try:
        # onto the CPU whatever device saved it: optimizer states follow their parameters when loaded
        return torch.load(path, weights_only=False, map_location="cpu")
    except Exception as exc:  # missing, truncated or not a torch file: torch raises several kinds
        raise MasgraphError(f"cannot load {path} ({type(exc).__name__}: {exc}); {_EARLIER}") from exc


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines of steps after the checkpoint (they are redone), atomically."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
