"""Moved to `masgraph.learn.learner`; this path re-exports it for one release."""

from masgraph.learn.learner import *  # noqa: F403
