"""Shared fixtures: the shipped graphs, a scripted backend that answers by node, a runner factory."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ROOT = Path(__file__).resolve().parents[1]

REPLIES = {
    "planner": "Sub-goal: 2 + 3\nTool: calculator",
    "executor": "Input: 2 + 3",
    "verifier": "Conclusion: STOP",
    "generator": "Answer: 5",
    "direct": "Answer: 6",
    "judge": "Answer: 5",
    "answer": "Answer: 5",
}


@pytest.fixture(autouse=True)
def _isolated_registry():
    """Agents and tools a test registers do not leak into the next test (the process registry is restored)."""
    from masgraph.registry import default_registry

    reg = default_registry()
    saved = {k: dict(v) if isinstance(v, dict) else set(v) if isinstance(v, set) else v
             for k, v in vars(reg).items()}
    yield
    for k, v in saved.items():
        setattr(reg, k, v)


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def graph_files() -> list[Path]:
    return sorted((ROOT / "graphs").rglob("*.yaml"))


@pytest.fixture
def scripted():
    """scripted(overrides) -> a ScriptedBackend replying by node name (request key = (ep, node, turn, k))."""
    from masgraph.backends.scripted import ScriptedBackend

    def make(overrides: dict | None = None, delay_s: float = 0.0) -> ScriptedBackend:
        table = {**REPLIES, **(overrides or {})}

        def reply(req):
            r = table[req.key[1]]
            return r(req) if callable(r) else r
        return ScriptedBackend(default=reply, delay_s=delay_s)
    return make


@pytest.fixture
def runner_for(tmp_path):
    """runner_for(graph, backend, **config) -> a Runner whose every policy is served by `backend`."""
    from masgraph.runner import RunConfig, Runner

    def make(graph, backend, **config):
        config.setdefault("runs_dir", str(tmp_path / "runs"))
        config.setdefault("split", "train")
        return Runner(graph, RunConfig(**config), backends={"hf": backend, "scripted": backend, "litellm": backend})
    return make


@pytest.fixture
def run():
    """Drive a coroutine to completion (tests are sync; the library is async-only)."""
    return asyncio.run


@pytest.fixture(scope="session")
def free_port():
    """free_port() -> a TCP port on 127.0.0.1 nobody listens on (for a server a test starts)."""
    import socket

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return pick


@pytest.fixture(scope="session")
def wait_healthy():
    """wait_healthy(url, proc, seconds, log) -> once GET url/health answers 200; if the server process exits or
    the time runs out, it is killed and the test fails with `log()` (the server's output)."""
    import contextlib
    import time

    import httpx

    def wait(url: str, proc, seconds: float, log=lambda: "") -> None:
        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server at {url} did not start:\n{log()}")
            time.sleep(0.1)
    return wait


@pytest.fixture(scope="session")
def rollout_versions():
    """rollout_versions(run_dir, adapter) -> (seen, expected): per training step, the versions of `adapter` its
    rollouts recorded, and the one they should have run on (how many steps before it updated the adapter:
    metrics.jsonl has the adapter's grad norm for each step that did)."""
    import json
    import re

    def versions(run, adapter: str) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        step, seen = 1, {}
        for line in (run / "events.jsonl").read_text().splitlines():
            d = json.loads(line)
            if d["kind"] == "train_step" and d["step"] >= 1:
                step += 1
            elif d["kind"] == "step":  # a finished node step, with its LLM calls
                for v in re.findall(rf'"adapter":"{adapter}","policy_version":(\d+)', line):
                    seen.setdefault(step, set()).add(int(v))
        metrics = (run / "metrics.jsonl").read_text().splitlines()
        updated = [f"grad_norm/{adapter}" in json.loads(line) for line in metrics]
        return seen, {k: {sum(updated[:k - 1])} for k in seen}
    return versions


class Processes:
    """Linux process checks from /proc, for tests that something left no process behind."""

    @staticmethod
    def state(pid: int) -> tuple[str, int] | None:
        """(state letter, process group) of a process, or None when there is none."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            return state, int(pgrp)
        except (OSError, ValueError, IndexError):
            return None

    def alive(self, pid: int) -> bool:
        """Running (a zombie is dead: only not yet reaped)."""
        s = self.state(pid)
        return s is not None and s[0] != "Z"

    def group(self, pgid: int) -> list[int]:
        """The live members of a process group."""
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and (s := self.state(int(p))) is not None
                and s[1] == pgid and s[0] != "Z"]

    @staticmethod
    def with_cmdline(marker: str) -> list[int]:
        """The processes whose command line (argv joined by NULs) contains `marker`."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                continue
        return found

    def gone(self, pids, within_s: float) -> bool:
        """Whether every one of `pids` is gone within `within_s` seconds."""
        deadline = time.monotonic() + within_s
        while any(self.alive(p) for p in pids):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


@pytest.fixture(scope="session")
def procs() -> Processes:
    return Processes()
