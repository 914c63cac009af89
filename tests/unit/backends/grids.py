"""Parameter grids for the decode-path equivalence tests: the whole product runs in `make test` and CI, a few
cases that cover every value of every axis run in `make test-fast` too (the rest are marked slow)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest


def grid(axes: dict[str, list[Any]], fast: list[tuple[Any, ...]]) -> tuple[str, list[Any]]:
    """`@pytest.mark.parametrize(*grid({"a": [...], "b": [...]}, fast=[(a, b), ...]))`: every combination, ids
    as "a-b", the ones not in `fast` marked slow. `fast` must name each value of each axis at least once."""
    names = list(axes)
    for i, name in enumerate(names):
        left_out = [v for v in axes[name] if v not in {case[i] for case in fast}]
        assert not left_out, f"the fast cases leave out {name} = {left_out}"
    params = [pytest.param(*case, id="-".join(map(str, case)), marks=() if case in fast else pytest.mark.slow)
              for case in itertools.product(*axes.values())]
    return ",".join(names), params
