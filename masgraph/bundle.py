"""Moved to `masgraph.serve.bundle`; this alias keeps old imports working for one release."""

import sys

from masgraph.serve import bundle as _moved

sys.modules[__name__] = _moved
