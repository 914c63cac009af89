"""Moved to `masgraph.runtime.ray_engine`; this alias keeps old imports working for one release."""

import sys

from masgraph.runtime import ray_engine as _moved

sys.modules[__name__] = _moved
