"""Moved to `masgraph.tasks.distractors`; this alias keeps old imports working for one release."""

import sys

from masgraph.tasks import distractors as _moved

sys.modules[__name__] = _moved
