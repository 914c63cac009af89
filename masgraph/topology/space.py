"""Moved to `masgraph.graph.space`; this alias keeps old imports working for one release."""

import sys

from masgraph.graph import space as _moved

sys.modules[__name__] = _moved
