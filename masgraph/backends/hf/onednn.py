"""Frozen linear layers through oneDNN on a CPU: fp32 where it is measured faster than the BLAS `F.linear` uses;
bf16 (which `F.linear` already runs through oneDNN) at a decode step's few rows, from a packed weight.

PyTorch's CPU build runs an fp32 `F.linear` as a BLAS sgemm (MKL); oneDNN, which it also ships, picks its kernels by
the CPU's instruction set at run time. On an AVX-512 AMD EPYC (this project's CI machines) oneDNN ran the model's
shapes 1.32-1.35x faster in fp32 (geometric means; 0.93-2.23x per shape: benchmarks/results/linear_kernel.md). Same
dtype and fp32 accumulation: results differ from BLAS's by summation order only. Which one runs is measured once per
machine (`measured.remembered`), or set by `MASGRAPH_LINEAR=onednn|blas`.

Only frozen weights are routed (the LoRA base layers, a tied or frozen output head): their backward needs the input's
gradient alone, `grad @ W`, another oneDNN linear with the transposed weight. Trainable weights, other devices and
dtypes (fp16), and sharded (DTensor) weights keep `F.linear`; bf16 layers keep it but at a few rows (below).

A product over a few rows (a decode step: `PACK_ROWS` or fewer) reads a copy of the frozen weight in oneDNN's own
blocked layout, made at its first such call and kept while the weight's storage and version stay (`packed`): a plain
weight is reordered into that layout inside every call, which at a few rows costs about as much as the product (the
embedded model's shapes ran 1.14-1.45x faster packed at 32 rows, 1.38-2.00x at 8, 1.02-1.07x at 2,560 in fp32; in bf16
1.14-1.42x at 32 rows and 1.18-1.95x at 8: benchmarks/results/linear_kernel.md, 2026-12-05). In fp32 more than one
row gives the same numbers either way (the same kernel). In bf16 `F.linear` runs oneDNN with the plain weight, and the
packed one gives its products bit for bit (checked from 1 to 128 rows on this project's machines;
tests/unit/backends/test_onednn.py). A copy doubles its weight's memory, so passes over many rows (prompt passes, the
learner's) keep the plain weight, and a weight is packed only while the machine keeps `HEADROOM` free beside the
copy."""

from __future__ import annotations

import functools
import os
import threading
import types
import weakref
from typing import Any

import torch
from torch.nn import functional as F

from masgraph.backends.hf.measured import best_time, machine_key, remembered
from masgraph.errors import MasgraphError

ENV = "MASGRAPH_LINEAR"
"""`onednn` or `blas` overrides the measured choice (this process and its children)."""
KERNELS = frozenset({"onednn", "blas"})
PACK_ROWS = 128
"""Products over at most this many rows read the packed weight."""
HEADROOM = 2 << 30
"""Bytes of memory a weight's packed copy must leave available (`/proc/meminfo`'s MemAvailable); else it runs plain."""


def available() -> bool:
    """Whether this torch build has oneDNN's linear op for the CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def kernel() -> str:
    """"onednn" or "blas": the environment's choice, else the one measured on this machine (once, then cached)."""
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen and chosen not in KERNELS:
        raise MasgraphError(f"{ENV}={chosen!r}: expected one of {sorted(KERNELS)} (or unset: measured)")
    if not available():
        return "blas"
    return chosen or remembered("linear-kernel.json", machine_key(torch.device("cpu")), _measure, KERNELS)


def use(choice: str) -> None:
    """Run `choice` in this process and in the processes it starts, whatever this machine measured. The processes of
    one run (its learner ranks, its Ray rollout workers) must compute the same numbers, and their own measurements
    could differ (another thread count, another machine); call it before a model loads."""
    if choice not in KERNELS:
        raise MasgraphError(f"linear kernel {choice!r}: expected one of {sorted(KERNELS)}")
    os.environ[ENV] = choice
    kernel.cache_clear()


def _measure(reps: int = 20, margin: float = 1.1) -> str:
    """"onednn" if it runs a decode-shaped (32 rows) plus an update-shaped (512 rows) fp32 linear layer `margin`x
    faster than `F.linear` on this CPU (the 32 rows read the packed weight, as a decode step does), else "blas"
    (each timed by `measured.best_time`)."""
    gen = torch.Generator(device="cpu").manual_seed(0)  # never the global generator: that would move the caller's seed
    weight = torch.randn(1536, 576, generator=gen, device="cpu")
    inputs = [torch.randn(rows, 576, generator=gen, device="cpu") for rows in (32, 512)]
    as_layers_run = lambda x, w, b: _onednn(x, _weight_for(x, w), b)  # noqa: E731
    times = {name: sum(best_time(lambda fn=fn, x=x: fn(x, weight, None), reps) for x in inputs)
             for name, fn in (("blas", F.linear), ("onednn", as_layers_run))}
    return "onednn" if times["onednn"] * margin < times["blas"] else "blas"


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_packs: dict[int, tuple[weakref.ref, int, int, torch.Tensor | None]] = {}
"""id(weight) -> (the weight, its data_ptr and version when packed, the copy or None): not an attribute of the
weight, which would then no longer pickle (a oneDNN tensor has no storage)."""
_packs_lock = threading.Lock()


def packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout (the same products as the plain weight), made once and kept while the
    weight's storage and in-place version stay (dropped with the weight); `weight` itself where the copy would not
    leave `HEADROOM` free, and for a non-contiguous view (a transposed weight, a new view each call)."""
    if not weight.is_contiguous():
        return weight
    key = (weight.data_ptr(), weight._version)
    with _packs_lock:
        kept = _packs.get(id(weight))
        if kept is not None and kept[0]() is weight and kept[1:3] == key:
            return weight if kept[3] is None else kept[3]
        size = weight.numel() * weight.element_size()
        copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if _available_bytes() > size + HEADROOM \
            else None
        if kept is None or kept[0]() is not weight:
            weakref.finalize(weight, _packs.pop, id(weight), None)
        _packs[id(weight)] = (weakref.ref(weight), *key, copy)
    return weight if copy is None else copy


def _available_bytes() -> int:
    """MemAvailable in bytes; unbounded where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 1 << 62


def eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """A CPU fp32 or bf16 input and plain (non-DTensor) CPU parameters of its dtype that train nothing, outside CPU
    autocast (which would run `F.linear` in bf16)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype
            and weight.device.type == "cpu" and weight.dim() == 2 and not weight.requires_grad
            and type(weight.data) is torch.Tensor
            and (bias is None or (not bias.requires_grad and bias.dtype == x.dtype))
            and not torch.is_autocast_enabled("cpu"))


@functools.cache
def bf16_through_onednn() -> bool:
    """Whether this CPU runs bf16 products through oneDNN (`F.linear` then does too, with the plain weight)."""
    return available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b through oneDNN; the input's gradient g W through oneDNN too (a linear layer with weight W^T)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return _onednn(x, _weight_for(x, weight), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return _onednn(grad.contiguous(), weight.t(), None), None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN when the parameters are frozen fp32 on a CPU that runs it faster,
    and for a few rows of a frozen bf16 layer through its packed weight (`F.linear` runs those through oneDNN with
    the plain weight: the same products, bit for bit on this project's machines, less the reorder); not inside a
    traced step (masgraph/backends/hf/captured.py: the compiler picks its own kernels)."""
    if torch.compiler.is_compiling() or not eligible(x, weight, bias):
        return F.linear(x, weight, bias)
    grad = x.requires_grad and torch.is_grad_enabled()
    if x.dtype == torch.bfloat16:
        few = not grad and _few_rows(x) and bf16_through_onednn()
        return _onednn(x, packed(weight), bias) if few else F.linear(x, weight, bias)
    if kernel() != "onednn":
        return F.linear(x, weight, bias)
    if grad:
        return _FrozenLinear.apply(x, weight, bias)
    return _onednn(x, _weight_for(x, weight), bias)


def _few_rows(x: torch.Tensor) -> bool:
    """Whether a product over `x` runs over `PACK_ROWS` rows or fewer (a decode step's)."""
    return x.numel() <= PACK_ROWS * x.shape[-1]


def _weight_for(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The packed weight for a product over a few rows, else the weight itself."""
    return packed(weight) if _few_rows(x) else weight


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Route every plain `nn.Linear` of `model` (weights in `dtype`) through `linear` (each call checks eligibility
    again, so a layer that later trains, moves or is sharded falls back by itself). Returns the number of layers
    routed; 0 (the model left as it is) for fp32 where the kernel chosen is BLAS, for bf16 where this CPU does not
    run bf16 through oneDNN, and for other dtypes."""
    routed = {torch.float32: lambda: kernel() == "onednn", torch.bfloat16: bf16_through_onednn}.get(dtype)
    if routed is None or not routed():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in vars(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Undo `install`; returns the number of layers restored."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and getattr(vars(module).get("forward"), "__func__", None) is _forward:
            del module.forward
            count += 1
    return count
