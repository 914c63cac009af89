"""Moved to `masgraph.rundir.checkpoint`; this alias keeps old imports working for one release."""

import sys

from masgraph.rundir import checkpoint as _moved

sys.modules[__name__] = _moved
