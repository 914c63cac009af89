"""The server against hostile or careless clients, over real sockets: raw bytes no JSON encoder would send (surrogate
bytes, oversized heads, NaN), values a lax parser would coerce, clients that hang up while queued, a backend that
fails with a Python error; and what the server keeps or shows about itself (the API key, the run dir's path)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections import Counter

import httpx
import openai
import pytest

from masgraph.agents.registry import register_agent
from masgraph.backends.scripted import ScriptedBackend
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.node import NodeOutput
from masgraph.rundir import store as store_module
from masgraph.rundir.store import RunStore, read_traces
from masgraph.runtime.engine import Engine
from masgraph.serve.agent import Agent
from masgraph.serve.server import ServeConfig
from tests.unit.serve.serving import GRAPH, ask, post_raw, raw, scripted_agent, serving, until, until_closed
from tests.unit.serve.serving import Disk as _Disk

GATED = "name: gated\nnodes:\n  answer: {role: custom, agent: gated-hostile}\nentry: answer\nexit: answer\n"

GATES: dict[str, threading.Event] = {}
"""Gates the `gated-hostile` agent waits on, by name (the last word of its question); a test opens them."""


@register_agent("gated-hostile")
async def _gated(ctx):
    gate = GATES.setdefault(ctx.query.split()[-1], threading.Event())
    while not gate.is_set():
        await asyncio.sleep(0.01)
    return NodeOutput(text="opened", answer="opened")


def open_gate(name: str) -> None:
    GATES.setdefault(name, threading.Event()).set()


# --- bodies: raw surrogate bytes, numbers JSON should not carry, a `stream` that is not a boolean -------------


@pytest.mark.parametrize("stream", [b"false", b"true"])
def test_raw_surrogate_bytes_are_a_400_naming_the_field_and_health_stays_ok(stream, tmp_path):
    body = (b'{"model":"echo","stream":' + stream
            + b',"messages":[{"role":"user","content":"a \xed\xa0\x80 b"}]}')  # U+D800 as (invalid) UTF-8
    with serving(scripted_agent(), ServeConfig(store=tmp_path / "t")) as url:
        status, reply = post_raw(url, body)
        err = json.loads(reply)["error"]
        assert status == 400 and err["param"] == "messages.0.content" and err["code"] == "invalid_unicode", reply
        assert err["type"] == "invalid_request_error" and "surrogate" in err["message"]
        status, _ = post_raw(url, b'{"model":"echo","messages":[{"role":"user","content":"ok \xf0\x9f\x98\x80"}]}')
        assert status == 200  # real UTF-8 (a 4-byte character) is fine
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["trace_store"]["errors"] == 0
    assert [t.query for t in read_traces(tmp_path / "t")] == ["ok \U0001f600"]


def test_health_is_degraded_while_the_store_fails_not_for_ever_after(tmp_path, monkeypatch):
    """One failed write (a full disk, a record the store had to repair) is not a store that is failing now."""
    real_append = store_module._append
    monkeypatch.setattr(store_module, "_append", lambda file: _Disk(real_append(file)))
    monkeypatch.setattr(_Disk, "full", False)
    with serving(scripted_agent(), ServeConfig(store=tmp_path / "t")) as url:
        _Disk.full = True
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("lost")).status_code == 200
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "degraded" and health["trace_store"]["errors"] >= 1
        _Disk.full = False
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("stored")).status_code == 200
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["trace_store"]["errors"] >= 1  # the count stays, for /metrics
    assert [t.query for t in read_traces(tmp_path / "t")] == ["stored"]


@pytest.mark.parametrize("literal, why", [
    (b"NaN", "NaN is not a JSON number"),
    (b"-Infinity", "-Infinity is not a JSON number"),
    (b"1e999999", "1e999999 is out of the range of a double"),
    (b"0." + b"1" * 5000, "a number of 5002 characters"),
    (b"9" * 5000, "a number of 5000 characters"),
])
def test_numbers_that_are_not_finite_or_absurdly_long_are_a_400_naming_the_field(literal, why):
    with serving(scripted_agent()) as url:
        for body, param in [
            (b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"temperature":' + literal + b"}",
             "temperature"),
            (b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":[1,' + literal + b"]}}",
             "logit_bias.5.1"),
        ]:
            status, reply = post_raw(url, body)
            err = json.loads(reply)["error"]
            assert status == 400 and err["param"] == param and why in err["message"], reply
            assert err["message"].startswith(param) and err["type"] == "invalid_request_error"
        assert post_raw(url, b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"temperature":0.7,'
                             b'"seed":18446744073709551615}')[0] == 200


@pytest.mark.parametrize("field, value, param", [
    ("stream", "yes", "stream"),
    ("stream", 1, "stream"),
    ("stream", "false", "stream"),
    ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage"),
    ("masgraph", {"trace": 1}, "masgraph.trace"),
])
def test_a_flag_that_is_not_a_json_boolean_is_a_400_naming_it(field, value, param):
    with serving(scripted_agent()) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=ask("hi", **{field: value}))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "boolean" in err["message"], r.text


def test_a_backend_that_fails_with_a_python_error_is_a_500_that_says_what_failed(caplog):
    def broken(request):
        first, second = "one-word".split()  # a bug: not enough values to unpack

    graph = compile_spec(parse_spec(GRAPH, "serve.yaml"))
    agent = Agent(graph, engine=Engine(graph, backends={"scripted": ScriptedBackend(default=broken)}))
    with serving(agent) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
        body = failed.value.body
        events = [line[6:] for line in httpx.post(f"{url}/v1/chat/completions", json=ask("hi", stream=True))
                  .text.splitlines() if line.startswith("data: ")]
    for message in (body["message"], json.loads(events[-2])["error"]["message"]):
        assert "not enough values" not in message and "trace " in message
        assert "node 'answer'" in message and "ValueError" in message and "scripted backend" in message
        assert "policy 'main'" in message and "not a problem with the request" in message
    assert body["code"] == "episode_error" and events[-1] == "[DONE]"
    assert any("not enough values to unpack" in r.getMessage() for r in caplog.records)  # the log keeps it


# --- the request head: 16 KiB, whether it arrives in one read or not ------------------------------------------


def head_of(size: int, path: bytes = b"/health") -> bytes:
    """A GET head of exactly `size` bytes, request line to blank line."""
    start = b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


def test_a_request_head_over_16_kib_is_an_openai_style_400_at_any_size():
    with serving(scripted_agent()) as url:
        sock = raw(url)
        sock.sendall(head_of(16 * 1024))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.close()
        for size in (16 * 1024 + 1, 17_000, 65_000, 100_000, 1_000_000):
            sock = raw(url)
            sock.sendall(head_of(size))
            reply = until_closed(sock)
            assert reply.startswith(b"HTTP/1.1 400 "), (size, reply[:80])
            err = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
            assert err["code"] == "invalid_http" and "16384-byte" in err["message"]
        sock = raw(url)  # a pipelined second head, buffered behind the first request's response
        sock.sendall(head_of(200) + head_of(20_000))
        replies = until_closed(sock)
        assert replies.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 400 " in replies
        assert httpx.get(f"{url}/health").status_code == 200


# --- disconnects: queued or running, every one stored `cancelled` ----------------------------------------------


def test_every_client_that_hangs_up_queued_or_running_is_stored_cancelled(tmp_path):
    """40 concurrent streams on 2 episode slots: every third hangs up after its first SSE chunk (most while queued,
    the first one while running), and one more hangs up before reading anything; each has a record."""
    with serving(scripted_agent(GATED), ServeConfig(max_concurrency=2, max_queue=100, store=tmp_path / "t"),
                 model="gated") as url:
        def in_flight() -> int:
            return httpx.get(f"{url}/health").json()["in_flight"]

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                async def one(i: int, cut: bool) -> str | int:
                    body = ask(f"q{i} gate cut", "gated", stream=True)
                    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if cut and line.startswith("data: "):
                                return "cut"
                        return r.status_code

                async def rude() -> str:  # sends a request and hangs up before reading any of the response
                    host, port = url.removeprefix("http://").split(":")
                    _, writer = await asyncio.open_connection(host, int(port))
                    body = json.dumps(ask("rude gate cut", "gated", stream=True)).encode()
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
                    await until(lambda: in_flight() == 27)  # admitted (queued)
                    writer.close()
                    await until(lambda: in_flight() == 26)
                    return "cut"

                tasks = [asyncio.ensure_future(one(i, i % 3 == 0)) for i in range(40)]
                cut = await asyncio.gather(*tasks[::3])
                await until(lambda: in_flight() == 26)
                cut.append(await rude())
                open_gate("cut")
                return [*cut, *await asyncio.gather(*(t for i, t in enumerate(tasks) if i % 3))]

        results = asyncio.run(main())
        asyncio.run(until(lambda: in_flight() == 0))
    assert Counter(results) == {"cut": 15, 200: 26}
    traces = list(read_traces(tmp_path / "t"))
    assert Counter(t.status for t in traces) == {"ok": 26, "cancelled": 15}
    cut = {t.query for t in traces if t.status == "cancelled"}
    assert cut == {f"q{i} gate cut" for i in range(0, 40, 3)} | {"rude gate cut"}
    queued = [t for t in traces if t.status == "cancelled" and "queued" in t.error]
    assert len(queued) >= 13 and all(not t.steps and t.meta["request_id"] for t in queued)


# --- what the server keeps and shows: no key on disk, no path to strangers -------------------------------------


def test_the_api_key_is_never_written_to_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["masgraph", "serve", "g.yaml", "--api-key", "sk-flag-secret", "--port", "1",
                                      "--api-key=sk-inline-secret", "--api", "sk-abbrev-secret"])
    RunStore(tmp_path / "r", None, {}).close({})
    argv = json.loads((tmp_path / "r" / "config.json").read_text())["argv"]
    assert argv == ["masgraph", "serve", "g.yaml", "--api-key", "***", "--port", "1", "--api-key=***", "--api", "***"]
    monkeypatch.setenv("MASGRAPH_API_KEY", "sk-env-secret")
    with serving(scripted_agent(), ServeConfig(api_key="sk-env-secret", store=tmp_path / "t")) as url:
        key = {"Authorization": "Bearer sk-env-secret"}
        assert httpx.post(f"{url}/v1/chat/completions", json=ask("hi"), headers=key).status_code == 200
        assert httpx.get(f"{url}/metrics", headers=key).status_code == 200
    for file in (tmp_path / "t").iterdir():
        assert b"sk-env-secret" not in file.read_bytes(), file


def test_health_names_the_run_dir_only_to_a_request_with_the_key(tmp_path):
    with serving(scripted_agent(), ServeConfig(store=tmp_path / "keyless")) as url:
        health = httpx.get(f"{url}/health").json()
        assert str(tmp_path) not in json.dumps(health) and "path" not in health["trace_store"]
    with serving(scripted_agent(), ServeConfig(api_key="k", store=tmp_path / "keyed")) as url:
        assert str(tmp_path) not in httpx.get(f"{url}/health").text
        assert str(tmp_path) not in httpx.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}).text
        health = httpx.get(f"{url}/health", headers={"Authorization": "Bearer k"}).json()
        assert health["trace_store"]["path"] == str(tmp_path / "keyed")
