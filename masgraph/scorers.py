"""Moved to `masgraph.tasks.scorers`; this alias keeps old imports working for one release."""

import sys

from masgraph.tasks import scorers as _moved

sys.modules[__name__] = _moved
