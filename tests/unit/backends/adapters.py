"""Test helper: an adapter that changes what the model says."""

from __future__ import annotations

import torch

from masgraph.backends.hf import HFBackend


def perturbed(backend: HFBackend, name: str, seed: int) -> None:
    """Add adapter `name` to `backend` with a LoRA B that is not zero (a new adapter's is), so it changes the output."""
    backend.add_adapter(name)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in backend.weights.model.named_parameters():
            if f"lora_B.{name}." in key:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
