"""Moved to `masgraph.serve.server`; this alias keeps old imports working for one release."""

import sys

from masgraph.serve import server as _moved

sys.modules[__name__] = _moved
