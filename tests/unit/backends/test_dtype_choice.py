"""The bf16-or-fp32 measurement (`pick_dtype`) and the seed the caller set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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


def test_processes_measuring_at_once_keep_every_choice_and_one_measures_per_key(tmp_path):
    """Processes that start on an empty cache together (two learner ranks; CI's test tiers side by side) measure one
    at a time: each key is measured once, and no process's write drops another's key. Without the lock each read
    the empty file, measured, and the last write won: a later run re-measured and could load the other dtype."""
    go = tmp_path / "go"
    child = (
        "import sys, time, pathlib, torch\n"
        "from masgraph.backends.hf import dtype\n"
        "torch.set_num_threads(int(sys.argv[1]))  # a key of its own (or, for two, a shared one)\n"
        "def slow(*a):\n"
        "    (pathlib.Path(sys.argv[2]) / f'measured-{sys.argv[3]}').touch()\n"
        "    time.sleep(0.5)\n"
        "    return torch.float32\n"
        "dtype._measure = slow\n"
        "(pathlib.Path(sys.argv[2]) / f'ready-{sys.argv[3]}').touch()\n"
        "while not (pathlib.Path(sys.argv[2]) / 'go').exists():\n"
        "    time.sleep(0.01)\n"
        "print(dtype.pick_dtype())\n")
    env = {**os.environ, "MASGRAPH_CACHE": str(tmp_path / "cache")}
    threads = [1, 2, 2]  # the last two share a key
    procs = [subprocess.Popen([sys.executable, "-c", child, str(n), str(tmp_path), str(i)], env=env,
                              stdout=subprocess.PIPE, text=True) for i, n in enumerate(threads)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < len(procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert outs == ["torch.float32"] * len(procs)
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
