"""The bf16-or-fp32 measurement (`pick_dtype`) and the seed the caller set."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import torch

import masgraph.backends.hf.dtype as dtype_module
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


def _measuring_process(threads: int, where: Path, i: int) -> None:
    """One process of the test below (forked: torch and masgraph already imported): its own thread count (a key of
    its own, or one it shares), a slow stand-in for the measurement, and a start on the test's signal."""
    torch.set_num_threads(threads)

    def slow(*_):
        (where / f"measured-{i}").touch()
        time.sleep(0.5)
        return "float32"
    dtype_module._measure = slow
    (where / f"ready-{i}").touch()
    while not (where / "go").exists():
        time.sleep(0.01)
    (where / f"chose-{i}").write_text(str(pick_dtype()))


def test_processes_measuring_at_once_keep_every_choice_and_one_measures_per_key(tmp_path, monkeypatch):
    """Processes that start on an empty cache together (two learner ranks; CI's test tiers side by side) measure one
    at a time: each key is measured once, and no process's write drops another's key. Without the lock each read
    the empty file, measured, and the last write won: a later run re-measured and could load the other dtype."""
    monkeypatch.setenv("MASGRAPH_CACHE", str(tmp_path / "cache"))
    threads = [1, 2, 2]  # the last two share a key
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_measuring_process, args=(n, tmp_path, i)) for i, n in enumerate(threads)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < len(procs):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs)
            time.sleep(0.05)
        (tmp_path / "go").touch()
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    assert [(tmp_path / f"chose-{i}").read_text() for i in range(len(procs))] == ["torch.float32"] * len(procs)
    known = json.loads((tmp_path / "cache" / "dtype-choice.json").read_text())
    assert sorted(k.rsplit("|", 1)[1] for k in known) == ["1", "2"], known
    assert len(list(tmp_path.glob("measured-*"))) == 2  # the shared key was measured once


def test_a_cached_choice_that_is_not_a_dtype_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MASGRAPH_CACHE", str(tmp_path))
    pick_dtype(reps=5)
    path = tmp_path / "dtype-choice.json"
    path.write_text(json.dumps({k: "int8" for k in json.loads(path.read_text())}))
    assert pick_dtype(reps=5) in (torch.float32, torch.bfloat16)
    assert set(json.loads(path.read_text()).values()) <= {"float32", "bfloat16"}
