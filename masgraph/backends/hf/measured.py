"""Choices measured once per machine and kept in the cache (the weights' dtype, the CPU's fp32 linear kernel).

Measured rather than assumed, because the fastest choice differs between machines of the same name; kept, because a
measurement on a busy machine can come out either way, and every process (a resumed run, a second learner rank) must
use the same choice to compute the same numbers."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from masgraph.model import cache_dir


def machine_key(device: torch.device) -> str:
    """What a choice depends on: the GPU's name, or the CPU's model and torch's thread count; the torch version."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}|{torch.__version__}|cuda"
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
               platform.processor())
    return f"{cpu}|{torch.__version__}|{torch.get_num_threads()}"


def remembered(name: str, key: str, measure: Callable[[], str], allowed: frozenset[str]) -> str:
    """The choice kept under `key` in the cache file `name`, or `measure()`'s, kept there for next time.

    One process measures and the others wait for its choice: processes that measured at once (two learner ranks, a
    test run beside another) could choose differently, and the later write dropped the other's key. An entry not in
    `allowed` is measured again rather than trusted."""
    path = cache_dir() / name
    if key in (known := _read(path, allowed)):
        return known[key]
    with _locked(path):
        if key in (known := _read(path, allowed)):
            return known[key]
        choice = measure()
        known[key] = choice
        try:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs a re-measurement next time
    return choice


def best_time(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    """Seconds for `reps` // 5 calls of `fn`: the best of 5 trials (robust to a busy machine), after one warm-up call.
    `sync` waits for queued device work (a GPU's) before each clock reading."""
    fn()
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps // 5):
            fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _read(path: Path, allowed: frozenset[str]) -> dict[str, str]:
    """The cached choices; an unreadable file or entry is measured again rather than trusted."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in known.items() if v in allowed} if isinstance(known, dict) else {}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path` while the block runs (none where the cache cannot be written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(f".{path.name}.lock"), "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []
