"""The hf weights' dtype: bf16 or fp32, whichever is measured faster on the device (once per machine)."""

from __future__ import annotations

import torch

from masgraph.backends.hf.measured import best_time, machine_key, remembered


def pick_dtype(reps: int = 50, margin: float = 1.3, device: torch.device | None = None) -> torch.dtype:
    """bf16 if it is clearly (`margin`x) faster than fp32 for a decode-shaped matmul on `device` (default the
    CPU), else fp32. A GPU without bf16 support gets fp32 unmeasured (fp16 would need loss scaling).

    bf16 won 1.5-2x on the machine DESIGN.md measured; on AMX-advertising VMs capped to AVX512-BF16 fp32
    wins (254 vs 150 GFLOP/s), so the choice is measured rather than assumed. It is measured once per
    machine and torch version and kept in the cache (`measured.remembered`)."""
    device = device or torch.device("cpu")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):  # bf16 from Ampere on
        return torch.float32
    choice = remembered("dtype-choice.json", machine_key(device), lambda: _measure(device, reps, margin),
                        frozenset({"float32", "bfloat16"}))
    return getattr(torch, choice)


def _measure(device: torch.device, reps: int, margin: float) -> str:
    """"bfloat16" if a decode-shaped matmul runs `margin`x faster in it than in fp32 on `device`, else "float32"."""
    times = {}
    # operands from a private generator: drawing them from torch's global one would move the seed the caller set
    # (the LoRA init of `train.seed`) on the first run on a machine only, and that run would differ from the next
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # a decode step's matmul on a CPU; on a GPU a batch's (a small one is launch-bound and ties)
        m, k, n = (32, 576, 1536) if device.type == "cpu" else (512, 2048, 2048)
        x = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
        w = torch.randn(k, n, dtype=dtype, device=device, generator=gen)
        times[dtype] = best_time(lambda x=x, w=w: x @ w, reps, lambda: _sync(device))
    return "bfloat16" if times[torch.bfloat16] * margin < times[torch.float32] else "float32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
