"""Moved to `masgraph.learn.counterfactual`; this path re-exports it for one release."""

from masgraph.learn.counterfactual import *  # noqa: F403
