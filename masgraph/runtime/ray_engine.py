"""Rollout workers as Ray actors: each holds its own engine (a backend replica, or a client of a shared vLLM
server) and runs whole episodes; the driver keeps the scheduler's interface, the sinks and the learner.

An episode's events travel back with its trace when it ends and are emitted on the driver, so a worker killed
mid-episode leaves no partial lines: its in-flight episodes run again on another worker (on a replacement that
gets every published adapter first), and events.jsonl is complete. Seeds derive from (run seed, item, sample,
node, turn), as in process, so in deterministic mode the results equal a one-process run's.

Ray is imported only here, and only when `--ray` asks for it: local runs need it neither installed nor started.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from masgraph.errors import MasgraphError
from masgraph.events import Emitter, EpisodeFinished, Sink
from masgraph.graph import Graph
from masgraph.runtime.engine import BackendOptions, EngineLike
from masgraph.runtime.scheduler import EpisodeInput, apply_score, run_bounded
from masgraph.trace import Trace

MAX_ATTEMPTS = 3
"""Workers an episode may take down before it is recorded as failed (one that kills every worker is not retried
forever)."""


@dataclass(frozen=True)
class RayConfig:
    """Where rollout workers run."""

    workers: int = 2
    """Rollout worker actors (each loads its own copy of the model)."""
    address: str | None = None
    """A running cluster (`ray start --head` prints it; `auto` finds the one on this machine); None starts a
    local Ray for this process."""
    cpus_per_worker: float = 1.0
    """Ray CPUs each worker reserves."""
    gpus_per_worker: float = 0.0
    """Ray GPUs each worker reserves (0.5: two workers share a GPU). Ray hides the GPUs from an actor that reserves
    none, so a worker's `device: auto` is its CPU unless this is set."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables each worker process starts with (Ray's `runtime_env`): a training run's driver pins
    there what a worker would otherwise measure for itself (`masgraph.learn.serving`)."""


def require_ray() -> Any:
    """The ray module, or a MasgraphError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise MasgraphError("--ray needs Ray: pip install 'ray==2.60.0' (local runs need nothing: drop --ray)"
                            ) from None
    return ray


def cluster_address(flag: str | None) -> tuple[str | None, str]:
    """The cluster to join and where that came from: `--address` (`local`: none), else $RAY_ADDRESS (Ray's
    convention on a cluster node), else None: a local Ray started for the run (never one that merely happens to
    run on this machine)."""
    if flag:
        return (None, "--address local") if flag == "local" else (flag, "--address")
    env = os.environ.get("RAY_ADDRESS") or None
    return env, "$RAY_ADDRESS" if env else ""


def check_address(address: str | None, source: str = "--address", timeout_s: float = 5.0) -> None:
    """Fail in seconds, with the fix, on an address no Ray cluster can be at: `ray.init` would wait for it for
    minutes, printing only its own retry warnings. Checked: the form HOST:PORT, that the host resolves, that
    something listens, and (without TLS) that it speaks gRPC as Ray's GCS does; a gRPC port that is not the GCS
    (the Ray Client's 10001, a raylet's) passes and is left to `ray.init`. `auto` is left to `connect`."""
    if address is None or address == "auto":
        return
    choices = ("the GCS address `ray start --head` prints (HOST:6379), `auto` for the cluster on this machine, or "
               "`local` for a local Ray started for the run")
    fix = f"unset RAY_ADDRESS, or pass --address: {choices}" if source == "$RAY_ADDRESS" else f"pass {choices}"
    if "://" in address:
        kind = "Ray Client addresses (ray://)" if address.startswith("ray://") else "URLs (the Jobs API's)"
        raise MasgraphError(f"{source} {address}: {kind} are not supported; {fix}")
    host, _, port = address.rpartition(":")
    if ":" in host and not host.startswith("["):
        raise MasgraphError(f"{source} {address}: an IPv6 address needs brackets, e.g. [{host}]:{port}")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MasgraphError(f"{source} {address}: expected HOST:PORT; {fix}")
    tls = os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")
    try:
        if tls:  # the GCS wants a TLS handshake first: check that the port is open, no more
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        grpc = tls or _speaks_grpc(host, int(port), timeout_s)
    except socket.gaierror:
        raise MasgraphError(f"{source} {address}: cannot resolve the host {host!r}") from None
    except OSError as exc:
        reason = (f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError)
                  else exc.strerror or type(exc).__name__)
        raise MasgraphError(f"{source} {address}: no Ray cluster answers there ({reason}); start one on that host "
                            f"with `ray start --head --port {port}`, or {fix}") from None
    if not grpc:
        raise MasgraphError(f"{source} {address}: something answers there, but not a gRPC server as Ray's GCS is "
                            f"(a dashboard or Jobs API port?); {fix}")


def _speaks_grpc(host: str, port: int, timeout_s: float) -> bool:
    """Whether the server at host:port answers the HTTP/2 client preface with a SETTINGS frame, as a gRPC server
    (Ray's GCS) does; an HTTP/1 server (the dashboard) answers otherwise or hangs up. No answer: TimeoutError."""
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        head = b""
        while len(head) < 9:
            chunk = conn.recv(9 - len(head))
            if not chunk:
                return False
            head += chunk
    return head[3] == 0x04  # frame type SETTINGS


def connect(ray: Any, config: RayConfig) -> None:
    """Join the cluster at `config.address`, or start a local Ray sized for the workers; Ray's errors (no cluster
    found for `auto`, a bad address) become one MasgraphError."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at niceness 15, below the driver; here the workers do the run's work and the driver
    # waits, so on a machine with other work they got ~3 % of a core each (measured beside two busy loops) and
    # episodes crawled into their time limits. A local Ray's raylet reads this when it starts; a cluster started
    # with `ray start` keeps its own setting (start it with RAY_worker_niceness=0).
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        if config.address:
            ray.init(address=config.address, log_to_driver=False)
        else:  # "local": a new instance even when a `ray start` cluster runs here (plain ray.init() joins it)
            cpus = max(os.cpu_count() or 1, int(config.workers * config.cpus_per_worker + 0.999))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if config.address:
            raise MasgraphError(f"cannot join the Ray cluster at {config.address}: {first}; start one with `ray start "
                                "--head`, or run without an address (`--address local`) for a local Ray") from None
        raise MasgraphError(f"cannot start a local Ray: {first}") from None


class _Files:
    """A published adapter as the PEFT directory's files (what travels through the object store)."""

    home = None

    def __init__(self, files: dict[str, bytes]):
        self.files = files

    def save(self, path: str) -> str:
        Path(path).mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (Path(path) / name).write_bytes(data)
        return path

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("a worker loads the saved files")


def read_dir(path: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(path).iterdir() if p.is_file()}


class RolloutWorker:
    """Ray actor body: an engine over the graph (its backends built here) that runs episodes and takes adapters."""

    def __init__(self, graph: Graph, options: dict[str, Any], threads: int | None):
        if threads:
            import torch

            torch.set_num_threads(threads)
        from masgraph.runtime.engine import Engine

        self.engine = Engine(graph, options=BackendOptions(**options))

    def pid(self) -> int:
        return os.getpid()

    async def run(self, ep: EpisodeInput, index: int, seed: int) -> tuple[Trace, list[Any]]:
        """One episode, unscored (the driver scores it), with the events it emitted."""
        from masgraph.events import ListSink

        events = ListSink()
        sched = self.engine.scheduler([events], concurrency=1_000_000, seed=seed)
        trace = await sched.run_episode(ep, index=index)
        return trace, events.events

    def publish(self, adapter: str, version: int, files: dict[str, bytes]) -> None:
        for backend in self.engine.backends.values():
            if callable(getattr(backend, "publish", None)):
                backend.publish(adapter, version, _Files(files))

    def load_adapter(self, name: str, files: dict[str, bytes]) -> None:
        with tempfile.TemporaryDirectory(prefix="masgraph-worker-") as tmp:
            self.engine.load_adapters({name: Path(_Files(files).save(tmp))})

    async def aclose(self) -> None:
        await self.engine.aclose()


class WorkerPool:
    """N rollout actors over one graph; replaces a dead one (re-sending what was published) and re-runs its
    episodes elsewhere. A `SyncedBackend` to the learner's weight sync: `publish` goes through the object store.

    Example:
        >>> pool = WorkerPool(graph, RayConfig(workers=2), BackendOptions(deterministic=True))
        >>> trace, events = asyncio.run(pool.run(EpisodeInput("q1", "What is 2+3?"), index=0, seed=0))
    """

    returns_tokens = True

    def __init__(self, graph: Graph, config: RayConfig, options: BackendOptions):
        ray = require_ray()
        self.ray, self.graph, self.config = ray, graph, config
        self.options = asdict(options) | {"log_dir": None}  # a worker's server logs stay on its node
        connect(ray, config)
        need, have = config.workers * config.gpus_per_worker, ray.cluster_resources().get("GPU", 0.0)
        if need > have:  # Ray would leave the workers pending forever
            raise MasgraphError(f"{config.workers} workers x --gpus-per-worker {config.gpus_per_worker:g} need "
                                f"{need:g} GPUs, and the Ray cluster has {have:g}; fix: fewer workers, a smaller "
                                "--gpus-per-worker, or drop it to run the workers on CPUs")
        env = {"runtime_env": {"env_vars": dict(config.env)}} if config.env else {}
        self._actor = ray.remote(RolloutWorker).options(num_cpus=config.cpus_per_worker,
                                                        num_gpus=config.gpus_per_worker, max_concurrency=1000, **env)
        self._graph_ref = ray.put(graph)
        local = not config.address
        self._threads = max(1, (os.cpu_count() or 1) // config.workers) if local else None
        self._published: dict[str, tuple[int, Any]] = {}  # adapter -> (version, object ref of its files)
        self._loaded: dict[str, Any] = {}  # checkpoint adapters: name -> object ref of its files
        self.workers = [self._start() for _ in range(config.workers)]
        self.in_flight = [0] * config.workers
        self.stats = {"episodes": 0, "reruns": 0, "replaced": 0}
        ray.get([w.pid.remote() for w in self.workers])  # every worker up (the model loaded) before timing starts

    def _start(self) -> Any:
        worker = self._actor.remote(self._graph_ref, self.options, self._threads)
        for name, ref in self._loaded.items():  # submitted before any episode: a worker runs them first
            worker.load_adapter.remote(name, ref)
        for adapter, (version, ref) in self._published.items():
            worker.publish.remote(adapter, version, ref)
        return worker

    def pids(self) -> list[int]:
        return self.ray.get([w.pid.remote() for w in self.workers])

    async def run(self, ep: EpisodeInput, index: int, seed: int) -> tuple[Trace, list[Any]]:
        """Run the episode on the least busy worker; when that worker dies, on another (a replacement is started)."""
        errors = []
        for _ in range(MAX_ATTEMPTS):
            slot = min(range(len(self.workers)), key=self.in_flight.__getitem__)
            worker = self.workers[slot]
            self.in_flight[slot] += 1
            try:
                result = await worker.run.remote(ep, index, seed)
                self.stats["episodes"] += 1
                return result
            except self.ray.exceptions.RayActorError as exc:
                errors.append(f"{type(exc).__name__}")
                self.stats["reruns"] += 1
                if self.workers[slot] is worker:  # the first episode to see the death replaces the worker
                    self.workers[slot] = self._start()
                    self.in_flight[slot] = 0
                    self.stats["replaced"] += 1
                    self.ray.kill(worker, no_restart=True)
            finally:
                if self.workers[slot] is worker:
                    self.in_flight[slot] -= 1
        raise MasgraphError(f"episode {ep.item_id}/{ep.sample}: {MAX_ATTEMPTS} rollout workers died running it "
                            f"({', '.join(errors)})")

    def publish(self, adapter: str, version: int, source: Any) -> None:
        """Every worker serves `version` of `adapter` (the files go through the object store once)."""
        with tempfile.TemporaryDirectory(prefix="masgraph-publish-") as tmp:
            ref = self.ray.put(read_dir(source.save(tmp)))
        self._published[adapter] = (version, ref)
        self.ray.get([w.publish.remote(adapter, version, ref) for w in self.workers])

    def load_adapters(self, adapters: dict[str, Path]) -> None:
        """Every worker serves these trained adapters (a checkpoint's or a bundle's)."""
        for name, path in adapters.items():
            self._loaded[name] = self.ray.put(read_dir(path))
            self.ray.get([w.load_adapter.remote(name, self._loaded[name]) for w in self.workers])

    async def complete(self, requests: list) -> list:
        raise MasgraphError("a WorkerPool runs whole episodes (RayScheduler), not single completions")

    async def aclose(self) -> None:
        for w in self.workers:
            try:
                await w.aclose.remote()
            except self.ray.exceptions.RayActorError:
                pass
            self.ray.kill(w)
        self.workers = []


class RayScheduler:
    """The scheduler's interface (`run`, `run_episode`, `sink_errors`) over a worker pool: episodes run on the
    workers; scoring and every event happen here, on the driver, in the order each episode produced them."""

    def __init__(self, pool: WorkerPool, sinks: Sequence[Sink] = (), concurrency: int = 16, seed: int = 0,
                 score: Callable[[EpisodeInput, Trace], float] | None = None):
        self.pool, self.concurrency, self.seed, self.score = pool, concurrency, seed, score
        self._emit = Emitter(sinks)

    @property
    def sink_errors(self) -> int:
        return self._emit.errors

    async def run(self, episodes: Iterable[EpisodeInput]) -> list[Trace]:
        return await run_bounded(self.run_episode, episodes, self.concurrency)

    async def run_episode(self, ep: EpisodeInput, index: int = 0) -> Trace:
        try:
            trace, events = await self.pool.run(ep, index, self.seed)
        except MasgraphError as exc:  # every worker it ran on died: recorded as a failed episode
            trace = Trace(episode_id=ep.episode_id or f"{index:06d}-{ep.item_id}-{ep.sample}", item_id=ep.item_id,
                          query=ep.query, meta={"sample": ep.sample, **ep.meta}, status="error", error=str(exc))
            events = [EpisodeFinished(trace=trace)]
        await apply_score(self.score, ep, trace)  # the EpisodeFinished event holds this same trace
        for event in events:
            self._emit(event)
        return trace


class RayEngine(EngineLike):
    """What a `Runner` needs of an engine, with episodes on Ray workers.

    Example:
        >>> runner = Runner(graph, config, engine=RayEngine(graph, RayConfig(workers=2), BackendOptions()))
    """

    in_process = False

    def __init__(self, graph: Graph, config: RayConfig, options: BackendOptions):
        self.graph = graph
        self.pool = WorkerPool(graph, config, options)
        self.backends: dict[tuple, Any] = {("ray", config.address, config.workers): self.pool}
        self.policies: dict[str, Any] = {}

    def scheduler(self, sinks: Sequence[Sink] = (), score: Callable[[EpisodeInput, Trace], float] | None = None,
                  concurrency: int = 16, seed: int = 0, memo_greedy: bool = False) -> RayScheduler:
        """Episodes on the workers; `memo_greedy` is not applied there (the same completions, decoded again)."""
        return RayScheduler(self.pool, sinks, concurrency, seed, score)

    def load_checkpoint(self, path: str | Path) -> Path:
        from masgraph.rundir.checkpoint import checkpoint_adapters, resolve_checkpoint

        checkpoint = resolve_checkpoint(path)
        self.pool.load_adapters(checkpoint_adapters(checkpoint, self.graph.spec))
        return checkpoint

    def load_adapters(self, adapters: dict[str, Path]) -> None:
        self.pool.load_adapters(adapters)

    async def aclose(self) -> None:
        await self.pool.aclose()
