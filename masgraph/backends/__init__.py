"""Backends serve completions to policies; one module per backend."""

from __future__ import annotations

from typing import Any

from masgraph.backends.base import Backend, BackendError, Completion, Request
from masgraph.errors import MasgraphError
from masgraph.spec import PolicySpec

__all__ = ["Backend", "BackendError", "Completion", "Request", "make_backend"]


def make_backend(policy: PolicySpec, **options: Any) -> Backend:
    """A backend instance for a policy (callers share one per (backend, model, api_base))."""
    if policy.backend == "hf":
        from masgraph.backends.hf import HFBackend
        return HFBackend(policy.model, **options)
    if policy.backend == "litellm":
        from masgraph.backends.litellm import LiteLLMBackend
        return LiteLLMBackend(policy.model, api_base=policy.api_base)
    raise MasgraphError(
        f"backend {policy.backend!r} (model {policy.model!r}) has no built-in instance; fix: use backend 'hf' or "
        f"'litellm', or run from Python with Runner(graph, backends={{'{policy.backend}': <instance>}})")
