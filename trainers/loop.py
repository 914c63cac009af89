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
from masgraph.checkpoint import checkpoint_adapters
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


class TrainLoop:
    """Trains a graph's trainable policies on a task; the run directory holds everything needed to resume.

    Example:
        >>> loop = TrainLoop(graph, get_task("basic_arithmetic"), Path("runs/train-1"))
        >>> asyncio.run(loop.run())
    """

    def __init__(self, graph: Graph, task: Task, run_dir: Path, backend: HFBackend | None = None,
                 dtype: str = "auto"):
        if graph.spec.train is None:
            raise ValueError("the graph has no `train:` section")
        self.graph, self.task, self.run_dir = graph, task, Path(run_dir)
        self.cfg: TrainSpec = graph.spec.train
        spec = graph.spec
        torch.manual_seed(self.cfg.seed)  # LoRA init
        self.backend = backend or HFBackend(dtype=dtype, deterministic=self.cfg.deterministic, seed=self.cfg.seed)
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
                if on_step is not None:
                    on_step(last)
                if self.step % self.cfg.checkpoint_every == 0 or self.finished():
                    self.save()
        except BaseException:
            if self.step > 0 and not self._checkpoint_dir(self.step).exists():
                self.save()  # Ctrl-C (or a failure) keeps the last finished step
            raise
        finally:
            store.close({"step": self.step, **last})
        return last

    def out_of_time(self) -> bool:
        return self.cfg.max_minutes is not None and self.train_seconds >= 60 * self.cfg.max_minutes

    def finished(self) -> bool:
        return self.step >= self.cfg.steps or self.out_of_time()

    def _take(self, n: int) -> list:
        batch = self.items[self.cursor:self.cursor + n]
        self.cursor += len(batch)
        return batch

    async def _one_step(self, store: RunStore) -> dict[str, Any]:
        q, fg = self.cfg.queries_per_step, self.cfg.flow_grpo
        t0 = time.perf_counter()
        traces = (await self.rollouts.run_items(self.task, self._take(q), sinks=[store], store=False)).traces
        rounds = 0
        while fg.zero_variance == "resample" and rounds < fg.resample_rounds:
            missing = q - len(informative_queries(traces, fg))
            extra = self._take(missing) if missing > 0 else []
            if not extra:
                break
            traces += (await self.rollouts.run_items(self.task, extra, sinks=[store], store=False)).traces
            rounds += 1
        t_roll = time.perf_counter() - t0
        metrics = self.algo.update(traces)
        self.step += 1
        elapsed = time.perf_counter() - t0
        self.train_seconds += elapsed
        tokens = sum(t.completion_tokens for t in traces)
        record = {"step": self.step, **metrics, "accuracy/train": summarize(traces)["accuracy"],
                  "informative_groups": float(len(informative_queries(traces, fg))), "resample_rounds": rounds,
                  "time/rollout_s": t_roll, "time/step_s": elapsed, "time/train_s": self.train_seconds,
                  "tokens": tokens, "tokens_per_s": tokens / max(elapsed, 1e-9)}
        if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 or self.finished():
            record.update(await self.evaluate())
        self._append_metrics(record)
        return record

    def _append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with the graph's own (greedy) sampling, and how often its outputs failed to parse."""
        result = await self.evaluator.run_task(self.task, store=False)
        return {"accuracy/test": result.summary["accuracy"],
                "parse_error_rate/test": result.summary["parse_error_rate"],
                "parse_failed_episodes/test": mean([any(s.parse_error for s in t.steps) for t in result.traces])}

    # ---- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step-{step}"

    def save(self) -> Path:
        """Write adapters (PEFT format), optimizer states, RNG states, step and data cursor; atomic rename."""
        final = self._checkpoint_dir(self.step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        adapters = sorted(set(self.trainable.values()))
        self.backend.model.save_pretrained(tmp / "adapters", selected_adapters=adapters)
        if os.environ.get(_PAUSE_ENV):
            time.sleep(float(os.environ[_PAUSE_ENV]))
        torch.save({a: opt.state_dict() for a, opt in self.algo.optimizers.items()}, tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "backend": self.backend._rng.get_state(),
                    "python": random.getstate()}, tmp / "rng.pt")
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
        """Restore a checkpoint written by `save` (adapter weights, optimizers, RNG, step, versions)."""
        state = json.loads((checkpoint / "state.json").read_text())
        for name, path in checkpoint_adapters(checkpoint).items():
            self.backend.load_adapter(name, str(path))
        for a, sd in torch.load(checkpoint / "optimizer.pt", weights_only=False).items():
            self.algo.optimizers[a].load_state_dict(sd)
        rng = torch.load(checkpoint / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        self.backend._rng.set_state(rng["backend"])
        random.setstate(rng["python"])
        self.step = state["step"]
        self.cursor = state.get("cursor", self.step * self.cfg.queries_per_step)
        self.train_seconds = state.get("train_seconds", 0.0)
        self.backend.versions.update(state["versions"])
        _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines of steps after the checkpoint (they are redone), atomically."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
