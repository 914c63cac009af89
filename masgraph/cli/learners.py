"""`masgraph train` with several learner ranks (`--learners N`, or under `torchrun --nproc-per-node N`).

Rank 0 runs the whole training loop: rollouts, evaluation, checkpoints, metrics, events, publishing. Every other
rank only joins each Flow-GRPO update (`masgraph.learn.data_parallel`): it receives the step number, then rank 0's
traces inside the update, computes its share of the rows and takes the same optimizer step. Rollouts are not
repeated on the other ranks: they would only be thrown away (the update trains on rank 0's traces whatever they
gave), and on one machine they would take cores from rank 0's own."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from masgraph.errors import MasgraphError

if TYPE_CHECKING:  # masgraph.learn.data_parallel imports torch: only once a command needs it
    from masgraph.graph import Graph
    from masgraph.learn.data_parallel import DataParallel, PeerLost

LAUNCHED = "MASGRAPH_RAY_LEARNERS"
"""Set in every rank `masgraph.cli.ray_learners.launch` makes (rank 0 keeps its `--ray`; the others have none)."""

TIMEOUT_MINUTES = 30
"""`--learner-timeout`'s default (`masgraph.learn.data_parallel.TIMEOUT_S`, which a test holds equal)."""


def learner_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--learners", type=int, metavar="N",
                   help="learner ranks for the update (data parallel; Flow-GRPO, hf rollouts): starts them with "
                        "torchrun on this machine; under torchrun it must match the ranks it started "
                        "(docs/scale-out.md)")
    t.add_argument("--shard", action="store_true",
                   help="with 2+ learner ranks: split the base's decoder layers (adapters included) across them "
                        "(FSDP2), for a base one device cannot train; rollouts and evaluation then decode on a copy "
                        "of the base on rank 0, or with --ray on the Ray workers (docs/scale-out.md)")
    t.add_argument("--learner-timeout", type=float, default=60.0 * TIMEOUT_MINUTES, metavar="SECONDS",
                   help="how long a learner rank waits for a silent one (a hung rank) before the run stops "
                        "(default %(default)g; a rank that dies is seen at once); it must cover rank 0's rollouts, "
                        "evaluation and checkpoint between two updates")


def relaunch(args: argparse.Namespace, argv: list[str]) -> int | None:
    """`--learners N` outside torchrun: run this same command under `torchrun --standalone --nproc-per-node N`
    (`masgraph.cli.launch`; its exit code); None when there is nothing to start (one learner, or already under
    torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = args.learners
    if n is None or n == 1 and world == 1 or getattr(args, "ray", False):  # --ray: Ray starts them (ray_learners)
        return None
    if n < 1:
        raise MasgraphError(f"--learners {n}: give 1 or more")
    if "WORLD_SIZE" in os.environ:
        if n != world:
            raise MasgraphError(f"--learners {n} but torchrun started {world} ranks; drop --learners under torchrun "
                                "or make it match --nproc-per-node x --nnodes")
        return None
    import signal
    import subprocess

    command = [sys.executable, "-m", "masgraph.cli.launch", "--standalone", f"--nproc-per-node={n}",
               "-m", "masgraph", *argv]  # torchrun's launcher, without its traceback when a rank fails
    launcher = subprocess.Popen(command)
    # the launcher shares this terminal: Ctrl-C reaches it, and it stops the ranks (each keeps its last checkpoint);
    # this process waits for that instead of killing it 0.25 s later, and passes a SIGTERM on
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: launcher.send_signal(signum))
    try:
        code = launcher.wait()
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def join(args: argparse.Namespace, graph: Graph) -> tuple[DataParallel | None, Graph]:
    """Join the learner ranks torchrun started (None in a single process), after checking this run can be split:
    Flow-GRPO with in-process hf rollouts (Ray workers and vLLM servers would be started once per rank). On CUDA
    each rank's policies move to its own GPU (LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, graph
    from masgraph.learn.data_parallel import init_from_env, world_from_env

    _, world, local = world_from_env()
    spec, problems = graph.spec, []
    if spec.train.algorithm != "flow_grpo":
        problems.append(f"train.algorithm is {spec.train.algorithm!r}")
    if getattr(args, "ray", False) and LAUNCHED not in os.environ:
        problems.append("--ray is given to ranks torchrun started (each would start its own rollout workers; "
                        "`masgraph train --ray --learners N` starts the ranks on Ray instead)")
    kinds = {p.backend for p in spec.policies.values() if p.trainable}
    if kinds - {"hf"}:
        problems.append(f"the trainable policies roll out on {sorted(kinds)}")
    if problems:
        raise MasgraphError(f"{world} learner ranks need Flow-GRPO with in-process hf rollouts, but "
                            f"{'; '.join(problems)}; run one learner (drop --learners / torchrun)")
    from masgraph.cli.common import with_device

    device = learner_device(graph)
    if device.type == "cuda":
        graph = with_device(graph, f"cuda:{local}", args.graph)
    return init_from_env(device, args.learner_timeout), graph


def agreed_dtype(dp: DataParallel | None, graph: Graph, dtype: str) -> str:
    """The weight dtype every learner rank loads: `dtype` (a checkpoint's) or the trainable policies' pin as they
    stand, else rank 0's measured choice, broadcast: ranks that measured for themselves could choose differently."""
    if dp is None or dtype != "auto" or any(p.dtype != "auto" for p in graph.spec.policies.values() if p.trainable):
        return dtype
    from masgraph.backends.hf.dtype import pick_dtype

    mine = str(pick_dtype(device=learner_device(graph))).removeprefix("torch.") if dp.writes else ""
    return dp.broadcast(mine, "dtype broadcast")


def agree_linear_kernel(dp: DataParallel | None, graph: Graph) -> None:
    """Every CPU learner rank runs rank 0's fp32 linear kernel (`masgraph/backends/hf/onednn.py`), broadcast before
    the model loads: ranks that measured for themselves could choose differently and compute different numbers."""
    if dp is None or learner_device(graph).type != "cpu":
        return
    from masgraph.backends.hf import onednn

    onednn.use(dp.broadcast(onednn.kernel() if dp.writes else "", "linear kernel broadcast"))


def learner_device(graph: Graph) -> Any:
    """The torch device the trainable policies (the learner) are on."""
    from masgraph.device import resolve_device

    return resolve_device(next((p.device for p in graph.spec.policies.values() if p.trainable), "cpu"))


def writes(dp: DataParallel | None) -> bool:
    """Whether this process writes the run directory and prints progress (a single process, or rank 0)."""
    return dp is None or dp.writes


def shared_run_dir(dp: DataParallel | None, make: Any) -> Path:
    """Rank 0's run directory (`make()` there) on every rank."""
    if dp is None:
        return make()
    return Path(dp.broadcast(str(make()) if dp.writes else None, "the run directory"))


def follow(loop: Any, dp: DataParallel, checkpoint: Path | None, run_dir: Path) -> int:
    """A rank other than 0: load the checkpoint rank 0 resumes from (reading only), then join each update rank 0
    starts (it sends the step number, then its traces inside the update) until it says training is over (None)."""
    from masgraph.learn.data_parallel import PeerLost

    try:
        if checkpoint is not None:
            loop.checkpoints.load(checkpoint, loop.learner, loop.algo, sorted(set(loop.trainable.values())), loop.cfg)
        while (step := dp.broadcast(None, "rank 0's next step")) is not None:
            loop.algo.train_step([], step)
    except PeerLost as exc:
        raise located(exc, run_dir) from exc
    finish(dp)
    return 0


@contextmanager
def leading(dp: DataParallel | None, run_dir: Path) -> Iterator[None]:
    """Rank 0's training: a lost rank becomes one error naming the last checkpoint; at the end the others exit."""
    from masgraph.learn.data_parallel import PeerLost

    try:
        yield
    except PeerLost as exc:
        raise located(exc, run_dir) from exc
    finish(dp)


def announce(dp: DataParallel | None, step: int | None) -> None:
    """Rank 0: the other ranks join the update of `step` next (None: training is over, they exit)."""
    if dp is not None and dp.writes:
        dp.broadcast(step, "the next update's step" if step is not None else "the end of training")


def finish(dp: DataParallel | None) -> None:
    """Rank 0 tells the others training is over (if they are still there), and every rank leaves the group."""
    if dp is None:
        return
    import torch.distributed as dist

    from masgraph.learn.data_parallel import PeerLost

    try:
        announce(dp, None)
        # every rank past its last message before any tears its gloo pairs down: a rank that destroyed the group
        # while a peer still read from it aborted in gloo's teardown (SIGABRT, ~1 run in 6 of the kill-and-resume test)
        dist.barrier()
    except (PeerLost, RuntimeError):
        pass
    dist.destroy_process_group()


def located(exc: PeerLost, run_dir: Path) -> MasgraphError:
    """`exc` with the run's last checkpoint and how to resume from it."""
    from masgraph.rundir.checkpoint import resolve_checkpoint

    try:
        last = f"the last checkpoint is {resolve_checkpoint(run_dir)}; resume with --resume {run_dir}"
    except MasgraphError:
        last = f"no checkpoint was written in {run_dir}"
    return MasgraphError(f"{exc}; {last} and the same --learners")
