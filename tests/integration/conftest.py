"""The real embedded model (SmolLM2-135M-Instruct), loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf():
    from masgraph.backends.hf import HFBackend

    # fp32 pinned: the token-level checks compare incremental decoding with a teacher-forced forward
    # at 2e-2; bf16 (chosen by `dtype="auto"` on CPUs where it is faster) differs by up to ~0.1
    return HFBackend("smollm2-135m", dtype="float32", max_batch_size=16)
