"""The documented multi-node path, on one machine: a cluster started with `ray start --head`, joined by `masgraph run
--ray --address HOST:PORT` on the real model; a `--ray` run without an address beside it starts a Ray of its own
(plain `ray.init()` would have joined that cluster, found through its temp dir)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def head(free_port):
    """`ray start --head --block` in a temp dir of its own (terminating it stops the cluster; `ray stop` would stop
    every Ray on the machine); yields (address, the $RAY_TMPDIR under which plain `ray.init()` finds it, the head
    session's log dir)."""
    from masgraph.runtime.ray_engine import check_address

    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="mgray")  # short: Ray's socket paths live under it
    temp = os.path.join(tmpdir, "ray")  # Ray's default temp dir when $RAY_TMPDIR is `tmpdir`
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_worker_niceness": "0"}  # as the README says to start a cluster: workers not starved by other work
    proc = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp}",
                             "--include-dashboard=false", "--disable-usage-stats"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    address, deadline = f"127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            check_address(address)
            break
        except Exception:
            assert proc.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
    yield address, tmpdir, Path(temp, "session_latest").resolve() / "logs"
    proc.terminate()
    proc.wait(60)
    shutil.rmtree(tmpdir, ignore_errors=True)


def run(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "masgraph.cli", "run", str(ROOT / "graphs/agentflow.yaml"), "--task",
           "basic_arithmetic", "--n", "2", "--ray", "--workers", "1", "--runs-dir", str(tmp_path), *extra]
    inherited = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the flag or `env` says where
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**inherited, "RAY_AUTH_MODE": "disabled", **(env or {})})


def drivers(logs: Path) -> set[str]:
    """The drivers (client processes) that have connected to the head: Ray logs each in the head session's dir."""
    return {p.name for p in logs.glob("python-core-driver-*")}


def episodes(tmp_path: Path) -> int:
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    return json.loads((run_dir / "summary.json").read_text())["episodes"]


def test_a_run_joins_a_cluster_started_with_ray_start(head, tmp_path):
    address, _, logs = head
    before = drivers(logs)
    proc = run(tmp_path, "--address", address)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"on the cluster at {address} (--address)" in proc.stderr
    assert episodes(tmp_path) == 2
    assert len(drivers(logs) - before) == 1  # this run's driver connected to the head


def test_without_an_address_a_run_starts_its_own_ray_beside_a_running_cluster(head, tmp_path):
    _, tmpdir, logs = head
    before = drivers(logs)
    # $RAY_TMPDIR points Ray at the head's temp dir, where plain ray.init() finds the cluster (ray_current_cluster)
    proc = run(tmp_path, env={"RAY_TMPDIR": tmpdir})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on a local Ray started for this run" in proc.stderr
    assert episodes(tmp_path) == 2
    assert drivers(logs) == before  # it never connected to the head
