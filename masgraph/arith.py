"""Moved to `masgraph.tasks.arith`; this alias keeps old imports working for one release."""

import sys

from masgraph.tasks import arith as _moved

sys.modules[__name__] = _moved
