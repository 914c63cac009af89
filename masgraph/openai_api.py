"""Moved to `masgraph.serve.openai_api`; this alias keeps old imports working for one release."""

import sys

from masgraph.serve import openai_api as _moved

sys.modules[__name__] = _moved
