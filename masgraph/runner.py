"""Moved to `masgraph.runtime.runner`; this alias keeps old imports working for one release."""

import sys

from masgraph.runtime import runner as _moved

sys.modules[__name__] = _moved
