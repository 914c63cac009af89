"""Moved to `masgraph.runtime.scheduler`; this alias keeps old imports working for one release."""

import sys

from masgraph.runtime import scheduler as _moved

sys.modules[__name__] = _moved
