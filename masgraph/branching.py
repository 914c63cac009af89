"""Moved to `masgraph.learn.branching`; this path re-exports it for one release."""

from masgraph.learn.branching import *  # noqa: F403
