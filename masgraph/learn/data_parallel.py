"""Data-parallel learning on `torch.distributed`: N learner ranks split a step's rows and sum their LoRA gradients.

Every rank holds the whole base model and every adapter (replicated data parallelism: LoRA gradients are MBs, so
one flat all-reduce per optimizer step is cheap and needs no wrapper). A step's rows are split by tokens, the same
split on every rank whatever the timing; each rank weights its rows' losses by the *whole* mini-batch's
aggregation weights, so the summed gradient is the one a single process computes, and the optimizer steps are
identical everywhere. Collectives run in one fixed order, and a rank without a row for an adapter still sends
zeros, so none waits for ever. Rank 0 alone writes the run directory.

Example (under `torchrun --nproc-per-node 2`):
    >>> dp = init_from_env(torch.device("cpu"))     # gloo on a CPU, NCCL on CUDA; None in a single process
    >>> mine = dp.own([len(r.prompt_ids) + len(r.completion_ids) for r in rows])
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from masgraph.errors import MasgraphError

__all__ = ["DataParallel", "PeerLost", "current", "init_from_env", "token_shards", "world_from_env"]

T = TypeVar("T")

TIMEOUT_S = 1800.0
"""How long a collective waits for a rank that is alive but silent (a hung rank); a rank that dies is seen at
once (its connections close). Long enough for rank 0's evaluation and checkpoint between two updates."""


class PeerLost(MasgraphError):
    """A collective failed because another learner rank died, hung past the timeout, or failed on its own."""


def token_shards(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Positions 0..n-1 split into `world` shards of near-equal total `lengths` (longest first, each to the
    least-loaded shard, ties to the lower rank): a pure function of the lengths, so every rank computes the same
    split. Each shard is sorted, so a node's rows stay together in a forward pass."""
    load, shards = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the learner ranks of the default process group, and the collectives the
    Flow-GRPO update needs (each a no-op for one rank)."""

    rank: int
    world: int
    device: torch.device = torch.device("cpu")
    """Where this rank's collectives put tensors: its GPU under NCCL, the CPU under gloo."""

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run directory (checkpoints, metrics, events) and publishes adapters."""
        return self.rank == 0

    def own(self, lengths: Sequence[int]) -> list[int]:
        """The positions of rows with these token `lengths` that this rank computes (`token_shards`)."""
        return token_shards(lengths, self.world)[self.rank]

    def broadcast(self, obj: T, what: str = "rank 0's traces") -> T:
        """Rank 0's `obj` on every rank (pickled): every rank then trains on exactly the same rows."""
        box = [obj]
        self._collective(what, dist.broadcast_object_list, box, src=0)
        return box[0]

    def all_reduce_grads(self, params: Sequence[Sequence[torch.Tensor]], what: str = "gradient all-reduce") -> None:
        """Sum the gradients of `params` (one list per adapter, in a fixed order) across ranks, in one flat buffer:
        a parameter this rank left without a gradient (no row of its adapter here) contributes zeros, and every
        parameter leaves with the summed gradient."""
        flat = [p for group in params for p in group]
        if self.world == 1 or not flat:
            return
        buf = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in flat])
        self._collective(what, dist.all_reduce, buf)
        offset = 0
        for p in flat:
            p.grad = buf[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def all_reduce_sum(self, values: torch.Tensor, what: str = "metric sums") -> torch.Tensor:
        """The element-wise sum of `values` over ranks (`values` is summed in place and returned)."""
        if self.world > 1:
            on = values.to(self.device)
            self._collective(what, dist.all_reduce, on)
            values.copy_(on)
        return values

    def broadcast_parameters(self, params: Sequence[torch.Tensor], what: str = "adapter broadcast") -> None:
        """Rank 0's values of `params` on every rank (the adapters start identical whatever each rank's RNG did)."""
        if self.world == 1 or not params:
            return
        with torch.no_grad():
            buf = torch.cat([p.detach().reshape(-1) for p in params])
            self._collective(what, dist.broadcast, buf, src=0)
            offset = 0
            for p in params:
                p.copy_(buf[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _collective(self, what: str, fn: Any, *args: Any, **kw: Any) -> None:
        t0 = time.monotonic()
        try:
            fn(*args, **kw)
        except (RuntimeError, dist.DistError) as exc:
            raise self._lost(what, exc, t0) from exc

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Collectives made inside (FSDP's all-gathers and reduce-scatters, DTensor gathers) that fail because
        another rank is gone raise `PeerLost` too; other errors pass as they are."""
        t0 = time.monotonic()
        try:
            yield
        except RuntimeError as exc:  # gloo raises a plain RuntimeError for a closed connection
            if isinstance(exc, dist.DistError) or _COMMS.search(str(exc)):
                raise self._lost(what, exc, t0) from exc
            raise

    def _lost(self, what: str, exc: BaseException, t0: float) -> PeerLost:
        return PeerLost(f"learner rank {self.rank} of {self.world}: the {what} failed after "
                        f"{time.monotonic() - t0:.0f} s: {_peer(exc, self)} ({_first_line(exc)})")


_COMMS = re.compile(r"gloo|nccl|connection (closed|reset)|timed out|timeout", re.IGNORECASE)
"""What a collective's failure says (as against an error of the update's own, which passes unchanged)."""


def _peer(exc: BaseException, dp: DataParallel) -> str:
    """Which rank failed, as far as this one can tell: with two ranks, the other one."""
    who = f"rank {1 - dp.rank}" if dp.world == 2 else "another rank"
    return f"{who} stopped (died, hung past the timeout, or failed)"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) outside torchrun."""
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))


def current() -> DataParallel | None:
    """The data-parallel ranks of the initialized default process group, or None in a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return DataParallel(dist.get_rank(), dist.get_world_size(), device)


def init_from_env(device: torch.device, timeout_s: float = TIMEOUT_S) -> DataParallel | None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL when the learner
    is on CUDA (each rank on GPU LOCAL_RANK), gloo on a CPU. None (and no group) when the world is one process."""
    rank, world, local = world_from_env()
    if world <= 1:
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(local)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return current()
