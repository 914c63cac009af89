"""The OpenAI-compatible server on a scripted agent: a real uvicorn server on a socket, real HTTP clients (httpx and
the official `openai` client); every guard — auth, body limit, 400s, 404, 429, 504, disconnect, SIGTERM drain —
and the trace store's robustness (a bad record, a full disk), the connection guards (slow or silent connections,
a connection cap, hostile JSON, cross-site requests) and admission control (queue, time limit from the start)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from masgraph.agents.registry import register_agent
from masgraph.errors import MasgraphError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.node import NodeOutput
from masgraph.rundir import store as store_module
from masgraph.rundir.store import INDEX, RunStore, read_jsonl, read_traces
from masgraph.runtime.engine import Engine
from masgraph.serve.agent import Agent
from masgraph.serve.server import ServeConfig, check_bind, serve
from tests.unit.serve.serving import JSON, ask, raw, scripted_agent, serving, tracebacks, until, until_closed
from tests.unit.serve.serving import Disk as _Disk

SLOW = """\
name: slow
nodes:
  answer: {role: custom, agent: sleepy}
entry: answer
exit: answer
"""

GATED = SLOW.replace("sleepy", "gated").replace("name: slow", "name: gated")

EVENTS: list[str] = []
GATES: dict[str, threading.Event] = {}
"""Gates the `gated` agent waits on, by name; a test opens them (set) from its own thread."""


@register_agent("gated")
async def _gated(ctx):
    """Runs until the test opens the gate its question names (`gate a`)."""
    gate = GATES.setdefault(ctx.query.split()[-1], threading.Event())
    while not gate.is_set():
        await asyncio.sleep(0.01)
    return NodeOutput(text="opened", answer="opened")


def open_gate(name: str) -> None:
    GATES.setdefault(name, threading.Event()).set()


@register_agent("parrot-serve")
async def _parrot(ctx):
    return NodeOutput(text=ctx.query, answer=ctx.query)


@register_agent("sleepy")
async def _sleepy(ctx):
    """Sleeps as many seconds as the question says (`sleep 2`), recording whether it finished or was cancelled."""
    try:
        await asyncio.sleep(float(ctx.query.split()[-1]))
    except asyncio.CancelledError:
        EVENTS.append(f"cancelled {ctx.query}")
        raise
    EVENTS.append(f"finished {ctx.query}")
    return NodeOutput(text="slept", answer="slept")


@pytest.mark.slow
def test_openai_client_sync_streaming_and_the_trace_extension():
    with serving(scripted_agent()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["echo"]
        r = client.chat.completions.create(model="echo", messages=[{"role": "system", "content": "be brief"},
                                                                   {"role": "user", "content": "What is 2 + 3?"}])
        assert r.choices[0].message.content and r.choices[0].finish_reason == "stop"
        u = r.usage
        assert u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert not hasattr(r, "masgraph") or r.masgraph is None  # the extension is opt-in
        r = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"masgraph": {"trace": True}})
        ext = r.model_extra["masgraph"]
        assert ext["status"] == "ok" and [s["node"] for s in ext["steps"]] == ["answer"] and ext["trace_id"]
        chunks = list(client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}],
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content
        assert chunks[-1].usage.total_tokens == r.usage.total_tokens and chunks[-2].choices[0].finish_reason == "stop"


def test_async_client_requests_run_concurrently_on_one_engine():
    agent = scripted_agent()
    backend = next(iter(agent.engine.backends.values()))
    backend.delay_s = 0.3  # each backend call takes 0.3 s: 20 requests one by one would take 6 s

    async def main() -> list[str]:
        # closed here, on its own loop: an unclosed client's __del__ schedules its aclose on whatever loop runs when
        # it is collected (a later test's server), which logs "Task exception was never retrieved" there
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as client:
            rs = await asyncio.gather(*(client.chat.completions.create(**ask("q" * (i + 1))) for i in range(20)))
        return [r.choices[0].message.content for r in rs]

    with serving(agent) as url:
        t0 = time.perf_counter()
        answers = asyncio.run(main())
        assert [int(a) - int(answers[0]) for a in answers] == list(range(20))  # each got its own answer
        assert time.perf_counter() - t0 < 3.0


def test_auth_models_health_and_metrics():
    with serving(scripted_agent(), ServeConfig(api_key="s3cret")) as url:
        assert httpx.get(f"{url}/health").json()["status"] == "ok"  # liveness needs no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/chat/completions", json=ask("hi"), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").chat.completions.create(**ask("hi"))
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("hi"), headers=good).status_code == 200
        metrics = httpx.get(f"{url}/metrics", headers=good).text
        assert 'masgraph_requests_total{code="401",path="/v1/chat/completions"} 4.0' in metrics
        assert 'masgraph_episodes_total{status="ok"} 1.0' in metrics and "masgraph_tokens_total" in metrics


@pytest.mark.parametrize("body, code, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "model"),
    (json.dumps({"model": "echo", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "echo", "messages": [{"role": "robot", "content": "hi"}]}).encode(), 400,
     "messages.0.role"),
    (json.dumps({"model": "echo", "messages": [{"role": "system", "content": "hi"}]}).encode(), 400, "messages"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
    (json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}], "masgraph": {"x": 1}}).encode(),
     400, "masgraph.x"),
])
def test_malformed_requests_get_openai_style_errors(body, code, param):
    with serving(scripted_agent()) as url:
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == code and err["param"] == param and err["message"] and err["type"], r.text


def test_unknown_paths_and_methods_are_openai_style_errors_too():
    with serving(scripted_agent()) as url:
        r = httpx.get(f"{url}/v1/completions")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"{url}/v1/chat/completions").status_code == 405


def test_body_limit_declared_or_streamed():
    with serving(scripted_agent(), ServeConfig(max_body_bytes=1000)) as url:
        big = json.dumps(ask("x" * 2000)).encode()
        r = httpx.post(f"{url}/v1/chat/completions", content=big, headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = httpx.post(f"{url}/v1/chat/completions", content=iter([big[:600], big[600:]]), headers=JSON)  # chunked
        assert r.status_code == 413
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("small")).status_code == 200


def test_a_full_queue_answers_429_at_once_and_the_admitted_requests_succeed(caplog):
    """2 running + 2 queued: of 8 concurrent clients, 4 get a 429 with Retry-After while the first 4 are held,
    then those 4 all succeed; no 500 anywhere."""
    with serving(scripted_agent(GATED), ServeConfig(max_concurrency=2, max_queue=2), model="gated") as url:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                posts = [asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=ask("gate full", "gated")))
                         for _ in range(8)]
                while sum(p.done() for p in posts) < 4:  # the refused answer at once, while the gate is shut
                    await asyncio.sleep(0.01)
                refused = [p.result() for p in posts if p.done()]
                await until(lambda: httpx.get(f"{url}/health").json()["queued"] == 2)
                health = (await c.get(f"{url}/health")).json()
                open_gate("full")
                return refused, health, await asyncio.gather(*posts)

        refused, health, everyone = asyncio.run(main())
        assert [r.status_code for r in refused] == [429] * 4
        assert (health["running"], health["queued"], health["in_flight"]) == (2, 2, 4)
        assert sorted(r.status_code for r in everyone) == [200] * 4 + [429] * 4
        for r in refused:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
            assert r.json()["error"]["code"] == "queue_full"
        assert httpx.get(f"{url}/health").json()["in_flight"] == 0
    assert not tracebacks(caplog)


@pytest.mark.slow
def test_a_slow_episode_times_out_with_504_and_is_cancelled():
    EVENTS.clear()
    with serving(scripted_agent(SLOW), ServeConfig(timeout_s=0.5), model="slow") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("sleep 5", "slow"), timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert EVENTS == ["cancelled sleep 5"]
        assert httpx.get(f"{url}/health").json()["in_flight"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_episode(stream, tmp_path):
    EVENTS.clear()
    with serving(scripted_agent(SLOW), ServeConfig(store=tmp_path / "traces"), model="slow") as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=ask("sleep 5", "slow", stream=stream), timeout=0.5)
        deadline = time.monotonic() + 3
        while not EVENTS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert EVENTS == ["cancelled sleep 5"]
        assert httpx.get(f"{url}/health").json()["in_flight"] == 0
    finished = [json.loads(x) for x in (tmp_path / "traces" / "events.jsonl").read_text().splitlines()]
    [trace] = [e["trace"] for e in finished if e["kind"] == "episode_finished"]
    assert trace["status"] == "cancelled"  # stored, not lost


def test_a_failed_episode_is_a_500_with_the_trace_id_and_the_server_goes_on():
    @register_agent("explodes-serve")
    async def explodes(ctx):
        raise RuntimeError("kaboom")

    with serving(scripted_agent(SLOW.replace("sleepy", "explodes-serve")), model="slow") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("x", "slow"))
        assert r.status_code == 500 and "kaboom" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "episode_error"
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(**ask("x", "slow"))
        stream = httpx.post(f"{url}/v1/chat/completions", json=ask("x", "slow", stream=True)).text
        assert '"error"' in stream and stream.rstrip().endswith("data: [DONE]")


def test_public_address_without_key_is_refused():
    check_bind("127.0.0.1", None, False)
    check_bind("::1", None, False)
    check_bind("localhost", None, False)
    check_bind("0.0.0.0", "key", False)
    check_bind("0.0.0.0", None, True)
    for host in ("0.0.0.0", "192.168.1.5", "example.com", "::"):
        with pytest.raises(MasgraphError, match="API key"):
            check_bind(host, None, False)


@pytest.mark.slow
def test_cli_refuses_a_public_bind_before_loading_anything(root):
    r = subprocess.run([sys.executable, "-m", "masgraph.cli", "serve", str(root / "graphs" / "single.yaml"),
                        "--host", "0.0.0.0"], capture_output=True, text=True, env={**os.environ,
                                                                                   "MASGRAPH_API_KEY": ""})
    assert r.returncode == 2 and r.stderr.startswith("error: --host 0.0.0.0") and "Traceback" not in r.stderr


SERVE_SCRIPT = textwrap.dedent("""\
    import sys
    from masgraph.serve.agent import Agent
    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec
    from masgraph.serve.server import ServeConfig, serve
    sys.path[:0] = [{here!r}, {root!r}]  # test_server imports tests.unit.serve.serving from the repo root
    import test_server  # registers the `sleepy` agent
    agent = Agent(compile_spec(parse_spec(test_server.SLOW, "slow.yaml")))
    serve(agent, "slow", "127.0.0.1", {port}, ServeConfig(timeout_s=30, store={store!r}), log_level="warning")
""")


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(tmp_path, free_port, wait_healthy):
    port = free_port()
    script = tmp_path / "serve.py"
    store = tmp_path / "traces"
    script.write_text(SERVE_SCRIPT.format(here=str(Path(__file__).parent), root=str(Path(__file__).parents[3]),
                                          port=port, store=str(store)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # 120 s: importing torch and masgraph in a fresh process takes 20-35 s on a loaded 2-core box
        wait_healthy(url, proc, 120, lambda: proc.stderr.read() if proc.poll() is not None else "")

        async def main():
            async with httpx.AsyncClient(timeout=30) as c:
                pending = [asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=ask("sleep 1.5", "slow")))
                           for _ in range(3)]
                await asyncio.sleep(0.5)  # all three are in flight
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                try:
                    late = await c.post(f"{url}/v1/chat/completions", json=ask("sleep 0", "slow"))
                    late = late.status_code
                except httpx.TransportError:
                    late = "refused"
                return [r.status_code for r in await asyncio.gather(*pending)], late

        codes, late = asyncio.run(main())
        assert codes == [200, 200, 200]  # in-flight requests finish
        assert late in ("refused", 503)  # new ones are not taken
        out, err = proc.communicate(timeout=30)
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM, as it should
        assert proc.returncode in (0, -signal.SIGTERM), err
        summary = json.loads((store / "summary.json").read_text())
        assert summary == {"episodes": 3, "store_errors": 0}  # shutdown ran after the drain
    finally:
        if proc.poll() is None:
            proc.kill()


ARMS = """\
name: arms
nodes:
  start: {role: custom, agent: echo-serve}
  left: {role: custom, agent: echo-serve}
  right: {role: custom, agent: echo-serve}
  end: {role: custom, agent: echo-serve, merge: first}
edges: [{source: start, target: left}, {source: start, target: right},
        {source: left, target: end}, {source: right, target: end}]
entry: start
exit: end
topology: {choices: {start: [left, right]}}
"""


@register_agent("echo-serve")
async def _echo_serve(ctx):
    return NodeOutput(text=ctx.node, answer=ctx.merged or ctx.node)


def test_an_agent_samples_an_untrained_topology_and_follows_a_learned_one_greedily(monkeypatch):
    def routes(agent: Agent) -> set[str]:
        async def main():
            return {(await agent.aask("same question")).answer for _ in range(24)}
        return asyncio.run(main())

    graph = compile_spec(parse_spec(ARMS, "arms.yaml"))
    untrained = Agent(graph)
    assert untrained.mode == "sample" and routes(untrained) == {"left", "right"}
    from masgraph.topology import policy as policies

    trained = policies.TopologyPolicy(untrained.topology.space)
    with torch.no_grad():
        trained.logits[0].copy_(torch.tensor([0.0, 0.5]))  # right is more likely, left still likely to be sampled
    trained.version = 3
    monkeypatch.setattr(policies, "load_policy", lambda graph, checkpoint=None: trained)  # as from a checkpoint
    learned = Agent(graph)
    assert learned.mode == "greedy" and routes(learned) == {"right"}
    assert Agent(graph, topology="greedy").mode == "greedy"


# --- the trace store: a bad record or a failed write is counted, visible and never the end of storage ---------


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "a \\ud800 b"}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "\\udfff"}]},
     "messages.0.content.1.text"),
    ({"role": "user", "content": "fine", "name": "\\ud83d"}, "messages.0.name"),  # a field the server ignores
])
def test_a_lone_surrogate_is_a_400_naming_the_field_and_traces_go_on_being_stored(message, param, tmp_path):
    body = json.dumps({"model": "echo", "messages": [message]}).replace("\\\\u", "\\u")  # JSON escapes, as sent
    with serving(scripted_agent(), ServeConfig(store=tmp_path / "t")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", content=body.encode(), headers=JSON)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and err["code"] == "invalid_unicode", r.text
        assert err["message"].startswith(param) and "surrogate" in err["message"]
        pair = '{"model": "echo", "messages": [{"role": "user", "content": "ok \\ud83d\\ude00"}]}'  # a valid pair
        assert httpx.post(f"{url}/v1/chat/completions", content=pair.encode(), headers=JSON).status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("after", masgraph={"trace": True}))
        assert r.status_code == 200 and r.json()["masgraph"]["run_dir"] == str(tmp_path / "t")
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["trace_store"]["errors"] == 0
    assert [t.query for t in read_traces(tmp_path / "t")] == ["ok \U0001f600", "after"]
    assert json.loads((tmp_path / "t" / "summary.json").read_text())["episodes"] == 2


def test_one_record_the_store_cannot_serialise_loses_nothing_after_it(tmp_path, caplog):
    """A lone surrogate reaching the store (here from Python, past the server's check) used to stay in the
    pending events: every later flush failed and every later trace was lost."""
    graph = compile_spec(parse_spec(SLOW.replace("sleepy", "parrot-serve"), "parrot.yaml"))
    store = RunStore(tmp_path, graph.spec, {})

    async def main():
        for question in ("before", "bad \ud800 text", "after"):
            await Agent(graph).aask(question, sinks=[store])
            await asyncio.sleep(store.flush_s * 2)  # the flush timer fires too, not only the episode's end

    asyncio.run(main())
    store.close({"episodes": 3})
    traces = list(read_traces(tmp_path))
    assert [t.query for t in traces] == ["before", "bad \ufffd text", "after"]  # the bad one kept, repaired
    assert traces[1].answer == "bad \ufffd text" and [s.node for s in traces[2].steps] == ["answer"]
    assert [e["query"] for e in read_jsonl(tmp_path / INDEX)] == ["before", "bad \ufffd text", "after"]
    assert store.errors >= 1 and "surrogate" in store.last_error and (tmp_path / "summary.json").exists()
    assert any(r.name == "masgraph.store" and r.levelno == logging.ERROR for r in caplog.records)


def _agent_recording_close():
    """A scripted agent whose `aclose` calls are recorded in the returned list (then run as usual)."""
    agent, closed = scripted_agent(), []
    real_aclose = agent.aclose

    async def aclose():
        closed.append(True)
        await real_aclose()

    agent.aclose = aclose
    return agent, closed


def test_a_failing_trace_store_is_visible_and_the_server_closes_the_agent_anyway(tmp_path, caplog, monkeypatch):
    real_append = store_module._append
    monkeypatch.setattr(store_module, "_append", lambda file: _Disk(real_append(file)))
    monkeypatch.setattr(_Disk, "full", False)
    agent, closed = _agent_recording_close()
    with serving(agent, ServeConfig(store=tmp_path / "t")) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("stored")).status_code == 200
        _Disk.full = True
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("lost")).status_code == 200  # still answered
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "degraded" and health["trace_store"]["errors"] >= 1
        assert "No space left on device" in health["trace_store"]["last_error"]
        assert "masgraph_trace_store_errors " in httpx.get(f"{url}/metrics").text
        assert not re.search(r"^masgraph_trace_store_errors 0\.0$", httpx.get(f"{url}/metrics").text, re.M)
        assert any(r.name == "masgraph.store" and r.levelno == logging.ERROR and "No space left" in r.getMessage()
                   for r in caplog.records)  # an error line in the server's log
        _Disk.full = False
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("stored again")).status_code == 200
        _Disk.full = True  # still full when the server shuts down
    assert closed == [True]  # shutdown closed the agent
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["episodes"] == 3 and summary["store_errors"] >= 1
    assert [t.query for t in read_traces(tmp_path / "t")] == ["stored", "stored again"]


def test_shutdown_closes_the_agent_even_when_the_store_cannot_close(tmp_path, caplog, monkeypatch):
    def no_space(path, text, durable=True):
        raise OSError(errno.ENOSPC, "No space left on device")

    agent, closed = _agent_recording_close()
    with serving(agent, ServeConfig(store=tmp_path / "t")) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("hi")).status_code == 200
        monkeypatch.setattr(store_module, "atomic_write", no_space)  # summary.json cannot be written
    assert closed == [True]
    assert any("closing the trace store" in r.getMessage() and "No space left" in r.getMessage()
               for r in caplog.records)


# --- connections and hostile input: 400/408/415/503 with OpenAI-style bodies, never a 500 or a held socket ----


@pytest.mark.parametrize("body", [
    b"[" * 100_000,
    b'{"a": ' * 100_000,
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "n": ' + b"9" * 5000 + b"}",
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "x": [' + b"1" * 5000 + b"]}",
])
def test_hostile_json_is_a_400_not_a_500(body, caplog):
    with serving(scripted_agent()) as url:
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("hi")).status_code == 200
    assert not tracebacks(caplog)


def test_silent_slow_and_dribbling_connections_are_closed(caplog):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n")
    with serving(scripted_agent(), ServeConfig(header_timeout_s=0.3, body_timeout_s=0.3)) as url:
        silent = [raw(url) for _ in range(30)]
        slow_heads = [raw(url) for _ in range(10)]
        slow_bodies = [raw(url) for _ in range(20)]
        for sock in slow_heads:
            sock.sendall(head)  # the blank line that ends a head never comes
        for sock in slow_bodies:
            sock.sendall(head + b"\r\n" + b'{"model": ')  # 100 bytes promised, 10 sent
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("meanwhile")).status_code == 200
        dribbler = raw(url)
        dribbler.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
        with contextlib.suppress(OSError):  # a byte every 20 ms never ends the head: closed, so a send fails
            for _ in range(3000):
                dribbler.sendall(b"a")
                time.sleep(0.02)
            pytest.fail("a connection dribbling its head for 60 s was kept")
        for sock in silent:
            assert until_closed(sock) == b""  # no bytes: nothing to answer
        for sock in slow_heads:
            reply = until_closed(sock)
            assert reply.startswith(b"HTTP/1.1 408 ") and json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] \
                == "header_timeout"
        for sock in slow_bodies:
            reply = until_closed(sock)
            assert reply.startswith(b"HTTP/1.1 408 ") and b'"code":"body_timeout"' in reply
    assert not tracebacks(caplog)


def test_connections_beyond_the_cap_get_an_openai_style_503():
    with serving(scripted_agent(), ServeConfig(max_connections=3, keep_alive_s=60, header_timeout_s=60)) as url:
        held = [raw(url) for _ in range(3)]
        for sock in held:  # answered and kept alive: the server counts it
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("hi"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
        held.pop().close()
        asyncio.run(until(lambda: httpx.post(f"{url}/v1/chat/completions", json=ask("hi")).status_code == 200))


def test_a_head_too_large_or_malformed_is_an_openai_style_400():
    with serving(scripted_agent(), ServeConfig(max_header_bytes=1024)) as url:
        # h11 bounds the head it holds unfinished: 2000 bytes and no end yet is over 1024
        for head in (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 2000,
                     b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n"):
            sock = raw(url)
            sock.sendall(head)
            reply = until_closed(sock)
            assert reply.startswith(b"HTTP/1.1 400 ") and b"application/json" in reply
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"


@pytest.mark.slow
def test_a_keyless_server_takes_only_json_posts_sent_to_a_loopback_name():
    """A cross-site page can POST text/plain or a form without a preflight, and a DNS-rebinding page reaches the
    server under its own name; neither gets an episode run or the metrics read."""
    with serving(scripted_agent()) as url:
        port = url.rsplit(":", 1)[1]
        body = json.dumps(ask("hi"))
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": ctype} if ctype else {})
            assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type", r.text
        r = httpx.post(f"{url}/v1/chat/completions", content=body,
                       headers={"Content-Type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "192.168.1.5", ""):
            for r in (httpx.get(f"{url}/health", headers={"Host": host}),
                      httpx.get(f"{url}/metrics", headers={"Host": host}),
                      httpx.post(f"{url}/v1/chat/completions", json=ask("hi"), headers={"Host": host})):
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
        for host in (f"localhost:{port}", "localhost", f"127.0.0.1:{port}", f"[::1]:{port}", "127.0.0.2", "LOCALHOST."):
            assert httpx.get(f"{url}/health", headers={"Host": host}).status_code == 200, host
    with serving(scripted_agent(), ServeConfig(api_key="k")) as url:  # a keyed server may sit behind any name
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("hi"),
                       headers={"Host": "api.example.com", "Authorization": "Bearer k"})
        assert r.status_code == 200


def test_a_keyless_public_bind_that_was_asked_for_takes_any_host(monkeypatch):
    import uvicorn

    apps = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, **options: apps.setdefault(host, app))
    for host in ("0.0.0.0", "127.0.0.1"):
        serve(scripted_agent(), "echo", host, 8000)

    async def health(app) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://10.0.0.7:8000") as c:
            return (await c.get("/health")).status_code

    assert asyncio.run(health(apps["0.0.0.0"])) == 200 and asyncio.run(health(apps["127.0.0.1"])) == 400


# --- admission: the time limit runs from the episode's start, a queue wait is bounded, errors are OpenAI's ----


@pytest.mark.slow
def test_the_time_limit_starts_when_the_episode_starts_not_when_the_request_arrived():
    """One slot, limit T: two requests of 0.6 T each; the second waits 0.6 T for the slot, so 1.2 T after it
    arrived, but only 0.6 T after its episode started, it is answered, not timed out. T is scaled from a
    measured request so that 0.4 T of slack covers a slow machine."""
    with serving(scripted_agent(SLOW), ServeConfig(max_concurrency=1), model="slow") as url:
        t0 = time.perf_counter()
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("sleep 0", "slow")).status_code == 200
        limit = max(3.0, 30 * (time.perf_counter() - t0))
    with serving(scripted_agent(SLOW), ServeConfig(max_concurrency=1, timeout_s=limit), model="slow") as url:
        async def main():
            async with httpx.AsyncClient(timeout=10 * limit) as c:
                return await asyncio.gather(*(c.post(f"{url}/v1/chat/completions",
                                                     json=ask(f"sleep {0.6 * limit}", "slow")) for _ in range(2)))
        assert [r.status_code for r in asyncio.run(main())] == [200, 200]


@pytest.mark.slow
def test_a_request_waits_in_the_queue_at_most_max_wait_then_gets_a_503():
    with serving(scripted_agent(GATED), ServeConfig(max_concurrency=1, max_wait_s=0.2), model="gated") as url:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                first = asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=ask("gate wait", "gated")))
                await until(lambda: httpx.get(f"{url}/health").json()["running"] == 1)
                second = await c.post(f"{url}/v1/chat/completions", json=ask("gate wait", "gated"))
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.InternalServerError) as parsed:  # the official client reads it too
                    await asyncio.to_thread(client.chat.completions.create, **ask("gate wait", "gated"))
                open_gate("wait")
                return await first, second, parsed.value

        first, second, parsed = asyncio.run(main())
        assert first.status_code == 200
        assert second.status_code == 503 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "queue_timeout"
        assert parsed.status_code == 503 and parsed.code == "queue_timeout"


def test_a_node_that_times_out_is_a_504_with_the_trace_id():
    graph = SLOW.replace("agent: sleepy", "agent: sleepy, timeout_s: 0.1")
    with serving(scripted_agent(graph), model="slow") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("sleep 30", "slow"))
        err = r.json()["error"]
        assert r.status_code == 504 and err["code"] == "episode_timeout" and err["type"] == "timeout_error"
        assert "node timed out" in err["message"] and "trace " in err["message"]


@register_agent("cancelled-serve")
async def _cancelled(ctx):
    raise asyncio.CancelledError  # as an episode cancelled by something inside the server (not its request)


@pytest.mark.parametrize("stream", [False, True])
def test_an_episode_cancelled_inside_the_server_is_a_503_not_a_bare_500(stream, caplog):
    with serving(scripted_agent(SLOW.replace("sleepy", "cancelled-serve")), model="slow") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("x", "slow", stream=stream))
        if stream:
            assert r.status_code == 200 and '"episode_cancelled"' in r.text and r.text.rstrip().endswith("[DONE]")
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "episode_cancelled"
            assert r.headers["retry-after"] == "1"
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("x", "slow")).status_code == 503  # serving on
        assert httpx.get(f"{url}/health").json()["in_flight"] == 0
    assert not tracebacks(caplog)


def test_a_queued_client_that_goes_away_gives_its_place_back(caplog):
    with serving(scripted_agent(GATED), ServeConfig(max_concurrency=1, max_queue=1), model="gated") as url:
        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                first = asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=ask("gate gone", "gated")))
                await until(lambda: httpx.get(f"{url}/health").json()["running"] == 1)
                with pytest.raises(httpx.ReadTimeout):
                    await c.post(f"{url}/v1/chat/completions", json=ask("gate gone", "gated"), timeout=0.3)
                await until(lambda: httpx.get(f"{url}/health").json()["queued"] == 0)
                refill = asyncio.ensure_future(c.post(f"{url}/v1/chat/completions", json=ask("gate gone", "gated")))
                await until(lambda: httpx.get(f"{url}/health").json()["queued"] == 1)  # the place is free again
                open_gate("gone")
                return await first, await refill

        assert [r.status_code for r in asyncio.run(main())] == [200, 200]
    assert not tracebacks(caplog)


def test_whatever_escapes_the_app_is_an_openai_style_error(caplog):
    """The last resort: a bug is a 500 with an error body (its traceback logged); a request cancelled from
    outside (uvicorn's shutdown timeout) is a 503 with one log line, no traceback."""
    from masgraph.serve.server import _Edge, _Gate, _Metrics

    async def run(exc: BaseException) -> tuple[int, dict]:
        async def app(scope, receive, send):
            raise exc

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await _Edge(app, _Metrics(_Gate(1, 1, 1.0), None), check_host=True)(scope, None, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    status, body = asyncio.run(run(asyncio.CancelledError()))
    assert status == 503 and body["error"]["code"] == "cancelled" and not tracebacks(caplog)
    status, body = asyncio.run(run(KeyError("bug")))
    assert status == 500 and body["error"]["code"] == "internal_error" and len(tracebacks(caplog)) == 1


def test_the_serve_flags_set_admission_and_default_to_serve_config():
    from masgraph.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "g.yaml"])
    defaults = ServeConfig()
    assert (args.max_concurrency, args.max_queue, args.max_wait, args.max_connections) == (
        defaults.max_concurrency, defaults.max_queue, defaults.max_wait_s, defaults.max_connections)
    args = parser.parse_args(["serve", "g.yaml", "--max-concurrency", "2", "--max-queue", "2", "--max-wait", "5",
                              "--max-connections", "50"])
    assert (args.max_concurrency, args.max_queue, args.max_wait, args.max_connections) == (2, 2, 5.0, 50)
    serve_help = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    text = serve_help.format_help()
    assert "429" in text and "Retry-After" in text and "--max-wait" in text and "--max-connections" in text


# ---- streaming (issue 30, finding 4: the answer streamed as one chunk at the episode's end) -------------------

STREAMED = """\
name: drip
policies:
  main: {backend: scripted, model: none}
nodes:
  think: {role: generator, policy: main}
  answer: {role: generator, policy: main}
edges: [{source: think, target: answer}]
entry: think
exit: answer
"""


class Dripping:
    """A backend that writes each reply a word at a time, `step_s` apart, feeding the answer node's stream as a
    streaming backend does (`sink_for`, asked before its first await); records when each node's call ended and
    whether a call was cancelled. `fail_at`: the word at which the answer node's call raises."""

    returns_tokens = True

    def __init__(self, replies: dict[str, str], step_s: float = 0.05, fail_at: int | None = None):
        self.replies, self.step_s, self.fail_at = replies, step_s, fail_at
        self.ended: dict[str, float] = {}
        self.events: list[str] = []

    async def complete(self, requests):
        from masgraph.backends.base import BackendError, Completion
        from masgraph.streaming import sink_for

        [req] = requests
        node, sink = req.key[1], sink_for(req)
        text = ""
        try:
            for i, word in enumerate(re.findall(r"\s*\S+", self.replies[node])):
                await asyncio.sleep(self.step_s)
                if node == "answer" and i == self.fail_at:
                    raise BackendError("the model fell over mid-answer")
                text += word
                if sink is not None:
                    sink.update(text)
        except asyncio.CancelledError:
            self.events.append(f"cancelled {node}")
            raise
        self.ended[node] = time.monotonic()
        ids = list(text.encode())
        return [Completion(text=text, prompt_ids=[1], completion_ids=ids, logprobs=[0.0] * len(ids))]

    async def aclose(self) -> None:
        return None


def dripping_agent(backend: Dripping) -> Agent:
    graph = compile_spec(parse_spec(STREAMED, "drip.yaml"))
    return Agent(graph, engine=Engine(graph, backends={"scripted": backend}))


def timed_chunks(url: str, model: str = "drip") -> list[tuple[float, object]]:
    """(arrival time, chunk) of a streamed answer, read with the official client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "q"}], stream=True,
                                            stream_options={"include_usage": True})
    return [(time.monotonic(), c) for c in stream]


def content_of(chunks) -> list[str]:
    return [c.choices[0].delta.content for _, c in chunks if c.choices and c.choices[0].delta.content]


@pytest.mark.slow
def test_the_answer_streams_as_the_generator_decodes_and_equals_the_whole_answer():
    """The first content chunk arrives while the exit node's LLM call is still writing (before the episode's
    last node finishes); only the answer node's text streams (the first node also writes an `Answer:` line);
    the streamed text is the parsed answer, equal to the non-streamed one, with no text twice."""
    words = " ".join(f"w{i}" for i in range(20))
    backend = Dripping({"think": "Answer: thinking aloud", "answer": f"Sure.\nAnswer: {words}\nMore text"})
    with serving(dripping_agent(backend), model="drip") as url:
        chunks = timed_chunks(url)
        answer_done = backend.ended["answer"]
        whole = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
            model="drip", messages=[{"role": "user", "content": "q"}]).choices[0].message.content
    content = content_of(chunks)
    first = next(t for t, c in chunks if c.choices and c.choices[0].delta.content)
    assert first < answer_done  # streamed while the answer node was still decoding
    assert len(content) >= 10  # word by word, not one chunk
    assert "".join(content) == whole == words
    assert not any("thinking" in c for c in content)  # the first node's text never streams
    assert chunks[0][1].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for _, c in chunks if c.choices][-1] == "stop"
    assert chunks[-1][1].usage.total_tokens > 0


def test_an_answer_that_cannot_stream_arrives_whole_at_the_end():
    """No `Answer:` line (the parser falls back to the last line): nothing streams early, the answer comes in one
    chunk, equal to the non-streamed one."""
    backend = Dripping({"think": "x", "answer": "I think it is\n42"}, step_s=0.01)
    with serving(dripping_agent(backend), model="drip") as url:
        content = content_of(timed_chunks(url))
    assert content == ["42"]


def test_an_error_mid_stream_ends_it_with_an_openai_error_event(caplog):
    backend = Dripping({"think": "x", "answer": "Answer: one two three four five six"}, step_s=0.02, fail_at=4)
    with serving(dripping_agent(backend), model="drip") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        got = []
        with pytest.raises(openai.APIError, match="fell over") as failed:
            for c in client.chat.completions.create(model="drip", messages=[{"role": "user", "content": "q"}],
                                                    stream=True):
                got.append(c.choices[0].delta.content or "")
        raw = httpx.post(f"{url}/v1/chat/completions", json=ask("q", "drip", stream=True)).text
    assert "".join(got) == "one two three"  # what had streamed, then the error
    assert failed.value.body["code"] == "episode_error" and "trace" in failed.value.body["message"]
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    assert tracebacks(caplog) == []


def test_a_client_that_goes_away_mid_stream_cancels_the_episode():
    backend = Dripping({"think": "x", "answer": "Answer: " + " ".join(["word"] * 400)}, step_s=0.02)
    with serving(dripping_agent(backend), model="drip") as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=ask("q", "drip", stream=True)) as r:
            for line in r.iter_lines():
                if '"content": "word' in line:
                    break  # the first words arrived; the client hangs up
        deadline = time.monotonic() + 10
        while not backend.events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backend.events == ["cancelled answer"] and "answer" not in backend.ended
        assert httpx.get(f"{url}/health").json()["in_flight"] == 0
