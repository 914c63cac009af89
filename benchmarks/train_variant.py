"""`masgraph train` on a graph with some `train:` keys changed, in its own process: what the benchmarks that compare
training settings arm by arm (overlap.py, learner_steps.py) run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def train_variant(graph: Path, train: Mapping[str, Any], runs: Path, *, steps: int, queries: int, seed: int,
                  task: str | None = None, more: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Path:
    """Train `graph` with its `train:` keys set as `train` says (a dotted key reaches into a section:
    `flow_grpo.group_size`) for `steps` steps of `queries` queries, evaluating only at the end on 1 item; the run
    directory under `runs`. The variant is written beside the graph, so its relative paths (prompts, tools, data)
    resolve as they do for the graph, and deleted afterwards. A failed run ends the benchmark with its stderr."""
    spec = yaml.safe_load(graph.read_text())
    for key, value in train.items():
        *sections, last = f"train.{key}".split(".")
        node = spec
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    fd, name = tempfile.mkstemp(prefix=".variant-", suffix=".yaml", dir=graph.parent)
    os.close(fd)
    variant = Path(name)
    try:
        variant.write_text(yaml.safe_dump(spec, sort_keys=False))
        cmd = [sys.executable, "-m", "masgraph", "train", str(variant), "--steps", str(steps), "--queries-per-step",
               str(queries), "--eval-every", "0", "--eval-n", "1", "--seed", str(seed), "--runs-dir", str(runs),
               *(["--task", task] if task else []), *more]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    finally:
        variant.unlink(missing_ok=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(f'{k}={v}' for k, v in train.items())} {' '.join(more)} failed:\n"
                         f"{done.stderr[-3000:]}")
    [run] = list(runs.iterdir())
    return run
