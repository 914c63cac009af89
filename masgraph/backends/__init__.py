"""Backends serve completions to policies; one module per backend, registered in masgraph.registry."""

from __future__ import annotations

from typing import Any

from masgraph.backends.base import Backend, BackendError, Completion, Request
from masgraph.spec import PolicySpec

__all__ = ["Backend", "BackendError", "Completion", "Request", "make_backend"]


def make_backend(policy: PolicySpec, **options: Any) -> Backend:
    """A backend instance for a policy from the process's registry (callers share one per (backend, model,
    api_base, device)); `options` the run options its kind takes (others are ignored)."""
    from masgraph.registry import default_registry

    return default_registry().backend(policy, options)
