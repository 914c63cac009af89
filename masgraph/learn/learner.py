"""The learner: owns the trainable adapter weights, their versions and RNG state, apart from whatever serves rollouts.

A trainer computes logprobs and steps optimizers through a `Learner`; rollout backends only `complete()`. After an
update, `WeightSync` publishes each adapter's new version to the backends that serve rollouts: in process (the hf
backend on the learner's own model) that is a version bump; a vLLM server would load the saved PEFT directory by
name, Ray workers would take the state dict. This module imports no torch: tensors appear only as `Any`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from masgraph.backends.base import AdapterSource, LoraConfigSpec, SyncedBackend, TokenRow

__all__ = ["AdapterSource", "Learner", "LoraConfigSpec", "SavedAdapter", "TokenRow", "WeightSync", "publish"]


class Learner(Protocol):
    """Trainable LoRA adapters on one base model: logprobs, parameters, versions, checkpoints, RNG state.

    Example:
        >>> learner = HFLearner("smollm2-135m")
        >>> learner.add_adapter("planner", LoraConfigSpec(rank=8))
        >>> logps = learner.sequence_logprobs(rows, "planner")    # one (completion length,) tensor per row
        >>> learner.new_version("planner")                        # after the optimizer step
    """

    dtype: str
    """The weights' dtype name; a checkpoint records it so a resumed run loads the same."""

    def adapters(self) -> list[str]: ...

    def add_adapter(self, name: str, lora: LoraConfigSpec) -> None:
        """Attach a fresh (zero-effect) LoRA adapter at version 0."""
        ...

    def parameters(self, adapter: str) -> list[Any]:
        """The adapter's trainable tensors (what its optimizer steps)."""
        ...

    def sequence_logprobs(self, rows: Sequence[TokenRow], adapter: str | None) -> list[Any]:
        """Per-token logprobs of each row's completion (teacher-forced, at the row's temperature) under `adapter`,
        or under the reference (adapters off) when it is None; differentiable unless called under no_grad."""
        ...

    def train(self, mode: bool = True) -> None:
        """Training mode (dropout on) or, with False, evaluation mode."""
        ...

    def version(self, adapter: str) -> int: ...

    def new_version(self, adapter: str) -> int:
        """Mark the adapter's current weights as a new policy version (after an update); returns it."""
        ...

    def source(self, adapter: str) -> AdapterSource: ...

    def save(self, path: str, adapters: Sequence[str]) -> None:
        """Write `adapters` in PEFT format, one directory each under `path`."""
        ...

    def load_adapter(self, name: str, path: str, version: int | None = None) -> None:
        """Load a saved PEFT directory in the LoRA shape of its own adapter_config.json, strictly (every weight,
        no stray key), as `version` (default: the next one)."""
        ...

    def rng_state(self) -> dict[str, Any]: ...

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore `rng_state()`; keys it does not own are ignored."""
        ...


@dataclass
class SavedAdapter:
    """An adapter saved as a PEFT directory, offered as an `AdapterSource` (a checkpoint's, to rollout backends)."""

    path: Path
    home: object = None

    def save(self, path: str) -> str:
        out = Path(path) / self.path.name
        shutil.copytree(self.path, out, dirs_exist_ok=True)
        return str(out)

    def state_dict(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(self.path / "adapter_model.safetensors")


def publish(learner: Learner, backends: Iterable[SyncedBackend], adapters: Iterable[str]) -> None:
    """Make every backend serve the learner's current version of each of `adapters`."""
    backends = list(backends)
    for name in adapters:
        version, source = learner.version(name), learner.source(name)
        for backend in backends:
            backend.publish(name, version, source)


class WeightSync:
    """Keeps rollout backends serving a learner's latest adapter versions.

    Example:
        >>> sync = WeightSync(learner, [backend])
        >>> sync()              # publishes every adapter whose version moved since the last call
        >>> sync(force=True)    # every adapter (after loading weights from a checkpoint)
    """

    def __init__(self, learner: Learner, backends: Iterable[SyncedBackend]):
        self.learner = learner
        self.backends: list[SyncedBackend] = []
        for b in backends:  # one backend given twice is published to once
            if all(b is not seen for seen in self.backends):
                self.backends.append(b)
        self.published: dict[str, int] = {}

    def __call__(self, force: bool = False) -> list[str]:
        """Publish the adapters whose version moved (all with `force`); returns their names."""
        moved = [a for a in self.learner.adapters()
                 if force or self.published.get(a) != self.learner.version(a)]
        publish(self.learner, self.backends, moved)
        self.published.update({a: self.learner.version(a) for a in moved})
        return moved
