"""`masgraph train --ray --learners N`: learner ranks 1..N-1 as Ray tasks on the cluster the rollout workers use.

This process is rank 0 (the training loop, its Ray rollout workers, checkpoints, as under torchrun); each other
rank is a Ray task that runs the same `masgraph train` command without the Ray flags (a process of its own), joining
rank 0's process group (gloo on a CPU, NCCL on CUDA: one GPU each) through the address and port this process
gives it, exactly as a torchrun rank does (`masgraph.cli.learners`). A rank that fails before the group is formed
is reported here at once (rank 0 would wait in the rendezvous until `--learner-timeout`); after that, a lost rank
is `PeerLost`'s one error line as under torchrun."""

from __future__ import annotations

import argparse
import atexit
import os
import socket
import sys
import threading
from typing import Any

from masgraph.cli.learners import LAUNCHED

RAY_FLAGS = {"--ray": 0, "--workers": 1, "--address": 1, "--gpus-per-worker": 1}
"""The flags a learner rank drops (with how many values each takes): rollouts stay on rank 0's workers."""


def rank_argv(argv: list[str]) -> list[str]:
    """`argv` without the Ray flags (`--workers 2` and `--workers=2` alike)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in RAY_FLAGS:
            skip = 0 if "=" in arg else RAY_FLAGS[arg]
        else:
            out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the rank's process before it starts (Linux): SIGKILL it when the Ray worker that started it dies (a
    cancelled task), so no rank is left waiting in the process group for its timeout."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank(argv: list[str], env: dict[str, str], cwd: str) -> tuple[int, str]:
    """A learner rank, run by a Ray worker: `masgraph train` as rank `env["RANK"]` in a process of its own (as
    torchrun starts one); (exit code, its last `error:` line when it failed: rank 0, which has the terminal,
    reports it)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "masgraph", *argv], env={**os.environ, **env}, cwd=cwd,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    tail = errors[-1] if errors else (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode, tail if done.returncode else ""


class RayLearners:
    """The Ray tasks of ranks 1..N-1 of one training run (`launch`), watched until they end (`wait`)."""

    def __init__(self, ray: Any, refs: list[Any]):
        self.ray, self.refs = ray, refs
        threading.Thread(target=self._watch, name="masgraph-ray-learners", daemon=True).start()
        atexit.register(self.stop)  # rank 0 failed or was interrupted: no rank waits on a cluster for its timeout

    def stop(self) -> None:
        """Cancel the ranks still running (their Ray workers are killed); nothing once Ray is shut down."""
        if not self.ray.is_initialized():
            return
        _, running = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in running:
            self.ray.cancel(ref, force=True)

    def _watch(self) -> None:
        """A rank that ends while rank 0 still waits in the rendezvous would leave it waiting until the learner
        timeout: say which rank and why, and stop. Once the ranks met, a lost one is PeerLost's error line."""
        import torch.distributed as dist

        while True:
            ready, _ = self.ray.wait(self.refs, num_returns=1, timeout=0.5)
            if dist.is_available() and dist.is_initialized():
                return
            if ready:
                break
        code, why = self._result(ready[0])
        print(f"error: learner rank {self.refs.index(ready[0]) + 1} (a Ray task) ended before the ranks met "
              f"(exit {code}{': ' + why if why else ''}); rank 0 stops", file=sys.stderr, flush=True)
        os._exit(1)

    def _result(self, ref: Any) -> tuple[int, str]:
        try:
            return self.ray.get(ref)
        except Exception as exc:  # the task or its worker died
            return 1, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

    def wait(self, timeout_s: float = 120.0) -> list[str]:
        """After rank 0's training: each rank's failure, if any (a rank still running after `timeout_s` is
        cancelled and counted)."""
        ready, late = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        problems = [f"learner rank {self.refs.index(r) + 1}: exit {code}{': ' + why if why else ''}"
                    for r in ready for code, why in [self._result(r)] if code]
        for ref in late:
            self.ray.cancel(ref, force=True)
            problems.append(f"learner rank {self.refs.index(ref) + 1}: still running after {timeout_s:g} s; stopped")
        return problems


def launch(args: argparse.Namespace, argv: list[str], ray_config: Any, device: str) -> RayLearners | None:
    """With `--ray --learners N` (N > 1, outside torchrun): join or start the Ray the rollout workers will use,
    start ranks 1..N-1 there (one GPU each on CUDA, no CPU reserved: between updates they wait), and make this
    process rank 0 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them). None otherwise."""
    n = args.learners
    if not args.ray or n is None or n <= 1 or "WORLD_SIZE" in os.environ:
        return None
    from masgraph.runtime.ray_engine import connect, require_ray

    ray = require_ray()
    connect(ray, ray_config)
    env = {"WORLD_SIZE": str(n), "MASTER_ADDR": ray.util.get_node_ip_address(), "MASTER_PORT": str(_free_port()),
           "LOCAL_RANK": "0"}  # on CUDA Ray shows each task its own GPU, as device 0
    task = ray.remote(_rank).options(num_cpus=0, num_gpus=1 if device.startswith("cuda") else 0, max_retries=0)
    refs = [task.remote(rank_argv(argv), {**env, "RANK": str(k), LAUNCHED: "1"}, os.getcwd()) for k in range(1, n)]
    os.environ.update({**env, "RANK": "0", LAUNCHED: "1"})
    print(f"started {n - 1} learner rank(s) as Ray tasks; this process is rank 0", file=sys.stderr)
    return RayLearners(ray, refs)

