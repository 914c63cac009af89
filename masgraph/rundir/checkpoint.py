"""Checkpoint directories of a training run: find the newest complete one, read what it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

from masgraph.errors import MasgraphError
from masgraph.rundir.layout import ADAPTERS, CHECKPOINTS, LATEST, STATE, STEP_DIR, TOPOLOGY_FILE


def has_learned_topology(checkpoint: Path | None) -> bool:
    """Whether a checkpoint holds a topology policy (it comes from `algorithm: hrpo` or `joint`)."""
    return checkpoint is not None and (checkpoint / TOPOLOGY_FILE).exists()
_USAGE = "pass a `masgraph train` run directory (its latest checkpoint) or RUN/checkpoints/step-N"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (half-written `.tmp` directories are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if STEP_DIR.fullmatch(name) and (root / name / STATE).is_file():
            return root / name
    done = [p for p in root.glob("step-*") if STEP_DIR.fullmatch(p.name) and (p / STATE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def checkpoint_states(run_dir: str | Path) -> list[dict[str, Any]]:
    """The state.json of every complete checkpoint of a run, each with its `path`, oldest step first; one being
    written or broken is left out, and a state.json that is not a regular file (a FIFO) is never opened."""
    from masgraph.rundir.read import check_regular

    found = []
    for d in (Path(run_dir) / CHECKPOINTS).glob("step-*"):
        if not STEP_DIR.fullmatch(d.name):
            continue
        try:
            check_regular(d / STATE)
            state = read_state(d)
        except MasgraphError:
            continue
        if type(state.get("step")) is int and isinstance(state.get("versions", {}), dict):
            found.append(state | {"path": str(d)})
    return sorted(found, key=lambda s: s["step"])


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its latest) or a `.../checkpoints/step-N` path."""
    path = Path(path)
    if not path.exists():
        raise MasgraphError(f"checkpoint {path} does not exist; {_USAGE}")
    if not path.is_dir():
        raise MasgraphError(f"checkpoint {path} is a file, not a directory; {_USAGE}")
    if (path / STATE).is_file():
        return path
    if not (path / CHECKPOINTS).is_dir():
        raise MasgraphError(f"no complete checkpoint in {path}: it has no checkpoints/ directory; {_USAGE}")
    found = latest_checkpoint(path)
    if found is None:
        raise MasgraphError(f"no complete checkpoint in {path}/checkpoints (a step-N with a state.json); "
                            "the run was stopped before its first checkpoint: train it longer or pass another run")
    return found


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's state.json (step, adapters, versions, dtype), or a MasgraphError saying what is wrong."""
    try:
        state = json.loads((checkpoint / STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MasgraphError(f"checkpoint {checkpoint} has an unreadable state.json ({exc}); "
                            "pass another step (RUN/checkpoints/step-N)") from exc
    if not isinstance(state, dict) or not isinstance(state.get("adapters"), list):
        raise MasgraphError(f"checkpoint {checkpoint}: state.json has no `adapters` list; "
                            "pass another step (RUN/checkpoints/step-N)")
    return state


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
"""A weight dtype a learner loads (`auto`: the faster of bf16 and fp32 on this machine)."""
DTYPES: tuple[str, ...] = get_args(Dtype)


def checkpoint_dtype(checkpoint: Path) -> str:
    """The dtype a checkpoint's run trained in (a resumed run keeps it; `auto` in checkpoints older than the field),
    or a MasgraphError naming the bad value before any model loads."""
    dtype = read_state(checkpoint).get("dtype", "auto")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise MasgraphError(f"checkpoint {checkpoint}: state.json has dtype {dtype!r}, not one of {', '.join(DTYPES)}; "
                            "pass another step (RUN/checkpoints/step-N)")
    return dtype


def checkpoint_adapters(checkpoint: Path) -> dict[str, Path]:
    """Adapter name -> its saved PEFT directory (each checked to hold its config and weights)."""
    adapters = {name: checkpoint / ADAPTERS / name for name in read_state(checkpoint)["adapters"]}
    for name, path in adapters.items():
        missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (path / f).is_file()]
        if missing:
            raise MasgraphError(f"checkpoint {checkpoint} is incomplete: adapter {name!r} lacks "
                                f"{', '.join(f'adapters/{name}/{f}' for f in missing)}; pass another step "
                                "(RUN/checkpoints/step-N)")
    return adapters
