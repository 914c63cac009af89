"""`masgraph serve` on the real model: a real server process on a socket, talked to by the official `openai` client
(sync, async, streaming) and by `litellm`; 100 concurrent requests complete with zero errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from masgraph.rundir.store import read_traces

pytestmark = [pytest.mark.integration, pytest.mark.gpu]  # the GPU tier runs these on CUDA (device: auto)

QUESTIONS = [f"What is {a} + {b}?" for a, b in [(2, 3), (12, 7), (40, 2), (9, 9)]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_port, wait_healthy):
    """`masgraph serve graphs/agentflow.yaml` in its own process; yields (base URL, runs dir)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs, port = tmp_path_factory.mktemp("serve-runs"), free_port()
    log = open(runs.parent / "server.log", "w")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", os.path.join(root, "graphs",
                             "agentflow.yaml"), "--port", str(port), "--runs-dir", str(runs), "--api-key", "test-key",
                             "--timeout", "1800"],  # 100 requests queue behind each other on a busy 2-core box
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180, (runs.parent / "server.log").read_text)
    yield url, runs
    proc.terminate()
    proc.wait(60)
    log.close()


def test_openai_sync_client_gets_the_graphs_answer_with_the_usage_of_every_call(server):
    url, runs = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0)
    assert [m.id for m in client.models.list()] == ["agentflow"]
    r = client.chat.completions.create(model="agentflow", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       extra_body={"masgraph": {"trace": True}})
    ext = r.model_extra["masgraph"]
    nodes = [s["node"] for s in ext["steps"]]
    assert nodes[0] == "planner" and nodes[-1] == "generator" and ext["status"] == "ok"
    assert r.choices[0].message.content  # the 135M model's answer (right or wrong), never empty on an ok episode
    # usage sums every LLM call of the episode: more than one call's worth of prompt tokens
    assert r.usage.prompt_tokens > 100 * (len(nodes) - 1) and r.usage.completion_tokens >= len(nodes) - 1
    # the trace is stored in the server's run dir
    [run_dir] = list(runs.iterdir())
    stored = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert ext["trace_id"] in {e["trace"]["episode_id"] for e in stored if e["kind"] == "episode_finished"}


def test_openai_streaming_and_async_clients(server):
    url, _ = server
    sync = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0)
    whole = sync.chat.completions.create(model="agentflow", messages=[{"role": "user", "content": QUESTIONS[1]}])
    chunks = list(sync.chat.completions.create(model="agentflow", stream=True, stream_options={"include_usage": True},
                                               messages=[{"role": "user", "content": QUESTIONS[1]}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens > 0
    assert whole.choices[0].message.content

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0) as client:
            rs = await asyncio.gather(*(client.chat.completions.create(
                model="agentflow", messages=[{"role": "user", "content": q}]) for q in QUESTIONS))
            stream = await client.chat.completions.create(model="agentflow", stream=True,
                                                          messages=[{"role": "user", "content": QUESTIONS[2]}])
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return rs, text

    rs, text = asyncio.run(main())
    assert all(r.choices[0].message.content for r in rs) and text


def test_litellm_talks_to_it(server):
    import litellm

    url, _ = server
    r = litellm.completion(model="openai/agentflow", api_base=f"{url}/v1", api_key="test-key",
                           messages=[{"role": "user", "content": QUESTIONS[3]}])
    assert r.choices[0].message.content and r.usage.completion_tokens > 0


@pytest.mark.slow
def test_100_concurrent_requests_complete_with_zero_errors(server):
    url, _ = server

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model="agentflow", messages=[{"role": "user", "content": f"What is {i} + {i + 1}?"}])
                for i in range(100)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(r.choices[0].message.content for r in results)
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer test-key"}).text
    assert 'masgraph_episodes_total{status="ok"}' in metrics


def test_the_answering_nodes_fields_on_the_real_model(server):
    """max_tokens cuts the generator's call (finish_reason length, one token in the stored trace), stop cuts the
    answer a seeded greedy request repeats, logprobs are the real model's for the answer's tokens, and a question
    over the context is a 400 before any episode runs (issue 57, findings 4, 5, 8)."""
    url, runs = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0)
    ask = {"model": "agentflow", "messages": [{"role": "user", "content": QUESTIONS[0]}], "seed": 5, "temperature": 0}
    r = client.chat.completions.create(**ask, logprobs=True)
    answer, tokens = r.choices[0].message.content, r.choices[0].logprobs.content
    assert answer and answer in "".join(t.token for t in tokens) and all(t.logprob <= 0 for t in tokens)
    cut = client.chat.completions.create(**ask, stop=[answer[-1]]).choices[0]
    assert cut.message.content == answer[:answer.index(answer[-1])] and cut.finish_reason == "stop"
    short = client.chat.completions.create(**ask, max_tokens=1, extra_body={"masgraph": {"trace": True}})
    assert short.choices[0].finish_reason == "length"
    [run_dir] = list(runs.iterdir())
    [trace] = [t for t in read_traces(run_dir) if t.episode_id == short.model_extra["masgraph"]["trace_id"]]
    [generator] = [s for s in trace.steps if s.node == "generator"]
    assert [len(c.completion_ids) for c in generator.llm] == [1]  # the stored call: one token decoded
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="agentflow", messages=[{"role": "user", "content": "seven " * 5000}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
