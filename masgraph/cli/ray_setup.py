"""`--ray`: rollout workers on Ray for `masgraph run` and `masgraph train` (Ray is imported only when asked for)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from masgraph.cli.flags import field_default, positive_float, positive_int
from masgraph.errors import MasgraphError

if TYPE_CHECKING:
    from masgraph.graph import Graph


def ray_args(p: argparse.ArgumentParser) -> None:
    """--ray, --workers, --address, --gpus-per-worker (their defaults, None here, are RayConfig's)."""
    from masgraph.runtime.ray_engine import RayConfig

    p.add_argument("--ray", action="store_true", help="run episodes on Ray rollout workers (each its own model "
                   "replica; the learner stays here)")
    p.add_argument("--workers", type=positive_int,
                   help=f"with --ray: rollout workers (default {field_default(RayConfig, 'workers')})")
    p.add_argument("--address", help="with --ray: a running Ray cluster (`ray start --head` prints it; `auto` finds "
                   "the one on this machine; `local`: a Ray started for this run); default: $RAY_ADDRESS if set, "
                   "else local")
    p.add_argument("--gpus-per-worker", type=positive_float, help="with --ray: GPUs each rollout worker reserves "
                   f"(e.g. 1, or 0.5 for two per GPU; default {field_default(RayConfig, 'gpus_per_worker'):g}: Ray "
                   "hides the GPUs from a worker that reserves none)")


def ray_config(args: argparse.Namespace) -> Any:
    """`--ray [--workers N] [--address A]` as a RayConfig (None without --ray)."""
    if not args.ray:
        if args.workers is not None or args.address is not None or args.gpus_per_worker is not None:
            raise MasgraphError("--workers, --address and --gpus-per-worker need --ray")
        return None
    from masgraph.runtime.ray_engine import RayConfig, check_address, cluster_address, require_ray

    require_ray()  # before anything loads
    address, source = cluster_address(args.address)
    check_address(address, source)  # an address nothing answers at: seconds, not minutes of Ray's retries
    given = {"workers": args.workers, "gpus_per_worker": args.gpus_per_worker}
    config = RayConfig(address=address, **{k: v for k, v in given.items() if v is not None})
    gpus = config.gpus_per_worker
    if gpus > 1 and not float(gpus).is_integer():
        raise MasgraphError(f"--gpus-per-worker {gpus:g}: Ray shares a GPU between workers (at most 1) or gives each "
                            "whole GPUs; use e.g. 0.5, 1 or 2")
    where = f" on the cluster at {address} ({source})" if address else " on a local Ray started for this run"
    print(f"starting {config.workers} Ray rollout workers{where} ...", file=sys.stderr)
    return config


def ray_engine(ray: Any, graph: Graph, config: Any) -> Any:
    """The Ray rollout engine for `masgraph run --ray` (None without it)."""
    if ray is None:
        return None
    from masgraph.runtime.engine import BackendOptions
    from masgraph.runtime.ray_engine import RayEngine

    return RayEngine(graph, ray, BackendOptions(config.deterministic, config.max_batch_size, config.batch_wait_ms,
                                                config.seed))
