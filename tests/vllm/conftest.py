"""The vLLM tier (`make test-vllm`): real vLLM servers started from the vLLM venv (`make vllm`)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_py() -> str:
    """The python with vLLM (fails the test with the fix when there is none)."""
    return vllm_python()


def vllm_python() -> str:
    from masgraph.backends.vllm_server import vllm_python as find

    python = find()
    if python == sys.executable or not Path(python).exists():
        pytest.fail("vLLM is not installed: run `make test-vllm` (it builds .venv-vllm with `make vllm`), or set "
                    "$MASGRAPH_VLLM_PYTHON to a python that has vLLM")
    return python


@pytest.fixture(scope="session")
def vllm_fp32(tmp_path_factory):
    """One fp32 vLLM server for the session (fp32: the exactness checks compare at 1e-3)."""
    from masgraph.backends.vllm import VLLMBackend

    vllm_python()  # fails with the fix when vLLM is not installed
    backend = VLLMBackend("smollm2-135m", dtype="float32", log_dir=tmp_path_factory.mktemp("vllm"))
    yield backend
    asyncio.run(backend.aclose())
