"""Finding checkpoints: the latest complete one, never a half-written `.tmp`."""

from __future__ import annotations

import json
import re

import pytest

from masgraph.errors import MasgraphError
from masgraph.rundir.checkpoint import checkpoint_adapters, checkpoint_dtype, latest_checkpoint, resolve_checkpoint
from masgraph.trainers.checkpoints import read_train_state


def _ckpt(root, name, complete=True):
    d = root / "checkpoints" / name
    d.mkdir(parents=True)
    if complete:
        step = int(m.group(1)) if (m := re.match(r"step-(\d+)", name)) else 1
        (d / "state.json").write_text(json.dumps({"step": step, "adapters": ["planner", "verifier"]}))
        for adapter in ("planner", "verifier"):
            (d / "adapters" / adapter).mkdir(parents=True)
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                (d / "adapters" / adapter / f).write_text("{}")
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
    assert checkpoint_adapters(ten) == {"planner": ten / "adapters" / "planner",
                                        "verifier": ten / "adapters" / "verifier"}


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(MasgraphError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("garbage, message", [
    ("missing", "does not exist"),
    ("file", "is a file, not a directory"),
    ("empty dir", "has no checkpoints/ directory"),
    ("run without checkpoints", "stopped before its first checkpoint"),
    ("pointer to garbage", "stopped before its first checkpoint"),
    ("no adapter weights", "lacks adapters/verifier/adapter_model.safetensors"),
    ("bad state.json", "unreadable state.json"),
    ("state.json without adapters", "no `adapters`"),
])
def test_garbage_checkpoints_are_clear_errors(tmp_path, garbage, message):
    path = tmp_path / "x"
    if garbage == "file":
        path.write_text("hello")
    elif garbage == "empty dir":
        path.mkdir()
    elif garbage in ("run without checkpoints", "pointer to garbage"):
        _ckpt(path, "step-3", complete=False)
        _ckpt(path, "step-x")  # not a step number: ignored (HEAD: ValueError)
        (path / "checkpoints" / "latest").write_text("../../" if garbage == "pointer to garbage" else "step-3")
    elif garbage != "missing":
        path = _ckpt(tmp_path, "step-1")
        if garbage == "no adapter weights":
            (path / "adapters" / "verifier" / "adapter_model.safetensors").unlink()
        else:
            (path / "state.json").write_text("{\"step\": 1" if garbage == "bad state.json" else "{}")
    with pytest.raises(MasgraphError, match=re.escape(message)):
        checkpoint_adapters(resolve_checkpoint(path))


@pytest.mark.parametrize("dtype, want", [(None, "auto"), ("bfloat16", "bfloat16"), ("float32", "float32"),
                                         ("float99", None), (16, None), ("nn", None), (["float32"], None)])
def test_checkpoint_dtype_is_checked_before_a_model_loads(tmp_path, dtype, want):
    """A resumed run loads the dtype its checkpoint names; a hand-edited or foreign value is a located error, not
    `getattr(torch, dtype)` failing (or finding `torch.nn`) inside the model loader. The loop's reader of the same
    file (`read_train_state`) takes exactly the same values."""
    path = _ckpt(tmp_path, "step-1")
    state = {"step": 1, "adapters": ["planner", "verifier"], "versions": {},
             **({} if dtype is None else {"dtype": dtype})}
    (path / "state.json").write_text(json.dumps(state))
    if want is None:
        with pytest.raises(MasgraphError, match=re.escape(f"{path}: state.json has dtype {dtype!r}")):
            checkpoint_dtype(path)
        with pytest.raises(MasgraphError, match=re.escape(f"{path}: state.json has dtype {dtype!r}")):
            read_train_state(path)
    else:
        assert checkpoint_dtype(path) == want
        assert read_train_state(path).dtype == want
