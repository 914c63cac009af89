"""Ray stays optional: nothing imports it unless --ray asks, a missing Ray is an error line, flags are checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAPH = str(ROOT / "graphs/agentflow.yaml")


def run_cli(args: list[str], block_ray: bool = False) -> subprocess.CompletedProcess:
    code = ("import sys\n" + ("sys.modules['ray'] = None  # as if Ray were not installed\n" if block_ray else "")
            + "from masgraph.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_local_runs_and_training_import_no_ray():
    code = ("import sys; import masgraph.cli, masgraph.runner, masgraph.trainers.loop, masgraph.ray_rollouts; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_ray_flag_without_ray_installed_is_an_error_line(tmp_path):
    proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--n", "1", "--ray", "--runs-dir", str(tmp_path)],
                   block_ray=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: --ray needs Ray: pip install 'ray==2.60.0'" in proc.stderr
    assert not list(tmp_path.iterdir())  # found before a run dir is made


def test_worker_flags_need_ray(tmp_path):
    for extra in (["--workers", "3"], ["--address", "auto"]):
        proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--n", "1", "--runs-dir", str(tmp_path), *extra])
        assert proc.returncode == 2 and "error: --workers and --address need --ray" in proc.stderr
    proc = run_cli(["run", GRAPH, "--task", "basic_arithmetic", "--ray", "--workers", "0"])
    assert proc.returncode == 2 and "--workers" in proc.stderr
