"""Streaming on the real model (issue 30, finding 4): `masgraph serve graphs/agentflow.yaml --deterministic` in its
own process, read over a socket with the official `openai` client. The generator's answer streams token by token:
its first content chunk arrives before the episode's last node (the generator) has finished, by the clock of the
stored trace; and the streamed text equals the non-streamed answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.gpu]

QUESTIONS = ["What is 123456 + 654321?", "What is the capital of France?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_port, wait_healthy):
    """`masgraph serve graphs/agentflow.yaml --deterministic`; yields (base URL, runs dir)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs, port = tmp_path_factory.mktemp("stream-runs"), free_port()
    log = open(runs.parent / "stream-server.log", "w")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", os.path.join(root, "graphs",
                             "agentflow.yaml"), "--port", str(port), "--runs-dir", str(runs), "--deterministic"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180, (runs.parent / "stream-server.log").read_text)
    yield url, runs
    proc.terminate()
    proc.wait(60)
    log.close()


def _stored_steps(runs, trace_id: str) -> list[dict]:
    """The steps of an episode as the server stored them (each with its start time and duration)."""
    [run_dir] = list(runs.iterdir())
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return sorted((e["step"] for e in events if e["kind"] == "step" and e["step"]["episode_id"] == trace_id),
                  key=lambda s: s["index"])


def test_the_generators_answer_streams_before_the_episode_ends_and_equals_the_whole_answer(server):
    url, runs = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    for question in QUESTIONS:
        chunks = []
        for c in client.chat.completions.create(model="agentflow", messages=[{"role": "user", "content": question}],
                                                stream=True, extra_body={"masgraph": {"trace": True}}):
            chunks.append((time.time(), c))
        content = [(t, c.choices[0].delta.content) for t, c in chunks if c.choices and c.choices[0].delta.content]
        ext = chunks[-1][1].model_extra["masgraph"]
        assert ext["status"] == "ok" and ext["steps"][-1]["node"] == "generator"
        whole = client.chat.completions.create(model="agentflow", messages=[{"role": "user", "content": question}])
        assert "".join(text for _, text in content) == whole.choices[0].message.content, question
        last = _stored_steps(runs, ext["trace_id"])[-1]
        assert last["node"] == "generator"
        generator_done = last["started"] + last["duration_s"]
        # the answer streams while the generator decodes (a number of several digits comes in several chunks)
        assert content[0][0] < generator_done, (question, content[0][0] - generator_done)
        if any(ch.isdigit() for ch in whole.choices[0].message.content[:3]):
            assert len(content) >= 2, (question, content)
        # the first node's text (the planner writes too) never streams: every chunk is part of the answer
        assert all(text in whole.choices[0].message.content for _, text in content)
