"""Parameter grids for the decode-path equivalence tests: the whole product runs in `make test` and CI, a few
cases that cover every value of every axis run in `make test-fast` too (the rest are marked slow)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest


def grid(axes: dict[str, list[Any]], fast: list[tuple[Any, ...]]) -> tuple[str, list[Any]]:
    """`@pytest.mark.parametrize(*grid({"a": [...], "b": [...]}, fast=[(a, b), ...]))`: every combination, ids
    as "a-b", the ones not in `fast` marked slow. `fast` must be cases of the grid and name each value of each axis."""
    names, cases = list(axes), list(itertools.product(*axes.values()))
    assert set(fast) <= set(cases), f"fast cases outside the grid: {set(fast) - set(cases)}"
    for i, name in enumerate(names):
        covered = {case[i] for case in fast}
        left_out = [v for v in axes[name] if v not in covered]
        assert not left_out, f"the fast cases leave out {name} = {left_out}"
    params = [pytest.param(*case, id="-".join(map(str, case)), marks=() if case in fast else pytest.mark.slow)
              for case in cases]
    return ",".join(names), params
