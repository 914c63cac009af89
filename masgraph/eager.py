"""Moved to `masgraph.runtime.eager`; this alias keeps old imports working for one release."""

import sys

from masgraph.runtime import eager as _moved

sys.modules[__name__] = _moved
