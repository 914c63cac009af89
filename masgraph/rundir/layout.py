"""Every name in a run directory, in one place (readers and writers all take them from here).

    RUN/
      spec.yaml           the graph as run          config.json    the resolved run/train config, argv, versions
      events.jsonl        one event a line          episodes.jsonl the episode index (offsets into events.jsonl)
      summary.json        written when the run ends metrics.jsonl  one line per training step (TrainStep metrics)
      checkpoints/latest  the newest complete step  checkpoints/step-N/
                                                      state.json, rng.pt, topology.pt, optimizer.pt, adapters/<name>/
"""

from __future__ import annotations

import re
from pathlib import Path

SPEC = "spec.yaml"
CONFIG = "config.json"
EVENTS = "events.jsonl"
INDEX = "episodes.jsonl"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
"""In checkpoints/: the name of the newest complete step directory."""
STATE = "state.json"
"""In a checkpoint: the loop's position (trainers/checkpoints.py TrainState); written last, it marks a complete
one."""
ADAPTERS = "adapters"
"""In a checkpoint: one PEFT directory per trained adapter."""
BEHAVIOUR = "behaviour"
"""In a checkpoint of a run whose rollouts overlap the update (`train.max_staleness: 1`): one PEFT directory per
trained adapter, as the next step's rollouts decode with it (the version before the step's own)."""
RNG_FILE = "rng.pt"
TOPOLOGY_FILE = "topology.pt"
"""In a checkpoint of topology training: the topology policy's parameters and version, its optimizer state and
baseline (`HRPO.state_dict`)."""
STEP_DIR = re.compile(r"step-(\d+)")
"""A checkpoint directory's name (a `.tmp` suffix marks one being written)."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    """RUN/checkpoints/step-N."""
    return Path(run_dir) / CHECKPOINTS / f"step-{step}"


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` looks like a run directory (any of the files a run writes first)."""
    return any((Path(path) / name).exists() for name in (CONFIG, EVENTS, METRICS))
