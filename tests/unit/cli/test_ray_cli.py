"""Ray stays optional: nothing imports it unless --ray asks, a missing Ray is an error line, flags are checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GRAPH = str(ROOT / "graphs/agentflow.yaml")


def run_cli(args: list[str], block_ray: bool = False) -> subprocess.CompletedProcess:
    code = ("import sys\n" + ("sys.modules['ray'] = None  # as if Ray were not installed\n" if block_ray else "")
            + "from masgraph.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_local_runs_and_training_import_no_ray():
    code = ("import sys; import masgraph.cli, masgraph.runtime.runner, masgraph.trainers.loop; "
            "import masgraph.runtime.ray_engine; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_ray_flag_without_ray_installed_is_an_error_line(tmp_path):
    proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--n", "1", "--ray", "--runs-dir", str(tmp_path)],
                   block_ray=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: --ray needs Ray: pip install 'ray==2.60.0'" in proc.stderr
    assert not list(tmp_path.iterdir())  # found before a run dir is made


@pytest.mark.slow
def test_worker_flags_need_ray(tmp_path):
    proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--ray", "--gpus-per-worker", "1.5"])
    assert proc.returncode == 2 and "error: --gpus-per-worker 1.5: Ray shares a GPU" in proc.stderr
    for extra in (["--workers", "3"], ["--address", "auto"], ["--gpus-per-worker", "1"]):
        proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--n", "1", "--runs-dir", str(tmp_path), *extra])
        assert proc.returncode == 2 and "error: --workers, --address and --gpus-per-worker need --ray" in proc.stderr
    proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--ray", "--workers", "0"])
    assert proc.returncode == 2 and "--workers" in proc.stderr


@pytest.mark.slow
def test_asking_for_more_gpus_than_the_ray_cluster_has_is_an_error_line_not_a_hang(tmp_path):
    """An actor that reserves a GPU the cluster lacks stays pending for ever; this is found before any waits."""
    proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--n", "1", "--ray", "--workers", "2",
                    "--gpus-per-worker", "0.5", "--runs-dir", str(tmp_path)])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: 2 workers x --gpus-per-worker 0.5 need 1 GPUs, and the Ray cluster has 0" in proc.stderr
    assert not list(tmp_path.iterdir())  # and no run dir is left behind


@pytest.mark.slow
def test_an_address_no_ray_cluster_answers_at_fails_in_seconds_with_the_fix(tmp_path):
    """`ray.init` waits minutes for an address nothing (or no GCS) answers at; these fail before any run dir."""
    import http.server
    import threading
    import time

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # a dashboard, say
    threading.Thread(target=web.serve_forever, daemon=True).start()
    cases = [(["--address", "127.0.0.1:1"], {}, "error: --address 127.0.0.1:1: no Ray cluster answers there"),
             (["--address", f"127.0.0.1:{web.server_port}"], {}, "something answers there, but not a gRPC server"),
             (["--address", "http://127.0.0.1:8265"], {}, "URLs (the Jobs API's) are not supported"),
             (["--address", "ray://127.0.0.1:10001"], {}, "Ray Client addresses (ray://) are not supported"),
             (["--address", "headnode"], {}, "error: --address headnode: expected HOST:PORT"),
             (["--address", "no-such-host.invalid:6379"], {}, "cannot resolve the host 'no-such-host.invalid'"),
             (["--address", "::1:6379"], {}, "an IPv6 address needs brackets, e.g. [::1]:6379"),
             ([], {"RAY_ADDRESS": "127.0.0.1:1"}, "error: $RAY_ADDRESS 127.0.0.1:1: no Ray cluster answers there"),
             ([], {"RAY_ADDRESS": "http://127.0.0.1:8265"}, "(the Jobs API's) are not supported; unset RAY_ADDRESS")]
    try:
        for extra, env, message in cases:
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "masgraph.cli", "run", GRAPH, "--task", "basic_arithmetic",
                                   "--n", "1", "--ray", "--runs-dir", str(tmp_path), *extra], capture_output=True,
                                  text=True, timeout=120, env={**os.environ, **env})
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert message in proc.stderr, proc.stderr
            assert time.monotonic() - t0 < 30
    finally:
        web.shutdown()
    assert not list(tmp_path.iterdir())


def test_ray_start_errors_become_one_error_line():
    import pytest

    from masgraph.errors import MasgraphError
    from masgraph.runtime.ray_engine import RayConfig, connect

    class NoCluster:  # what ray.init does for `auto` with no cluster on the machine
        calls: list[dict] = []

        @staticmethod
        def is_initialized() -> bool:
            return False

        @classmethod
        def init(cls, **kwargs) -> None:
            cls.calls.append(kwargs)
            if kwargs["address"] != "local":
                raise ConnectionError("Could not find any running Ray instance. Please specify the one\nto connect")

    with pytest.raises(MasgraphError, match=r"^cannot join the Ray cluster at auto: Could not find any running Ray "
                                            r"instance\. Please specify the one; start one with `ray start --head`"):
        connect(NoCluster, RayConfig(address="auto"))
    connect(NoCluster, RayConfig(workers=2))  # a local run asks for a new instance, never one found on the machine
    assert NoCluster.calls[-1]["address"] == "local"


def test_where_the_cluster_comes_from(monkeypatch):
    from masgraph.runtime.ray_engine import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(None) == (None, "")  # a local Ray for the run
    assert cluster_address("local") == (None, "--address local")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert cluster_address(None) == ("10.0.0.5:6379", "$RAY_ADDRESS")  # Ray's convention on a cluster node
    assert cluster_address("10.0.0.9:6379") == ("10.0.0.9:6379", "--address")
    assert cluster_address("local") == (None, "--address local")
