"""Finding checkpoints: the latest complete one, never a half-written `.tmp`."""

from __future__ import annotations

import json

import pytest

from masgraph.checkpoint import checkpoint_adapters, latest_checkpoint, resolve_checkpoint
from masgraph.errors import MasgraphError


def _ckpt(root, name, complete=True):
    d = root / "checkpoints" / name
    d.mkdir(parents=True)
    if complete:
        (d / "state.json").write_text(json.dumps({"step": 1, "adapters": ["planner", "verifier"]}))
    return d


def test_latest_complete_checkpoint_wins(tmp_path):
    _ckpt(tmp_path, "step-2")
    ten = _ckpt(tmp_path, "step-10")
    _ckpt(tmp_path, "step-11.tmp")  # killed mid-write
    _ckpt(tmp_path, "step-12", complete=False)
    assert latest_checkpoint(tmp_path) == ten
    (tmp_path / "checkpoints" / "latest").write_text("step-2")  # the pointer wins when it is complete
    assert latest_checkpoint(tmp_path).name == "step-2"
    assert resolve_checkpoint(ten) == ten
    assert checkpoint_adapters(ten) == {"planner": ten / "adapters" / "planner", "verifier": ten / "adapters" / "verifier"}


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(MasgraphError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)
