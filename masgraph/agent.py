"""Moved to `masgraph.serve.agent`; this alias keeps old imports working for one release."""

import sys

from masgraph.serve import agent as _moved

sys.modules[__name__] = _moved
