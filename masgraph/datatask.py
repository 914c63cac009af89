"""Moved to `masgraph.tasks.data`; this alias keeps old imports working for one release."""

import sys

from masgraph.tasks import data as _moved

sys.modules[__name__] = _moved
