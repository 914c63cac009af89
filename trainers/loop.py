"""The training loop around an algorithm: rollouts through the same Runner/Scheduler as `masgraph run`,
updates, metrics.jsonl, held-out evaluation, atomic checkpoints, exact resume."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from masgraph.backends.hf import HFBackend, LoraConfigSpec
from masgraph.checkpoint import checkpoint_adapters, read_state
from masgraph.errors import MasgraphError, Problem, SpecError
from masgraph.graph import Graph, compile_spec
from masgraph.runner import RunConfig, Runner, mean, summarize
from masgraph.spec import GraphSpec, TrainSpec
from masgraph.store import RunStore
from masgraph.tasks import Task
from masgraph.trainers.flow_grpo import FlowGRPO, informative_queries

# fault injection for the crash tests: seconds to sleep in the middle of writing a checkpoint
_PAUSE_ENV = "MASGRAPH_CHECKPOINT_PAUSE_S"


def sampling_graph(spec: GraphSpec, temperature: float) -> Graph:
    """The graph as training rolls it out: trainable policies sample at `temperature`, the rest as written."""
    hot = {n: p.model_copy(update={"sampling": p.sampling.model_copy(update={"temperature": temperature})})
           if p.trainable else p for n, p in spec.policies.items()}
    return compile_spec(spec.model_copy(update={"policies": hot}))


def base_model(spec: GraphSpec) -> str:
    """The one base model training loads: the trainable policies' `model`. Every hf policy is served from
    it (trainable ones as LoRA adapters on it), so all of them must name it."""
    hf = {n: p for n, p in spec.policies.items() if p.backend == "hf"}
    trainable = [n for n, p in hf.items() if p.trainable]  # the first declared one names the base
    if not trainable:
        raise SpecError([Problem("policies", "no hf policy is `trainable: true`, so there is nothing to train",
                                 "set `trainable: true` and an `adapter:` on the hf policy to train")])
    model = hf[trainable[0]].model
    problems = [Problem(f"policies.{n}.model", f"{p.model!r} differs from {model!r} of trainable policy "
                        f"{trainable[0]!r}; training serves every hf policy from one base model (trainable ones "
                        "as LoRA adapters on it)", f"set `model: {model}` here (or train on {p.model!r} throughout)")
                for n, p in hf.items() if p.model != model]
    if problems:
        raise SpecError(problems)
    return model


class TrainLoop:
    """Trains a graph's trainable policies on a task; the run directory holds everything needed to resume.

    Example:
        >>> loop = TrainLoop(graph, get_task("basic_arithmetic"), Path("runs/train-1"))
        >>> asyncio.run(loop.run())
    """

    def __init__(self, graph: Graph, task: Task, run_dir: Path, backend: HFBackend | None = None,
                 dtype: str = "auto"):
        if graph.spec.train is None:
            raise SpecError([Problem("train", "the graph has no `train:` section",
                                     "add `train: {task: basic_arithmetic}` (see TrainSpec for the knobs)")])
        self.graph, self.task, self.run_dir = graph, task, Path(run_dir)
        self.cfg: TrainSpec = graph.spec.train
        spec = graph.spec
        torch.manual_seed(self.cfg.seed)  # LoRA init
        model = base_model(spec)
        self.backend = backend or HFBackend(model, dtype=dtype, deterministic=self.cfg.deterministic,
                                            seed=self.cfg.seed)
        lora = LoraConfigSpec(self.cfg.lora_rank, self.cfg.lora_alpha, tuple(self.cfg.lora_targets))
        for pol in spec.policies.values():
            if pol.trainable and pol.adapter not in self.backend.versions:
                self.backend.add_adapter(pol.adapter, lora)
        self.trainable = {n: spec.policies[s.policy].adapter for n, s in spec.nodes.items()
                          if s.policy and spec.policies[s.policy].trainable}
        self.algo = FlowGRPO(self.backend, self.trainable, self.cfg.flow_grpo)
        # training rollouts sample the trainable policies; evaluation uses the graph as written (greedy)
        train_graph = sampling_graph(spec, self.cfg.flow_grpo.temperature)
        common = {"seed": self.cfg.seed, "concurrency": self.cfg.concurrency, "deterministic": self.cfg.deterministic}
        self.rollouts = Runner(train_graph, RunConfig(split="train", samples=self.cfg.flow_grpo.group_size, **common),
                               backends={"hf": self.backend})
        self.evaluator = Runner(graph, RunConfig(split="test", n=self.cfg.eval_n, **common),
                                backends={"hf": self.backend})
        fg = self.cfg.flow_grpo
        rounds = 1 + (fg.resample_rounds if fg.zero_variance == "resample" else 0)
        self.items = task.items("train", self.cfg.steps * self.cfg.queries_per_step * rounds, self.cfg.seed)
        self.step = 0
        self.cursor = 0  # next unused training item
        self.train_seconds = 0.0  # rollouts + updates so far (the `max_minutes` budget)
        self._rng = self._rng_state()  # RNG states as of the last completed step (what a checkpoint stores)
        self._updating = False  # adapters are mid-update: the weights match no step
        self.run_dir.mkdir(parents=True, exist_ok=True)

    # ---- the loop ---------------------------------------------------------------------------------
    async def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Train from the current step to `steps`; checkpoint on schedule, at the end and when interrupted."""
        store = RunStore(self.run_dir, self.graph.spec, {"train": self.cfg.model_dump(), "task": self.task.name})
        last: dict[str, Any] = {}
        try:
            if self.step == 0 and self.cfg.eval_every and not (self.run_dir / "metrics.jsonl").exists():
                baseline = {"step": 0, **await self.evaluate()}  # the untrained graph
                self._append_metrics(baseline)
                if on_step is not None:
                    on_step(baseline)
            while self.step < self.cfg.steps and not self.out_of_time():
                last = await self._one_step(store)
                try:
                    if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 or self.finished():
                        last.update(await self.evaluate())
                finally:  # an interrupted evaluation still records the step it followed
                    self._append_metrics(last)
                if on_step is not None:
                    on_step(last)
                if self.step % self.cfg.checkpoint_every == 0 or self.finished():
                    self.save()
        except BaseException:
            if self.step > 0 and not self._updating and not self._checkpoint_dir(self.step).exists():
                self.save()  # Ctrl-C (or a failure) keeps the last completed step, not the interrupted one
            raise
        finally:
            store.close({"step": self.step, **last})
        return last

    def out_of_time(self) -> bool:
        return self.cfg.max_minutes is not None and self.train_seconds >= 60 * self.cfg.max_minutes

    def finished(self) -> bool:
        return self.step >= self.cfg.steps or self.out_of_time()

    async def _one_step(self, store: RunStore) -> dict[str, Any]:
        """Rollouts and update of one step. Only a finished update commits the step (step, data cursor and
        RNG states move together), so a step interrupted in its rollouts leaves no trace in a checkpoint."""
        q, fg = self.cfg.queries_per_step, self.cfg.flow_grpo
        t0 = time.perf_counter()
        cursor = self.cursor + q
        traces = (await self.rollouts.run_items(self.task, self.items[self.cursor:cursor], sinks=[store],
                                                store=False)).traces
        rounds = 0
        while fg.zero_variance == "resample" and rounds < fg.resample_rounds:
            missing = q - len(informative_queries(traces, fg))
            extra = self.items[cursor:cursor + missing] if missing > 0 else []
            if not extra:
                break
            cursor += len(extra)
            traces += (await self.rollouts.run_items(self.task, extra, sinks=[store], store=False)).traces
            rounds += 1
        t_roll = time.perf_counter() - t0
        self._updating = True  # no await until the commit: a cancellation cannot land in between
        metrics = self.algo.update(traces, seed=f"{self.cfg.seed}:{self.step}")
        self.step, self.cursor, self._rng, self._updating = self.step + 1, cursor, self._rng_state(), False
        elapsed = time.perf_counter() - t0
        self.train_seconds += elapsed
        tokens = sum(t.completion_tokens for t in traces)
        return {"step": self.step, **metrics, "accuracy/train": summarize(traces)["accuracy"],
                "informative_groups": float(len(informative_queries(traces, fg))), "resample_rounds": rounds,
                "time/rollout_s": t_roll, "time/step_s": elapsed, "time/train_s": self.train_seconds,
                "tokens": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9)}

    def _append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with the graph's own (greedy) sampling, and how often its outputs failed to parse.

        Always in the backend's deterministic mode, so the same adapters score the same; the RNG states are
        put back afterwards, so evaluating (or not) never changes what training samples next."""
        rng, deterministic = self._rng_state(), self.backend.deterministic
        self.backend.deterministic = True
        try:
            result = await self.evaluator.run_task(self.task, store=False)
        finally:
            self.backend.deterministic = deterministic
            self._set_rng_state(rng)
        return {"accuracy/test": result.summary["accuracy"],
                "parse_error_rate/test": result.summary["parse_error_rate"],
                "parse_failed_episodes/test": mean([any(s.parse_error for s in t.steps) for t in result.traces])}

    # ---- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step-{step}"

    def _rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "backend": self.backend._rng.get_state(), "python": random.getstate()}

    def _set_rng_state(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        self.backend._rng.set_state(rng["backend"])
        random.setstate(rng["python"])

    def save(self) -> Path:
        """Write adapters (PEFT format), optimizer states, RNG states, step and data cursor of the last
        completed step; atomic rename."""
        final = self._checkpoint_dir(self.step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        adapters = sorted(set(self.trainable.values()))
        self.backend.model.save_pretrained(tmp / "adapters", selected_adapters=adapters)
        if os.environ.get(_PAUSE_ENV):
            time.sleep(float(os.environ[_PAUSE_ENV]))
        torch.save({a: opt.state_dict() for a, opt in self.algo.optimizers.items()}, tmp / "optimizer.pt")
        torch.save(self._rng, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({
            "step": self.step, "cursor": self.cursor, "train_seconds": self.train_seconds,
            "versions": {a: self.backend.versions[a] for a in adapters}, "adapters": adapters,
            "dtype": str(self.backend.dtype).removeprefix("torch.")}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (self.run_dir / "checkpoints" / "latest.tmp").write_text(final.name)
        os.replace(self.run_dir / "checkpoints" / "latest.tmp", self.run_dir / "checkpoints" / "latest")
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
                self.backend.load_adapter(name, str(path))
            except Exception as exc:  # safetensors / peft raise several kinds for a truncated or foreign file
                raise MasgraphError(f"cannot load adapter {name!r} from {path} ({type(exc).__name__}: {exc}); "
                                    f"{_EARLIER}") from exc
        optimizers, rng = (_load_torch(checkpoint / f) for f in ("optimizer.pt", "rng.pt"))
        try:
            for a in trained:
                self.algo.optimizers[a].load_state_dict(optimizers[a])
            self._set_rng_state(rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise MasgraphError(f"checkpoint {checkpoint} does not match this graph's trainer ({exc}); "
                                f"{_EARLIER}") from exc
        self._rng = self._rng_state()
        self.step = state["step"]
        self.cursor = state.get("cursor", self.step * self.cfg.queries_per_step)
        self.train_seconds = state.get("train_seconds", 0.0)
        self.backend.versions.update(state["versions"])
        _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)


    def _check_lora_shape(self, name: str, path: Path) -> None:
        """The saved adapter has the LoRA shape the graph trains: loading another shape would replace the
        parameters the optimizers hold, and training would silently stop."""
        try:
            saved = json.loads((path / "adapter_config.json").read_text())
            got = (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MasgraphError(f"cannot read {path / 'adapter_config.json'} ({exc}); {_EARLIER}") from exc
        want = (self.cfg.lora_rank, self.cfg.lora_alpha, sorted(self.cfg.lora_targets))
        if got != want:
            raise MasgraphError(
                f"adapter {name!r} in {path} has LoRA rank, alpha, targets {got} but the graph trains {want}; "
                "resume with the `train:` lora_rank / lora_alpha / lora_targets the run was started with")


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
        return torch.load(path, weights_only=False)
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
