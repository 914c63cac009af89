"""The hf weights' dtype: bf16 or fp32, whichever is measured faster on the device (once per machine)."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from masgraph.model import cache_dir


def pick_dtype(reps: int = 50, margin: float = 1.3, device: torch.device | None = None) -> torch.dtype:
    """bf16 if it is clearly (`margin`x) faster than fp32 for a decode-shaped matmul on `device` (default the
    CPU), else fp32. A GPU without bf16 support gets fp32 unmeasured (fp16 would need loss scaling).

    bf16 won 1.5-2x on the machine DESIGN.md measured; on AMX-advertising VMs capped to AVX512-BF16 fp32
    wins (254 vs 150 GFLOP/s), so the choice is measured rather than assumed. It is measured once per
    machine and torch version and kept in the cache, so every process (a resumed training run too)
    uses the same dtype even when the machine is busy."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):  # bf16 from Ampere on (of this GPU, not the current)
            return torch.float32
        key = f"{torch.cuda.get_device_name(device)}|{torch.__version__}|cuda"
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                   platform.processor())
        key = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}"
    path = cache_dir() / "dtype-choice.json"
    if key in (known := _read(path)):
        return getattr(torch, known[key])
    # one process measures and the others wait for its choice: processes that measured at once (two learner ranks,
    # a test run beside another) could choose differently, and the later write dropped the other's key
    with _locked(path):
        if key in (known := _read(path)):
            return getattr(torch, known[key])
        choice = _measure(device, reps, margin)
        known[key] = str(choice).removeprefix("torch.")
        try:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs a re-measurement next time
    return choice


def _measure(device: torch.device, reps: int, margin: float) -> torch.dtype:
    """bf16 if a decode-shaped matmul runs `margin`x faster in it than in fp32 on `device`, else fp32."""
    times = {}
    # operands from a private generator: drawing them from torch's global one would move the seed the caller set
    # (the LoRA init of `train.seed`) on the first run on a machine only, and that run would differ from the next
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # a decode step's matmul on a CPU; on a GPU a batch's (a small one is launch-bound and ties)
        m, k, n = (32, 576, 1536) if device.type == "cpu" else (512, 2048, 2048)
        x = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
        w = torch.randn(k, n, dtype=dtype, device=device, generator=gen)
        x @ w  # warm-up
        best = float("inf")
        for _ in range(5):  # best of 5 trials: robust to a busy machine
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(reps // 5):
                x @ w
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        times[dtype] = best
    return torch.bfloat16 if times[torch.bfloat16] * margin < times[torch.float32] else torch.float32


def _read(path: Path) -> dict[str, str]:
    """The cached choices; an unreadable file or entry is measured again rather than trusted."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in known.items() if v in ("float32", "bfloat16")} if isinstance(known, dict) else {}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []
