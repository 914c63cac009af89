"""The in-process transformers backend: `HFBackend` serves rollouts, `HFLearner` trains LoRA adapters on the same
weights (`HFModel`); batching, decoding, token layout, dtype choice and LoRA targets are one module each.

`HFBackend` loads on first use, so a process that needs one part (the dtype choice, say) does not import
transformers and peft with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from masgraph.backends.base import LoraConfigSpec

if TYPE_CHECKING:
    from masgraph.backends.hf.backend import HFBackend, sortable

__all__ = ["HFBackend", "LoraConfigSpec", "sortable"]


def __getattr__(name: str) -> Any:
    if name in ("HFBackend", "sortable"):
        from masgraph.backends.hf import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
