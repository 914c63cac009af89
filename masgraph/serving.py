"""Moved to `masgraph.learn.serving`; this path re-exports it for one release."""

from masgraph.learn.serving import *  # noqa: F403
