"""The in-process transformers backend: `HFBackend` serves rollouts, `HFLearner` trains LoRA adapters on the same
weights (`HFModel`); batching, decoding, token layout, dtype choice and LoRA targets are one module each."""

from masgraph.backends.base import LoraConfigSpec
from masgraph.backends.hf.backend import HFBackend, sortable

__all__ = ["HFBackend", "LoraConfigSpec", "sortable"]
