"""Moved to `masgraph.tasks.judge`; this alias keeps old imports working for one release."""

import sys

from masgraph.tasks import judge as _moved

sys.modules[__name__] = _moved
