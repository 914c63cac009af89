"""benchmarks/memory_signal.py reads each training step's credit lines once, from the attempt that trained."""

from __future__ import annotations

import json


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
