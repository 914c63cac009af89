"""The vLLM backend's errors without vLLM: a python without it, a server that never comes up. (The backend itself
is tested on real vLLM servers in tests/vllm, `make test-vllm`.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from masgraph.backends.base import BackendError
from masgraph.backends.vllm_server import VLLMServer, server_command

ROOT = Path(__file__).resolve().parents[3]


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


def test_the_server_gets_the_gpus_named_by_masgraph_vllm_devices(tmp_path, monkeypatch):
    """A server kept off the learner's GPU: $MASGRAPH_VLLM_DEVICES becomes its CUDA_VISIBLE_DEVICES (and only its)."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nenv > {tmp_path / 'env.txt'}\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setenv("MASGRAPH_VLLM_DEVICES", "1,2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(BackendError):  # no vLLM in this python: it exits while starting
        VLLMServer(ROOT / ".cache", "smol", tmp_path / "vllm-server.log", python=str(python)).start()
    assert "CUDA_VISIBLE_DEVICES=1,2" in (tmp_path / "env.txt").read_text().splitlines()


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_attached_server_that_is_not_there_or_not_vllm_is_an_error_line_and_leaves_no_run_dir(tmp_path):
    import http.server
    import threading

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # answers 404
    threading.Thread(target=other.serve_forever, daemon=True).start()
    cases = [("http://127.0.0.1:1/v1", "is a vLLM server running there?"),
             (f"http://127.0.0.1:{other.server_port}/v1", "/v1/models: HTTP 404; is it a vLLM server's OpenAI API")]
    try:
        for url, message in cases:
            proc = subprocess.run([sys.executable, "-m", "masgraph.cli", "run", str(ROOT / "graphs/agentflow.yaml"),
                                   "--task", "basic_arithmetic", "--n", "1", "--backend", "vllm", "--api-base", url,
                                   "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert f"error: vllm {url}" in proc.stderr and message in proc.stderr
    finally:
        other.shutdown()
    assert list(tmp_path.iterdir()) == []  # the run dirs made for them are gone: nothing was written there


SLEEPER = """
import os, subprocess, sys, time
stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 300"])  # a stuck engine core: ignores SIGTERM
print(os.getpid(), stubborn.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""

STARTER = """
import sys
from masgraph.backends.vllm_server import spawn_reaped
server = spawn_reaped([sys.executable, "-c", sys.argv[1], "300"], sys.stdout, grace_s=1)  # held: its pipe stays open
input()  # until killed
"""


@pytest.mark.slow
def test_a_server_started_by_a_process_that_is_sigkilled_goes_down_with_everything_it_started(procs):
    """A vLLM server (here a sleeper with a child that ignores SIGTERM) must not outlive masgraph, even after
    kill -9: the reaper sees its pipe close and takes the server's whole process group down."""
    import os
    import signal

    starter = subprocess.Popen([sys.executable, "-c", STARTER, SLEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        server, stubborn = map(int, starter.stdout.readline().split())
        assert procs.alive(server) and procs.alive(stubborn)  # running while the starter lives
        time.sleep(0.5)
        assert procs.alive(server) and procs.alive(stubborn)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        assert procs.gone([server, stubborn], 10)
    finally:
        starter.kill()


@pytest.mark.slow
def test_what_a_server_leaves_behind_when_it_ends_on_its_own_is_taken_down(procs):
    """The command exits (crashed, or stopped) with a stuck child still in its group: the reaper clears it."""
    from masgraph.backends.vllm_server import spawn_reaped

    proc = spawn_reaped([sys.executable, "-c", SLEEPER, "0"], subprocess.PIPE, grace_s=1)
    _, stubborn = map(int, proc.stdout.readline().split())
    assert proc.wait(30) == 0
    assert procs.gone([stubborn], 10)
    proc.stdin.close()
    proc.stdout.close()


def test_the_reaper_passes_the_commands_exit_status_on():
    from masgraph.backends.vllm_server import spawn_reaped

    for code, expected in (("sys.exit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
                           ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15)):
        proc = spawn_reaped([sys.executable, "-c", f"import sys; {code}"], subprocess.DEVNULL)
        assert proc.wait(30) == expected
        proc.stdin.close()
