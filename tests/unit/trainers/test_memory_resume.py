"""benchmarks/memory.py --resume: which stopped runs it continues, with what, and which it refuses before any model
loads (not a run, another task or clock, other held-out items, no checkpoint, the budget already spent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from masgraph.errors import MasgraphError


def _run(tmp_path: Path, spent_s: float = 1800.0, checkpoint: bool = True, **train: object) -> Path:
    """A run directory as benchmarks/memory.py leaves it (config.json, spec.yaml, a checkpoint's state.json)."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = {"seed": 2, "budget_clock": "cpu", "eval_n": 60,
           "flow_grpo": {"group_size": 8, "lr": 0.0003, "ppo": {"num_mini_batches": 12},
                         "credit": {"advantage": "episode+step"}}}
    cfg |= train
    task = cfg.pop("task", "memory_updates")
    (run / "config.json").write_text(json.dumps({"config": {"train": cfg, "task": task}}))
    (run / "spec.yaml").write_text("name: memory\n")
    if checkpoint:
        step = run / "checkpoints" / "step-3"
        step.mkdir(parents=True)
        state = {"step": 3, "train_seconds": spent_s, "versions": {"memory": 3}, "adapters": ["memory"]}
        (step / "state.json").write_text(json.dumps(state))
    return run


def test_a_stopped_run_continues_with_its_own_seed_graph_and_knobs(tmp_path, memory_bench):
    run = _run(tmp_path)
    job = memory_bench.resumable(run, minutes=60, eval_n=60)
    assert (job.seed, job.graph, job.resume, job.overrides) == (2, str(run / "spec.yaml"), run, {})
    # the record names the knobs that differ from flow_grpo's defaults (group_size 8 is the default)
    assert job.knobs == ("lr=0.0003", "ppo.num_mini_batches=12", "credit.advantage=episode+step")


def test_an_older_runs_flat_knobs_are_named_in_their_sections(tmp_path, memory_bench):
    flat = {"group_size": 8, "lr": 0.0003, "num_mini_batches": 12, "advantage": "episode+step"}
    job = memory_bench.resumable(_run(tmp_path, flow_grpo=flat), minutes=60, eval_n=60)
    assert job.knobs == ("lr=0.0003", "credit.advantage=episode+step", "ppo.num_mini_batches=12")


@pytest.mark.parametrize(("change", "says"), [
    ({"spent_s": 3600.0}, "has spent 60.0 CPU-min already"),
    ({"spent_s": 4000.0}, "has spent 66.7 CPU-min already"),
    ({"task": "lookup"}, "trained on 'lookup'"),
    ({"budget_clock": "wall"}, "on the wall clock"),
    ({"eval_n": 30}, "scored on 30 held-out items, not 60; pass --eval-n 30"),
])
def test_a_run_it_cannot_continue_fairly_is_refused_saying_why(tmp_path, memory_bench, change, says):
    with pytest.raises(ValueError, match=says):
        memory_bench.resumable(_run(tmp_path, **change), minutes=60, eval_n=60)


def test_not_a_run_or_no_checkpoint_is_refused(tmp_path, memory_bench):
    with pytest.raises(ValueError, match="not a training run directory"):
        memory_bench.resumable(tmp_path, minutes=60, eval_n=60)
    with pytest.raises(MasgraphError, match="no complete checkpoint"):
        memory_bench.resumable(_run(tmp_path, checkpoint=False), minutes=60, eval_n=60)
