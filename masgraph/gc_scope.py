"""Moved to `masgraph.runtime.gc_scope`; this alias keeps old imports working for one release."""

import sys

from masgraph.runtime import gc_scope as _moved

sys.modules[__name__] = _moved
