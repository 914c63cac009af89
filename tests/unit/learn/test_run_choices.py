"""The processes of one training run compute with the driver's measured choices, never their own: a Ray rollout
worker decodes in the learner's dtype and with the driver's fp32 linear kernel. Measured per process (another thread
count, another machine) a choice can differ: CI's fresh cache once chose bf16 at 1 thread and fp32 at 2, and the
worker decoded in fp32 what the learner trained in bf16. The workers' side runs in the Ray run of
tests/integration/test_max_staleness.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from masgraph.backends.hf import onednn
from masgraph.errors import MasgraphError
from masgraph.graph import GraphBuilder
from masgraph.learn.serving import _learner_dtype, _learner_env
from masgraph.runtime.ray_engine import RayConfig


def _graph(tiny, pinned: str = "auto"):
    return (GraphBuilder("choices")
            .add_policy("auto", backend="hf", model=str(tiny), adapter="a", trainable=True)
            .add_policy("pinned", backend="hf", model=str(tiny), dtype=pinned)
            .add_policy("script", backend="scripted")
            .add_node("draft", role="generator", policy="auto")
            .add_node("check", role="generator", policy="pinned")
            .add_node("answer", role="generator", policy="script")
            .add_edge("draft", "check").add_edge("check", "answer").compile())


def test_the_workers_graph_decodes_auto_hf_policies_in_the_learners_dtype(tiny):
    graph = _graph(tiny, pinned="float32")
    pinned = _learner_dtype(graph, SimpleNamespace(dtype="bfloat16")).spec.policies
    assert pinned["auto"].dtype == "bfloat16"
    assert pinned["pinned"].dtype == "float32"  # the user's pin stands
    assert pinned["script"] == graph.spec.policies["script"]
    assert _learner_dtype(graph, SimpleNamespace()) is graph  # a learner without weights of its own: nothing to pin


@pytest.fixture
def kernel_env(monkeypatch):
    """`onednn.use` writes the environment; registered here first so it is restored after the test."""
    monkeypatch.setenv(onednn.ENV, "")
    onednn.kernel.cache_clear()
    yield
    onednn.kernel.cache_clear()


def test_use_overrides_the_measured_kernel_here_and_for_the_processes_started_after(kernel_env, monkeypatch,
                                                                                     tmp_path):
    monkeypatch.setenv("MASGRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "_measure", lambda: "onednn")
    assert onednn.kernel() == "onednn"
    onednn.use("blas")
    assert onednn.kernel() == "blas"
    assert os.environ[onednn.ENV] == "blas"  # what a child process reads
    with pytest.raises(MasgraphError, match="expected one of"):
        onednn.use("mkl")


def test_the_workers_start_with_a_cpu_learners_kernel(kernel_env, monkeypatch):
    monkeypatch.setenv(onednn.ENV, "blas")  # this process's choice
    onednn.kernel.cache_clear()
    config = RayConfig(workers=2, env=(("OTHER", "1"),))
    cpu = _learner_env(config, SimpleNamespace(device=torch.device("cpu")))
    assert cpu.env == (("OTHER", "1"), (onednn.ENV, "blas")) and cpu.workers == 2
    assert _learner_env(config, SimpleNamespace(device=torch.device("cuda", 0))) is config  # no CPU kernel to pin
    assert _learner_env(config, SimpleNamespace()) is config
