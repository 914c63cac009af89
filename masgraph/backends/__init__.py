"""Backends serve completions to policies; one module per backend, registered through the `masgraph.plugins`
entry point (masgraph.backends.kinds)."""

from masgraph.backends.base import Backend, BackendError, Completion, Request

__all__ = ["Backend", "BackendError", "Completion", "Request"]
