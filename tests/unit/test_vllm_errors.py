"""The vLLM backend's errors without vLLM: a python without it, a server that never comes up. (The backend itself
is tested on real vLLM servers in tests/vllm, `make test-vllm`.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from masgraph.backends.base import BackendError
from masgraph.backends.vllm_server import VLLMServer, server_command

ROOT = Path(__file__).resolve().parents[2]


def test_the_server_command_is_token_exact_and_serves_runtime_lora():
    cmd = server_command("py", "/m", "smol", 8001, "float32", 3, 16, 4, 2048, ["--max-num-seqs", "8"])
    flags = " ".join(cmd)
    for flag in ("--logprobs-mode processed_logprobs", "--enable-lora", "--max-lora-rank 16", "--enforce-eager",
                 "--enable-prefix-caching", "--max-model-len 2048", "--no-enable-chunked-prefill", "--seed 3",
                 "--dtype float32"):
        assert flag in flags
    assert cmd[-2:] == ["--max-num-seqs", "8"]


def test_a_python_without_vllm_is_a_clear_error_with_the_fix(tmp_path):
    server = VLLMServer(ROOT / ".cache", "smol", tmp_path / "vllm-server.log", python=sys.executable)
    with pytest.raises(BackendError, match=r"exited while starting.*make vllm.*vllm-server\.log"):
        server.start()
    assert "No module named" in (tmp_path / "vllm-server.log").read_text()


def test_masgraph_run_with_backend_vllm_and_no_vllm_prints_an_error_line(tmp_path):
    env = {"MASGRAPH_VLLM_PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "XDG_CACHE_HOME": str(ROOT / ".cache")}
    proc = subprocess.run([sys.executable, "-m", "masgraph.cli", "run", str(ROOT / "graphs/agentflow.yaml"), "--task",
                           "basic_arithmetic", "--n", "1", "--backend", "vllm", "--runs-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "error: the vLLM server exited while starting" in proc.stderr and "make vllm" in proc.stderr
    [run] = list(tmp_path.iterdir())
    assert (run / "vllm-server.log").exists()  # the log is kept in the run dir


def test_unknown_backend_flag_is_an_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "masgraph.cli", "run", str(ROOT / "graphs/agentflow.yaml"), "--task",
                           "basic_arithmetic", "--backend", "vlm"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "error: --backend vlm: not a registered backend" in proc.stderr
