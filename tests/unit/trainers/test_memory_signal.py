"""benchmarks/memory_signal.py reads each training step's credit lines once, from the attempt that trained;
replay_step.py refuses a step the run cannot give before any model loads."""

from __future__ import annotations

import json

import pytest


def _attempt(step: int, episodes: list[str], credited: int) -> list[dict]:
    """One attempt at a step as the loop logs it: its rollouts start, then a credit line per credited episode."""
    return ([{"kind": "episode_started", "episode_id": e} for e in episodes]
            + [{"kind": "credit", "step": step, "episode_id": e} for e in episodes[:credited]])


def test_a_step_killed_while_writing_its_credit_lines_counts_only_its_redone_attempt(tmp_path, memory_signal):
    lines = (_attempt(1, ["a1", "a2"], 2) + [{"kind": "train_step", "step": 1}]
             + _attempt(2, ["b1", "b2", "b3"], 2)  # killed -9 after two of three credit lines
             + _attempt(2, ["c1", "c2", "c3"], 3) + [{"kind": "train_step", "step": 2}]  # resumed: step 2 redone
             + _attempt(3, ["d1"], 1))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    got = [(e["step"], e["episode_id"]) for e in memory_signal.credit_lines(tmp_path)]
    assert got == [(1, "a1"), (1, "a2"), (2, "c1"), (2, "c2"), (2, "c3"), (3, "d1")]  # HEAD: b1 and b2 as well


def test_replaying_a_step_the_run_cannot_give_is_an_error_before_any_model_loads(tmp_path, root, replay_step):
    from masgraph.errors import MasgraphError

    run = tmp_path / "run"
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {"task": "memory_updates",
                                                            "train": {"seed": 0, "eval_n": 4}}}))
    (run / "spec.yaml").write_text((root / "graphs" / "memory.yaml").read_text())
    (run / "checkpoints" / "step-1" / "state.json").write_text('{"step": 1, "adapters": ["memory"]}')
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _attempt(1, ["a1"], 1)))
    with pytest.raises(MasgraphError, match="checkpoint .*step-2 does not exist"):
        replay_step.replay(run, 3, {})  # no checkpoint before step 3
    with pytest.raises(MasgraphError, match="has no credit lines for step 2"):
        replay_step.replay(run, 2, {})  # step 1's rollouts only
