"""Where a local model runs: one setting, `auto | cpu | cuda | cuda:N`, resolved once to a torch device.

`auto` is the GPU when torch sees one, else the CPU, so a graph written on a laptop trains on a GPU machine
unchanged. Asking for a GPU that is not there is an error that says what to run, never a silent CPU run.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from masgraph.errors import MasgraphError

if TYPE_CHECKING:
    import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
"""What a `device:` setting may say (checked by the spec without importing torch)."""


def is_device_name(name: str) -> bool:
    return re.fullmatch(DEVICE_PATTERN, name) is not None


def resolve_device(name: str = "auto") -> torch.device:
    """The torch device for a setting: `auto` is `cuda` when a GPU is visible, else `cpu`; `cuda` / `cuda:N`
    must be visible, else a MasgraphError naming the fix."""
    import torch

    if not is_device_name(name):
        raise MasgraphError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise MasgraphError(f"device {name!r}: torch {torch.__version__} is a CPU build and sees no GPU; fix: "
                                "`device: cpu` (or `--device cpu`), or on a GPU machine install the CUDA build "
                                "(rm -rf .venv && make setup)")
        raise MasgraphError(f"device {name!r}: torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees "
                            "no GPU; check that CUDA_VISIBLE_DEVICES does not hide them, that `nvidia-smi` lists "
                            "one (a driver for this build), and on Ray workers pass --gpus-per-worker (Ray hides "
                            "the GPUs from a worker that reserves none); or use `device: cpu`")
    index = int(name.split(":")[1]) if ":" in name else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise MasgraphError(f"device {name!r}: this machine has {count} visible GPU(s) (cuda:0..cuda:{count - 1}); "
                            "fix: pick one of those, or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def deterministic_kernels(device: torch.device) -> None:
    """On a GPU, make torch pick repeatable kernels (the deterministic mode's bit-exactness; a kernel that has no
    deterministic version warns instead of failing). A CPU's kernels repeat already, save an accumulating indexed
    write (`x[idx]`'s backward adds repeated indices by atomic adds across threads), which the learner does not use
    (`backends.hf.layout.picked_rows`); so the process-wide switch is left alone on a CPU. The CPU thread count, which
    orders its parallel sums, is held (`masgraph.threads.hold_threads`)."""
    import torch

    from masgraph.threads import hold_threads

    hold_threads()

    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def describe(device: torch.device) -> str:
    """`cpu`, or `cuda:0 (NVIDIA H100 80GB HBM3)`: for progress lines."""
    import torch

    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def is_out_of_memory(exc: BaseException) -> bool:
    """A device out-of-memory error (torch's OutOfMemoryError, or a RuntimeError saying so)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())
