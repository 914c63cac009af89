"""Checkpoint directories of a training run: find the newest complete one, read what it holds."""

from __future__ import annotations

import json
from pathlib import Path

from masgraph.errors import MasgraphError


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (half-written `.tmp` directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / "state.json").exists():
            return path
    done = [p for p in root.glob("step-*") if not p.name.endswith(".tmp") and (p / "state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its latest) or a `.../checkpoints/step-N` path."""
    path = Path(path)
    if (path / "state.json").exists():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise MasgraphError(f"no complete checkpoint in {path} (expected RUN or RUN/checkpoints/step-N)")
    return found


def checkpoint_adapters(checkpoint: Path) -> dict[str, Path]:
    """Adapter name -> its saved PEFT directory."""
    state = json.loads((checkpoint / "state.json").read_text())
    return {name: checkpoint / "adapters" / name for name in state["adapters"]}
