"""The web_search tool against a real local HTTP server that speaks the Tavily API shape (never a remote one):
the request it sends, the results it returns, every way a request can fail, and a graph episode that uses it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from masgraph.agents.tools.registry import ToolError, build_tools
from masgraph.agents.tools.search import Corpus, default_corpus_path, read_documents
from masgraph.errors import MasgraphError
from masgraph.graph import compile_spec
from masgraph.spec import GraphSpec, ToolSpec

KEY = "tvly-test-key-123"


class _Tavily(BaseHTTPRequestHandler):
    """POST /search with a bearer key -> {"results": [{title, url, content, score}]}, from the shipped KB."""

    corpus = Corpus(read_documents(default_corpus_path()))
    seen: list[dict] = []
    mode = "ok"

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if self.mode == "slow":
            time.sleep(1.0)
        if self.mode == "garbage":
            return self._send(200, b"<html>not json</html>", "text/html")
        if self.path != "/search":
            return self._send(404, json.dumps({"detail": {"error": "not found"}}).encode())
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, json.dumps({"detail": {"error": "Unauthorized: missing or invalid API key."}})
                              .encode())
        hits = self.corpus.search(body["query"], body.get("max_results", 5))
        results = [{"title": h["title"], "url": f"https://kb.test/{h['id']}", "content": h["text"], "score": 1.0}
                   for h in hits]
        self._send(200, json.dumps({"query": body["query"], "results": results}).encode())

    def _send(self, status: int, data: bytes, kind: str = "application/json"):
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up (the timeout case)
            pass

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server():
    _Tavily.seen, _Tavily.mode = [], "ok"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Tavily)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _tool(base: str, timeout_s: float = 10.0, **options):
    spec = ToolSpec(kind="web_search", timeout_s=timeout_s, options={"api_base": base, **options})
    return build_tools({"web": spec})["web"]


def test_it_sends_the_providers_request_and_returns_its_results(server, run, monkeypatch):
    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    person = read_documents(default_corpus_path())[0]
    out = run(_tool(server, top_k=2, snippet_chars=30)(person["title"]))
    [req] = _Tavily.seen
    assert req == {"path": "/search", "auth": f"Bearer {KEY}",
                   "body": {"query": person["title"], "max_results": 2, "search_depth": "basic"}}
    first = out.splitlines()[0]
    assert first.startswith(f"[{person['title']}] {person['text'][:30].rstrip()}…"), out
    assert first.endswith(f"(https://kb.test/{person['id']})")
    assert len(out.splitlines()) == 2


def test_the_key_comes_from_the_named_variable_and_never_shows_in_an_error(server, run, monkeypatch):
    monkeypatch.delenv("TAVILY_API_KEY", raising=False)
    with pytest.raises(ToolError, match="set the environment variable TAVILY_API_KEY"):
        run(_tool(server)("anything"))
    assert _Tavily.seen == []  # nothing sent without a key
    monkeypatch.setenv("MY_SEARCH_KEY", "wrong-key")
    with pytest.raises(ToolError, match=r"HTTP 401: Unauthorized: missing or invalid API key") as err:
        run(_tool(server, api_key_env="MY_SEARCH_KEY")("anything"))
    assert "wrong-key" not in str(err.value)
    assert _Tavily.seen[-1]["auth"] == "Bearer wrong-key"


@pytest.mark.parametrize("mode,base,why", [
    ("garbage", None, "answered something that is not JSON"),
    ("ok", "/nowhere", "answered HTTP 404: not found"),
    ("ok", "closed", "request to .* failed: ConnectError"),
    ("slow", None, "web timed out after 0.3s"),
])
def test_a_failed_request_is_a_tool_error_that_says_why(server, run, monkeypatch, mode, base, why):
    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    _Tavily.mode = mode
    url = {None: server, "/nowhere": server + "/nowhere", "closed": "http://127.0.0.1:9"}[base]
    # only the slow case times out: the others get a timeout a loaded machine's local server always answers within
    # (0.3 s for all of them failed the garbage case with a timeout while the machine was swapping)
    with pytest.raises(ToolError, match=why):
        run(_tool(url, timeout_s=0.3 if mode == "slow" else 30.0)("Kalo Mira"))


def test_options_are_checked_when_the_graph_is_compiled():
    bad = {"name": "g", "tools": {"web": {"kind": "web_search", "options": {"api_base": "ftp://x", "top_k": 0}}},
           "policies": {"p": {}}, "nodes": {"a": {"role": "executor", "tools": ["web"]}}, "entry": "a", "exit": "a"}
    with pytest.raises(MasgraphError) as err:
        compile_spec(GraphSpec.model_validate(bad), "g.yaml")
    assert "api_base 'ftp://x' is not an http:// or https:// URL" in str(err.value)
    assert "top_k" in str(err.value)


def test_an_episode_searches_the_web_and_answers_from_it(server, run, monkeypatch, scripted, runner_for):
    """planner -> executor (web_search) -> generator: the tool's result is in the trace and reaches the answer."""
    from masgraph.tasks import Item, get_task

    monkeypatch.setenv("TAVILY_API_KEY", KEY)
    person = read_documents(default_corpus_path())[0]
    spec = GraphSpec.model_validate({
        "name": "web", "tools": {"web": {"kind": "web_search", "options": {"api_base": server, "top_k": 1}}},
        "policies": {"p": {"backend": "scripted"}},
        "nodes": {"planner": {"role": "planner", "policy": "p", "tools": ["web"]},
                  "executor": {"role": "executor", "tools": ["web"]},
                  "generator": {"role": "generator", "policy": "p"}},
        "edges": [{"source": "planner", "target": "executor"}, {"source": "executor", "target": "generator"}],
        "entry": "planner", "exit": "generator"})
    backend = scripted({"planner": f"Sub-goal: find {person['title']}\nTool: web", "generator": "Answer: found"})
    task = get_task("basic_arithmetic")
    item = Item("q", f"Who is {person['title']}?", "x")
    result = run(runner_for(compile_spec(spec), backend).run_items(task, [item]))
    [trace] = result.traces
    assert trace.status == "ok", trace.error
    tool = trace.steps[1].tool
    assert tool.tool == "web" and tool.error is None and tool.output.startswith(f"[{person['title']}]")
    assert _Tavily.seen[0]["body"]["query"] == f"find {person['title']}"
