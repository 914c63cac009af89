"""The bf16-or-fp32 measurement (`pick_dtype`) and the seed the caller set."""

from __future__ import annotations

import json

import torch

from masgraph.backends.hf.dtype import pick_dtype


def test_measuring_the_dtype_leaves_the_callers_seed_alone(tmp_path, monkeypatch):
    """The first run on a machine measures (an empty cache), later ones read the cache: both must then draw the
    same LoRA init from `train.seed`. Drawing the operands from torch's global generator broke exactly that (CI:
    a one-learner and a two-learner run, the first of them measuring, started from adapters 0.3 apart)."""
    monkeypatch.setenv("MASGRAPH_CACHE", str(tmp_path))
    torch.manual_seed(3)
    want = torch.rand(8)
    torch.manual_seed(3)
    choice = pick_dtype(reps=5)
    assert json.loads((tmp_path / "dtype-choice.json").read_text())  # it measured, and kept what it measured
    assert torch.equal(torch.rand(8), want)
    torch.manual_seed(3)
    assert pick_dtype(reps=5) == choice  # now from the cache
    assert torch.equal(torch.rand(8), want)
