"""The real embedded model (SmolLM2-135M-Instruct), loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf():
    from masgraph.backends.hf import HFBackend

    return HFBackend("smollm2-135m", max_batch_size=16)
