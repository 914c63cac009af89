"""Moved to `masgraph.rundir.store`; this alias keeps old imports working for one release."""

import sys

from masgraph.rundir import store as _moved

sys.modules[__name__] = _moved
