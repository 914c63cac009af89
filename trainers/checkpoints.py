"""A training run's checkpoints: the one writer and reader of what an exact resume needs.

    RUN/checkpoints/step-N/
        state.json        `TrainState`: step, data cursor, training time, adapter names and versions, dtype
        adapters/<name>/  each trained adapter (PEFT format)
        behaviour/<name>/ with `max_staleness: 1`: each adapter as the next step's rollouts decode with it
        rng.pt            the learner's RNG states as of the step
        <part>.pt         each algorithm part's `state_dict()` (Flow-GRPO: optimizer.pt; HRPO: topology.pt)
    RUN/checkpoints/latest   the name of the newest complete step dir

A step dir is built beside its final name and renamed in, then `latest` is replaced atomically, so a kill at any
moment leaves the previous checkpoint whole. Every torch file is read with `weights_only=True`: a checkpoint is
data, and loading one never runs code from the run directory.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field

from masgraph.backends.hf.adapter_shape import read_lora_shape
from masgraph.errors import MasgraphError
from masgraph.files import atomic_write
from masgraph.learn.learner import Learner
from masgraph.rundir.checkpoint import AdapterName, CheckpointState, checkpoint_adapters, load_state
from masgraph.rundir.layout import ADAPTERS, BEHAVIOUR, CHECKPOINTS, LATEST, RNG_FILE, STATE, STEP_DIR, step_dir
from masgraph.rundir.read import parse_json
from masgraph.trainers.algorithm import TrainAlgorithm

__all__ = ["Checkpoints", "TrainState", "check_lora_shapes", "read_train_state", "truncate_metrics"]

PAUSE_ENV = "MASGRAPH_CHECKPOINT_PAUSE_S"
"""Fault injection for the crash tests: seconds to sleep in the middle of writing a checkpoint."""
EARLIER = "resume from an earlier checkpoint (RUN/checkpoints/step-N) or delete this one"


class TrainState(CheckpointState):
    """The loop's position in a run (state.json of a checkpoint; the loop always writes `versions`)."""

    versions: dict[AdapterName, Annotated[int, Field(ge=0)]]
    """Adapter -> its version (how many updates changed it)."""
    behaviour: dict[AdapterName, Annotated[int, Field(ge=0)]] | None = None
    """With rollouts that overlap the update: adapter -> the version the next step's rollouts decode with (saved in
    behaviour/); None when they decode with `versions`."""


class Checkpoints:
    """RUN/checkpoints: save the last completed step, load one back."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / CHECKPOINTS

    def step_dir(self, step: int) -> Path:
        return step_dir(self.root.parent, step)

    def save(self, state: TrainState, learner: Learner, algorithm: TrainAlgorithm, rng: dict[str, Any],
             behaviour: Path | None = None) -> Path:
        """Write step `state.step` (adapters, RNG, every algorithm part's state, then state.json) and point
        `latest` at it; returns its directory. `behaviour`: a directory of the adapters the next step's rollouts
        decode with (`state.behaviour`'s versions), copied in."""
        final = self.step_dir(state.step)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        learner.save(str(tmp / ADAPTERS), state.adapters)
        if behaviour is not None:
            shutil.copytree(behaviour, tmp / BEHAVIOUR)
        if os.environ.get(PAUSE_ENV):
            time.sleep(float(os.environ[PAUSE_ENV]))
        torch.save(rng, tmp / RNG_FILE)
        for part in algorithm.parts():
            torch.save(part.state_dict(), tmp / part.state_file)
        atomic_write(tmp / STATE, state.model_dump_json())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write(self.root / LATEST, final.name)
        return final

    def drop_superseded(self, step: int, keep_every: int) -> None:
        """Delete the complete checkpoints before `step` that are not every `keep_every`th step: `step`'s
        checkpoint (written first) supersedes them. Half-written `.tmp` ones are replaced when their step is saved."""
        for d in self.root.glob("step-*"):
            named = STEP_DIR.fullmatch(d.name)
            if named and int(named.group(1)) < step and int(named.group(1)) % keep_every:
                shutil.rmtree(d, ignore_errors=True)

    def behaviour(self, checkpoint: Path, state: TrainState) -> dict[str, Path]:
        """The adapters the next step's rollouts decode with, saved in the checkpoint (empty: they decode with the
        checkpoint's own adapters)."""
        return checkpoint_adapters(checkpoint, folder=BEHAVIOUR) if state.behaviour is not None else {}

    def load(self, checkpoint: Path, learner: Learner, algorithm: TrainAlgorithm, trained: list[str],
             config: Any, n_items: int | None = None) -> TrainState:
        """Restore adapters (weights and versions), every algorithm part's state and the RNG states; returns the
        position to resume from. `config` (the `train:` section) gives the LoRA shape the adapters must have and
        the steps the run may reach, `n_items` the training items its data cursor may reach. A checkpoint that is
        corrupt, incomplete, of another graph or past this run's end is a MasgraphError naming what is wrong
        (nothing is half-applied to the algorithm's state before its files are read)."""
        state = read_train_state(checkpoint)
        if state.step > config.steps:
            raise MasgraphError(f"checkpoint {checkpoint} is at step {state.step}, past this run's {config.steps} "
                                f"steps; resume with --steps {state.step} or more, or from an earlier checkpoint")
        if n_items is not None and state.cursor is not None and state.cursor > n_items:
            raise MasgraphError(f"checkpoint {checkpoint}: state.json's data cursor {state.cursor} is past the "
                                f"{n_items} training items this run draws; resume with the run's own settings "
                                f"(steps, queries_per_step), or {EARLIER}")
        if state.adapters != trained:
            raise MasgraphError(f"checkpoint {checkpoint} holds adapters {state.adapters} but this graph trains "
                                f"{trained}; resume with the graph the run was trained with")
        adapters = checkpoint_adapters(checkpoint)
        check_lora_shapes(adapters, config, learner)
        parts = {part.state_file: load_torch(checkpoint / part.state_file) for part in algorithm.parts()}
        rng = load_torch(checkpoint / RNG_FILE)
        for name, path in adapters.items():
            try:
                learner.load_adapter(name, str(path), version=state.versions.get(name))
            except Exception as exc:  # safetensors / peft raise several kinds for a truncated or foreign file
                raise MasgraphError(f"cannot load adapter {name!r} from {path} ({type(exc).__name__}: {exc}); "
                                    f"{EARLIER}") from exc
        for part in algorithm.parts():
            try:
                part.load_state_dict(parts[part.state_file])
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
                raise MasgraphError(f"{checkpoint / part.state_file} does not match this graph's "
                                    f"{type(part).__name__} ({exc}); {EARLIER}") from exc
        try:
            learner.set_rng_state(rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise MasgraphError(f"{checkpoint / RNG_FILE} holds no RNG states this learner takes ({exc}); "
                                f"{EARLIER}") from exc
        return state


def check_lora_shapes(adapters: dict[str, Path], config: Any, learner: Learner) -> None:
    """Each saved adapter (name -> its PEFT directory) has the LoRA shape the graph trains (`config`: its `train:`
    section): loading another shape would replace the parameters the optimizers hold, and training would silently
    stop. Targets are
    compared with what the graph's `lora_targets` resolved to on this model, as the attached adapter records them
    (Phi3's `qkv_proj` for q_proj/v_proj; `all-linear` expanded to module names), which is what a checkpoint
    saves."""
    if not hasattr(config, "lora_rank"):  # a topology-only algorithm: its untrained adapters load in their own shape
        return

    def sort(targets: Any) -> Any:  # peft keeps a list of names, or one regex string
        return sorted(targets) if isinstance(targets, (list, tuple, set)) else targets

    for name, path in adapters.items():
        try:
            got = read_lora_shape(path).key
        except MasgraphError as exc:
            raise MasgraphError(f"{exc}; {EARLIER}") from None
        targets = config.lora_targets
        if hasattr(learner, "lora_targets") and name in learner.adapters():
            targets = learner.lora_targets(name)  # resolved on this architecture
        want = (config.lora_rank, config.lora_alpha, sort(targets))
        if got != want:
            raise MasgraphError(
                f"adapter {name!r} in {path} has LoRA rank, alpha, targets {got} but the graph trains {want}; "
                "resume with the `train:` lora_rank / lora_alpha / lora_targets the run was started with")


def read_train_state(checkpoint: Path) -> TrainState:
    """A checkpoint's state.json as a `TrainState`, or a MasgraphError naming each bad field with the fix."""
    return load_state(checkpoint, TrainState)


def load_torch(path: Path) -> Any:
    """A torch file of a checkpoint, as data only (`weights_only`: no pickled code runs), onto the CPU whatever
    device saved it (optimizer states follow their parameters when loaded)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # missing, truncated, not a torch file, or holding objects that are not plain data
        raise MasgraphError(f"cannot load {path} ({type(exc).__name__}: {str(exc)[:300]}); {EARLIER}") from exc


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the metric lines of steps after `step` (they are redone) and a torn last line, atomically. Lines that
    are not a step's record (not JSON, no integer step) are kept: they are nobody's to delete."""
    if not path.exists():
        return
    keep = [line for line in path.read_text(errors="replace").splitlines(keepends=True)
            if line.endswith("\n") and not _after(line, step)]
    atomic_write(path, "".join(keep), durable=False)


def _after(line: str, step: int) -> bool:
    try:
        record = parse_json(line)
    except ValueError:
        return False
    s = record.get("step") if isinstance(record, dict) else None
    return isinstance(s, int) and not isinstance(s, bool) and s > step
