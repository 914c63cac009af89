"""What serves a training run: the backend its rollouts decode on and the one its held-out evaluation decodes on,
both serving the learner's adapters, built in one place from the registry's backend kinds, on the learner's device.

A trainer then talks only to a learner and a weight-sync step (`WeightSync(learner, [serving.rollouts,
serving.evaluation])`); which backend kind, which server, which Ray workers serve it is decided here.

Example:
    >>> serving = serve_learner(graph.spec, learner, train_graph, seed=0, run_dir=Path("runs/x"))
    >>> WeightSync(learner, [serving.rollouts, serving.evaluation])()
    >>> await serving.aclose()       # a vLLM server or Ray workers started here
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from masgraph.errors import MasgraphError
from masgraph.registry import Registry, default_registry

__all__ = ["Serving", "local_learner", "rollout_kind", "serve_learner"]

if TYPE_CHECKING:
    from masgraph.backends.base import SyncedBackend
    from masgraph.graph import Graph
    from masgraph.learn.learner import Learner
    from masgraph.runtime.ray_engine import RayConfig
    from masgraph.spec import GraphSpec, PolicySpec


@dataclass
class Serving:
    """The backends of one training run, and what of them was started here (closed by `aclose`)."""

    rollouts: SyncedBackend
    """What training rollouts decode on: what the weight-sync step publishes each new adapter version to."""
    evaluation: SyncedBackend
    """What held-out evaluation decodes on (in process: a deterministic view of the learner's own weights)."""
    ray_engine: Any = None
    """The Ray engine when rollouts run on Ray workers (the runner schedules episodes through it)."""
    owned: list[Any] = field(default_factory=list)
    """Started here: a vLLM server's backend, Ray workers."""

    async def aclose(self) -> None:
        for part in self.owned:
            await part.aclose()
        self.owned.clear()


def rollout_kind(spec: GraphSpec, registry: Registry | None = None) -> str:
    """The backend kind that serves the trained policies' rollouts: the first trainable policy's, when its kind can
    serve a learner's adapters; else hf (a run that trains only the topology serves its hf policies in process)."""
    kinds = (registry or default_registry()).backends
    for p in spec.policies.values():
        if p.trainable and p.backend in kinds and kinds[p.backend].for_learner is not None:
            return p.backend
    return "hf"


def serve_learner(spec: GraphSpec, learner: Learner, graph: Graph, *, seed: int = 0, deterministic: bool = False,
                  run_dir: str | Path | None = None, max_lora_rank: int = 16, ray: RayConfig | None = None,
                  rollouts: SyncedBackend | None = None, evaluation: SyncedBackend | None = None,
                  registry: Registry | None = None, apart: bool = False, batch: int = 32) -> Serving:
    """The backends that serve `learner`'s adapters to a run of `graph` (the graph as training rolls it out).

    Given `rollouts` (and optionally `evaluation`), those are used as they are. Otherwise rollouts run on Ray
    workers with `ray`, else on the trained policies' backend kind (its `for_learner` factory: in process on the
    learner's weights for hf, a vLLM server for vllm); evaluation decodes deterministically in process on the
    learner's own weights when the learner has them, else on the rollout backend.

    `apart`: rollouts must not see the learner's weights change under them (they decode while it updates, and each
    new version reaches them only when published): in process they get their own copy of the base model, and
    evaluation may not share their backend (it scores the newest version while they decode an older one).

    `batch`: the episodes in flight (`train.concurrency`); an in-process backend, or each Ray worker's, batches up to
    that many rows (at least 32), so rollouts of more episodes than its default decode together rather than in waves.

    A learner whose base is sharded across ranks (`learner.sharded`) cannot decode in one process: in-process
    rollouts and evaluation then decode on a copy of the base of their own (one copy for both unless `apart`); with
    Ray workers evaluation decodes on them too (on rank 0's copy only when `apart`)."""
    registry = registry or default_registry()
    sharded = bool(getattr(learner, "sharded", False))
    if rollouts is not None and ray is not None:
        raise MasgraphError("pass either `ray` (rollouts on Ray workers) or a rollout backend, not both")
    if rollouts is not None:
        if apart and getattr(rollouts, "weights", None) is getattr(learner, "weights", rollouts):
            raise MasgraphError("rollouts that overlap the update (train.max_staleness: 1) cannot decode on the "
                                "learner's own weights (it changes them meanwhile): give a backend with its own copy")
        return _apart(Serving(rollouts, evaluation or rollouts), apart)
    in_process = registry.backends["hf"].for_learner
    max_batch_size = max(32, batch)
    options = {"deterministic": deterministic, "seed": seed, "log_dir": str(run_dir) if run_dir else None,
               "max_lora_rank": max_lora_rank, "max_batch_size": max_batch_size}
    if ray is not None:  # rollouts on Ray workers, each its own replica; the learner and evaluation stay here
        from masgraph.runtime.engine import BackendOptions
        from masgraph.runtime.ray_engine import RayEngine

        engine = RayEngine(_learner_dtype(graph, learner), _learner_env(ray, learner),
                           BackendOptions(deterministic, max_batch_size, seed=seed))
        served = Serving(engine.pool, evaluation or engine.pool, engine, [engine])
    else:
        kind = registry.backends[rollout_kind(spec, registry)]
        built = kind.for_learner(_served_policy(spec, kind.name), learner, **options, replica=apart or sharded)
        served = Serving(built, evaluation or built, owned=[] if kind.name == "hf" else [built])
    # the same adapters score the same, whatever the load: in process, deterministic; beside a sharded learner on a
    # copy (the rollouts' own when on-policy), or on the Ray workers, so rank 0 holds no whole copy of the base
    on_policy_copy = sharded and not apart
    if evaluation is None and _has_weights(learner) and not (on_policy_copy and ray is not None):
        copy = getattr(served.rollouts, "weights", None) if on_policy_copy else None
        served.evaluation = in_process(_served_policy(spec, "hf"), learner, **{**options, "deterministic": True},
                                       replica=sharded, weights=copy)
    return _apart(served, apart)


def _learner_dtype(graph: Graph, learner: Learner) -> Graph:
    """The graph with its `dtype: auto` hf policies in the learner's dtype, as they decode in process: a Ray worker
    measuring its own choice (another thread count, another machine) could decode in another dtype than the one
    trained in."""
    dtype = getattr(learner, "dtype", None)
    if not dtype:
        return graph
    from masgraph.graph import compile_spec

    spec = graph.spec
    policies = {n: p.model_copy(update={"dtype": dtype}) if p.backend == "hf" and p.dtype == "auto" else p
                for n, p in spec.policies.items()}
    return graph if policies == spec.policies else compile_spec(spec.model_copy(update={"policies": policies}))


def _learner_env(ray: RayConfig, learner: Learner) -> RayConfig:
    """`ray` with the workers' fp32 CPU linear kernel pinned to this process's (`masgraph/backends/hf/onednn.py`):
    measured on a worker (another thread count, another machine) it could differ, and so would the numbers."""
    if getattr(getattr(learner, "device", None), "type", None) != "cpu":
        return ray
    from masgraph.backends.hf import onednn

    return replace(ray, env=(*ray.env, (onednn.ENV, onednn.kernel())))


def _apart(served: Serving, apart: bool) -> Serving:
    if apart and served.evaluation is served.rollouts:
        raise MasgraphError("rollouts that overlap the update (train.max_staleness: 1) need evaluation on another "
                            "backend than theirs: give an in-process learner (the default), or an `eval_backend`")
    return served


def local_learner(model: str, dtype: str = "auto", device: str = "auto") -> Learner:
    """The default learner: `model`'s weights in this process (an `HFLearner`) on `device`, LoRA adapters on them."""
    from masgraph.backends.hf.learner import HFLearner

    return HFLearner(model, dtype=dtype, device=device)


def _served_policy(spec: GraphSpec, kind: str) -> PolicySpec | None:
    """The policy whose backend serves the learner: a trained one of this kind, else any of this kind."""
    mine = [p for p in spec.policies.values() if p.backend == kind]
    return next((p for p in mine if p.trainable), mine[0] if mine else None)


def _has_weights(learner: Any) -> bool:
    from masgraph.backends.hf.model import HFModel

    return isinstance(getattr(learner, "weights", None), HFModel)

