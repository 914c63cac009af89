"""Moved to `masgraph.rundir.metrics`; this alias keeps old imports working for one release."""

import sys

from masgraph.rundir import metrics as _moved

sys.modules[__name__] = _moved
