"""metrics.jsonl: one JSON line per training step (`{"step": ..., **metrics}`), written by a sink."""

from __future__ import annotations

import json
from pathlib import Path

from masgraph.events import Event, TrainStep


class MetricsSink:
    """Appends each `TrainStep` to a metrics.jsonl file (what `masgraph plot` and the benchmarks read).

    The file is opened per line, so a resume that rewrites it (dropping redone steps) is never written past.

    Example:
        >>> sink = MetricsSink(run_dir / "metrics.jsonl")
        >>> sink.emit(TrainStep(step=1, metrics={"reward/mean": 0.5}))   # {"step": 1, "reward/mean": 0.5}
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def emit(self, event: Event) -> None:
        if isinstance(event, TrainStep):
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": event.step, **event.metrics}) + "\n")
