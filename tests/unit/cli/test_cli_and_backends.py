"""CLI user errors (located, no traceback), user task files, the memory node, the litellm backend on a local
OpenAI-compatible server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from masgraph.backends.base import Request
from masgraph.cli import main
from masgraph.events import ListSink, LLMCallFinished
from masgraph.graph import GraphBuilder
from masgraph.tasks import get_task, load_task_file


def test_validate_reports_located_errors_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnodes:\n  a: {role: generator, polcy: p}\nentry: a\nexit: a\n")
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:3:24: nodes.a.polcy: unknown key 'polcy'" in err and "did you mean 'policy'" in err
    assert "Traceback" not in err


def test_run_with_unknown_task_is_a_clean_error(root, capsys):
    assert main(["run", str(root / "graphs" / "single.yaml"), "--task", "nope"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err


def test_schema_command_prints_json_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "GraphSpec"
    # the train section is the registered algorithms' union, documented knob by knob; backends are the registered
    train = schema["properties"]["train"]["anyOf"][0]
    section = schema["$defs"][train["$ref"].rsplit("/", 1)[1]]
    assert section["properties"]["algorithm"]["const"] == "flow_grpo"
    algorithms = [schema["$defs"][m["$ref"].rsplit("/", 1)[1]]["properties"]["algorithm"]["const"]
                  for m in schema["properties"]["train"]["anyOf"] if "$ref" in m]
    assert algorithms == ["flow_grpo", "hrpo", "reinforce", "joint"]
    assert "omega" in schema["$defs"]["HRPOConfig"]["properties"] and "TopologySpec" in schema["$defs"]
    assert "group_size" in schema["$defs"]["FlowGRPOConfig"]["properties"]
    assert schema["$defs"]["PolicySpec"]["properties"]["backend"]["enum"] == ["hf", "litellm", "scripted", "vllm"]


@pytest.mark.slow
def test_validate_subprocess_has_no_traceback(root, tmp_path):
    bad = tmp_path / "loop.yaml"
    text = (root / "graphs" / "agentflow.yaml").read_text().replace("limits: {max_turns: 3, ", "limits: {")
    bad.write_text(text)
    out = subprocess.run([sys.executable, "-m", "masgraph.cli", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "limits.max_turns" in out.stderr and "Traceback" not in out.stderr


def test_user_task_from_a_file(tmp_path):
    (tmp_path / "mytask.py").write_text(
        "from masgraph.tasks import Item, Task\n"
        "class Echo(Task):\n    name = 'echo'\n"
        "    def generate(self, split, n, seed):\n"
        "        return [Item(f'{split}-{i}', f'say {i} ({split})', str(i)) for i in range(n)]\n"
        "    def score(self, item, answer):\n        return float(answer == item.answer)\n")
    task = load_task_file(f"{tmp_path / 'mytask.py'}:Echo")
    assert task.items("test", 2)[1].answer == "1"
    from masgraph.errors import MasgraphError
    with pytest.raises(MasgraphError, match="not a masgraph.tasks.Task subclass"):
        load_task_file(f"{tmp_path / 'mytask.py'}:Missing")


def test_memory_node_compacts_the_log(scripted, runner_for, run):
    from masgraph.tasks import Item, Task

    class Two(Task):
        name = "two"

        def generate(self, split, n, seed):
            return [Item(f"{split}-{i}", "What is 2 + 3?", "5") for i in range(n)]

        def score(self, item, answer):
            return float(answer == item.answer)

    graph = (GraphBuilder("mem").add_policy("p", backend="scripted")
             .add_tool("calculator", kind="calculator")
             .add_node("planner", role="planner", policy="p")
             .add_node("executor", role="executor", tools=["calculator"])
             .add_node("memory", role="memory")
             .add_node("verifier", role="verifier", policy="p")
             .add_node("generator", role="generator", policy="p")
             .add_edge("planner", "executor").add_edge("executor", "memory").add_edge("memory", "verifier")
             .add_edge("verifier", "planner", when="continue").add_edge("verifier", "generator", when="stop")
             .set(limits={"max_turns": 4}, memory={"max_actions": 2}).compile())
    seen = []

    def generator(req):
        seen.append(req.messages[-1]["content"])
        return "Answer: 5"

    backend = scripted({"verifier": "Conclusion: CONTINUE", "generator": generator})
    [tr] = run(runner_for(graph, backend, n=1).run_task(Two())).traces
    assert tr.status == "ok" and tr.turns == 4
    assert "Summary: 1 earlier step(s) compacted" in seen[0] and seen[0].count("tool: calculator") == 2



def test_every_llm_call_records_its_sampling_params(scripted, runner_for, run):
    graph = (GraphBuilder("hot").add_policy("p", backend="scripted",
                                            sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 8})
             .add_policy("q", backend="scripted")
             .add_node("a", role="generator", policy="p").add_node("b", role="generator", policy="q")
             .add_edge("a", "b").set(entry="a", exit="b").compile())
    backend = scripted({"a": "Answer: 1", "b": "Answer: 2"})
    [tr] = run(runner_for(graph, backend, n=1).run_task(get_task("basic_arithmetic"))).traces
    assert [(c.policy, c.temperature, c.top_p) for c in tr.llm_calls] == [("p", 0.7, 0.9), ("q", 0.0, 1.0)]
    assert type(tr).model_validate_json(tr.model_dump_json()) == tr  # stored and read back

class _OpenAIStub(BaseHTTPRequestHandler):
    """Answers "Answer: <last message>" and reports usage: prompt = characters of all messages, completion = 2
    (no usage at all for model "openai/quiet")."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant",
                                          "content": "Answer: " + body["messages"][-1]["content"][:20]}}]}
        if body["model"] != "quiet":
            n = sum(len(m["content"]) for m in body["messages"])
            reply["usage"] = {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def openai_stub():
    """URL of a local OpenAI-compatible stub server (`_OpenAIStub`) over a real socket."""
    server = HTTPServer(("127.0.0.1", 0), _OpenAIStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


@pytest.mark.slow
def test_litellm_records_the_token_usage_the_server_reports(openai_stub, runner_for, run, tmp_path):
    """A text-only backend has no ids to count: the server's usage goes into every call, the trace totals, the
    call events, the episode index (the TUI's token column) and the usage an OpenAI endpoint reports."""
    from masgraph.backends.litellm import LiteLLMBackend
    from masgraph.serve.openai_api import usage

    out = run(LiteLLMBackend("openai/stub", api_base=openai_stub).complete(
        [Request([{"role": "user", "content": "hi"}]), Request([{"role": "user", "content": "hello"}])]))
    assert [(c.prompt_tokens, c.completion_tokens, c.n_prompt, c.n_completion) for c in out] == [
        (2, 2, 2, 2), (5, 2, 5, 2)]
    [quiet] = run(LiteLLMBackend("openai/quiet", api_base=openai_stub).complete([Request([{"role": "user",
                                                                                          "content": "hi"}])]))
    assert (quiet.prompt_tokens, quiet.completion_tokens, quiet.n_completion) == (None, None, 0)

    graph = (GraphBuilder("api").add_policy("p", backend="litellm", model="openai/stub", api_base=openai_stub)
             .add_node("a", role="generator", policy="p").add_node("b", role="generator", policy="p")
             .add_edge("a", "b").set(entry="a", exit="b").compile())
    backend = LiteLLMBackend("openai/stub", api_base=openai_stub)
    sink = ListSink()
    result = run(runner_for(graph, backend, n=3).run_task(get_task("basic_arithmetic"), sinks=[sink]))
    for tr in result.traces:
        calls = tr.llm_calls
        assert len(calls) == 2 and all(c.completion_tokens == 2 and c.prompt_tokens > 10 for c in calls)
        assert tr.completion_tokens == 4 and tr.prompt_tokens == sum(c.prompt_tokens for c in calls)
        assert usage(tr)["total_tokens"] == tr.prompt_tokens + 4
        assert type(tr).model_validate_json(tr.model_dump_json()) == tr
    assert result.summary["completion_tokens_mean"] == 4
    run_dir = next((tmp_path / "runs").iterdir())
    index = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert [e["tokens"] for e in index] == [4, 4, 4] and all(s[3] == 2 for e in index for s in e["steps"])
    calls = [e for e in sink.events if isinstance(e, LLMCallFinished)]  # what a live TUI counts
    assert len(calls) == 6 and all(e.completion_tokens == 2 and e.prompt_tokens > 10 for e in calls)


def test_calls_with_ids_store_no_usage_fields(scripted, runner_for, run):
    """The reported counts are for text-only calls: a call with ids stores none (no `null`s in every line)."""
    graph = (GraphBuilder("s").add_policy("p", backend="scripted").add_node("a", role="generator", policy="p")
             .set(entry="a", exit="a").compile())
    [tr] = run(runner_for(graph, scripted({"a": "Answer: 1"}), n=1).run_task(get_task("basic_arithmetic"))).traces
    [call] = tr.llm_calls
    assert call.completion_ids and call.n_completion == len(call.completion_ids) == tr.completion_tokens
    assert "completion_tokens" not in call.model_dump_json() and "prompt_tokens" not in call.model_dump_json()


@pytest.mark.slow
def test_litellm_backend_against_a_local_openai_compatible_server(run):
    from masgraph.backends.base import BackendError
    from masgraph.backends.litellm import LiteLLMBackend

    server = HTTPServer(("127.0.0.1", 0), _OpenAIStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = LiteLLMBackend("openai/stub", api_base=f"http://127.0.0.1:{server.server_port}/v1")
        out = run(backend.complete([Request([{"role": "user", "content": "hi"}]),
                                    Request([{"role": "user", "content": "yo"}])]))
        assert [c.text for c in out] == ["Answer: hi", "Answer: yo"] and out[0].completion_ids == []
        assert backend.returns_tokens is False
    finally:
        server.shutdown()
    dead = LiteLLMBackend("openai/stub", api_base="http://127.0.0.1:9/v1", timeout_s=2)
    with pytest.raises(BackendError, match="openai/stub"):
        run(dead.complete([Request([{"role": "user", "content": "hi"}])]))


@pytest.mark.slow
def test_a_closed_pipe_stops_quietly():
    """`masgraph schema | head -c 1`: the reader goes away; no traceback, exit 141 like other Unix tools."""
    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "schema"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the child has imported anything and written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err, err
