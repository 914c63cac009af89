"""Moved to `masgraph.rundir.plot`; this alias keeps old imports working for one release."""

import sys

from masgraph.rundir import plot as _moved

sys.modules[__name__] = _moved
