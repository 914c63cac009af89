"""Export → deploy on the real model: a bundle exported from a joint training run (adapters + learned topology),
copied to a fresh directory with the run deleted, served by a new `masgraph serve` process, answers the same
questions exactly as `masgraph run --checkpoint` does (deterministic mode), topology decisions included."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.gpu]  # the GPU tier runs these on CUDA (device: auto)

N = 4


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "masgraph.cli", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_an_exported_bundle_served_elsewhere_answers_like_run_checkpoint(root, tmp_path, free_port, wait_healthy):
    work = tmp_path / "work"
    work.mkdir()
    _cli("train", str(root / "graphs" / "router.yaml"), "--steps", "1", "--queries-per-step", "1", "--eval-every",
         "0", "--eval-n", "2", "--runs-dir", str(work / "runs"), cwd=work)
    [run] = (work / "runs").iterdir()
    assert (run / "checkpoints" / "step-1" / "topology.pt").is_file()

    # the reference: `masgraph run --checkpoint` on held-out items, deterministic
    # one episode at a time, like the server is asked below: no episode nears its time limit on a busy machine
    _cli("run", str(run / "spec.yaml"), "--checkpoint", str(run), "--task", "basic_arithmetic", "--n", str(N),
         "--deterministic", "--concurrency", "1", "--runs-dir", str(work / "eval"), cwd=work)
    [eval_dir] = (work / "eval").iterdir()
    events = [json.loads(x) for x in (eval_dir / "events.jsonl").read_text().splitlines()]
    finished = [e["trace"] for e in events if e["kind"] == "episode_finished"]
    assert [t["status"] for t in finished] == ["ok"] * N, [t["error"] for t in finished]
    expected = {t["query"]: (t["answer"], t["topology"]["decisions"]) for t in finished}

    _cli("export", str(run), "--out", str(work / "bundle"), cwd=work)
    deployed = tmp_path / "deployed"
    shutil.copytree(work / "bundle", deployed / "agent")
    shutil.rmtree(work)  # no run dir, no checkpoint, no training files around

    port, log = free_port(), open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", "agent", "--port", str(port),
                             "--deterministic", "--no-store"], cwd=deployed, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180, (tmp_path / "server.log").read_text)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        got = {}
        for query in expected:
            r = client.chat.completions.create(model="router", messages=[{"role": "user", "content": query}],
                                               extra_body={"masgraph": {"trace": True}})
            got[query] = (r.choices[0].message.content, r.model_extra["masgraph"]["topology"])
        assert got == expected
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
