"""The in-process rollout backend batches as many rows as training keeps episodes in flight: with
`train.concurrency: 64` a step's 64 rollouts decode as one batch, not as two waves of the backend's default 32
(on an H200 the 64-completion step went 73.2 -> 42.5 s: benchmarks/results/gpu.md, 2026-12-04)."""

from __future__ import annotations

from pathlib import Path

import pytest

from masgraph.backends.hf.learner import HFLearner
from masgraph.graph import compile_spec
from masgraph.learn.serving import serve_learner
from masgraph.loader import load_spec

ROOT = Path(__file__).resolve().parents[3]


def single_on(path: str, **train):
    """graphs/single.yaml with its policy on the model at `path`, `train` set on its train section."""
    spec = load_spec(ROOT / "graphs" / "single.yaml")
    return spec.model_copy(update={"policies": {"main": spec.policies["main"].model_copy(update={"model": path})},
                                   "train": spec.train.model_copy(update=train)})


@pytest.mark.parametrize(("concurrency", "rows"), [(64, 64), (8, 32)])
def test_rollouts_and_evaluation_batch_the_episodes_in_flight(tiny_model, concurrency, rows):
    path = str(tiny_model("qwen2"))
    spec = single_on(path)
    learner = HFLearner(path, dtype="float32")
    served = serve_learner(spec, learner, compile_spec(spec), batch=concurrency)
    # below the default the default stands: one episode's node may send several calls at once
    assert served.rollouts._batcher.max_batch_size == rows
    assert served.evaluation._batcher.max_batch_size == rows


def test_a_train_loop_passes_its_concurrency_to_its_backends(tiny_model, tmp_path):
    from masgraph.tasks import get_task
    from masgraph.trainers.loop import TrainLoop

    spec = single_on(str(tiny_model("qwen2")), concurrency=48)
    loop = TrainLoop(compile_spec(spec), get_task("long_arithmetic"), tmp_path)
    assert loop.backend._batcher.max_batch_size == loop.eval_backend._batcher.max_batch_size == 48


def test_ray_workers_are_told_the_batch_too(tiny_model, monkeypatch):
    """Rollouts on Ray workers: each worker's backend gets the same batch size (no Ray started: the engine is
    replaced by one that keeps what it was given)."""
    import masgraph.runtime.ray_engine as ray_engine

    given = {}

    class Kept:
        def __init__(self, graph, ray, options):
            given["options"], self.pool = options, object()

    monkeypatch.setattr(ray_engine, "RayEngine", Kept)
    path = str(tiny_model("qwen2"))
    spec = single_on(path)
    learner = HFLearner(path, dtype="float32")
    serve_learner(spec, learner, compile_spec(spec), ray=ray_engine.RayConfig(), batch=64)
    assert given["options"].max_batch_size == 64
