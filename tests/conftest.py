"""Shared fixtures: the shipped graphs, a scripted backend that answers by node, a runner factory."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# before any test module imports torch, so its threads wait passively on a busy machine (masgraph/__init__.py)
import masgraph  # noqa: E402, F401, I001

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


def pytest_collection_modifyitems(config, items):
    """`make test-gpu` (`-m gpu`) runs the real-model tests on CUDA, since their graphs say `device: auto`; on a
    machine where torch sees no GPU it would pass on the CPU and prove nothing, so it stops instead."""
    if (config.option.markexpr or "").strip() != "gpu":
        return
    import torch

    if not torch.cuda.is_available():
        pytest.exit(f"the GPU tier needs a CUDA GPU, and torch {torch.__version__} sees none; run it on a GPU "
                    "machine (make setup picks the CUDA build there), or run `make test` here", returncode=4)


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
    from masgraph.runtime.runner import RunConfig, Runner

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

    def versions(run, adapter: str) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        step, seen = 1, {}
        for line in (run / "events.jsonl").read_text().splitlines():
            d = json.loads(line)
            if d["kind"] == "train_step" and d["step"] >= 1:
                step += 1
            elif d["kind"] == "step" and not d["step"].get("episode_id", "").startswith("eval"):
                # a finished node step of a rollout, with its LLM calls (an evaluation's episodes, `eval<step>-...`,
                # run after the step's update, on the version it made)
                for call in d["step"].get("llm", []):
                    if call.get("adapter") == adapter:
                        seen.setdefault(step, set()).add(call.get("policy_version", 0))
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


@pytest.fixture
def busy():
    """`with busy(n):` runs n processes that spin on a core each beside the block (a busy machine, as users have):
    exactness and resume checks run under it, so a result that depends on timing fails here, not for a user."""
    import contextlib
    import subprocess
    import sys

    @contextlib.contextmanager
    def loops(n: int = 2):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        try:
            yield spinners
        finally:
            for p in spinners:
                p.kill()
                p.wait()

    return loops


# ---- tiny random-weight models of real architectures (no download) --------------------------------------------
# A few layers, a small hidden size and the embedded SmolLM2's tokenizer (its chat template, EOS and pad), saved as
# a plain HF directory that `model: /path` loads like any local model.

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "phi")
"""Architectures people train agents with, each a transformers model type."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _build_tiny(arch: str, out: Path, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """Write a random-weight `arch` model with SmolLM2's tokenizer to `out`; returns `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from masgraph.model import resolve_model

    src = resolve_model("smollm2-135m")
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = AutoTokenizer.from_pretrained(out)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
               "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model("qwen3")` -> the directory of a tiny random Qwen3 (built once per session per architecture)."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = _build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get
