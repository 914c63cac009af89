"""Moved to `masgraph.runtime.engine`; this alias keeps old imports working for one release."""

import sys

from masgraph.runtime import engine as _moved

sys.modules[__name__] = _moved
