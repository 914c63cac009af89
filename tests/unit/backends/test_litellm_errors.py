"""Issue 58 #18: a server that answers a chat completion with something else is an error that says what it
returned, never a raw internal message (HEAD: `IndexError: list index out of range` from masgraph's own code for
`"choices": []`, and litellm's messages with a Python traceback inside for an invalid choice)."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from masgraph.backends.base import BackendError, Request
from masgraph.backends.litellm import LiteLLMBackend
from masgraph.spec import SamplingSpec

BODIES = {"empty": b'{"choices": []}', "null": b'{"choices": [{"message": null, "finish_reason": "stop"}]}'}


@pytest.fixture(scope="module")
def server():
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = BODIES[self.path.split("/")[1]]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


@pytest.mark.parametrize("body, says", [("empty", "returned no completion message (choices: [])"),
                                        ("null", "Invalid response object")])
def test_a_server_that_returns_no_completion_is_a_backend_error_saying_so(server, body, says):
    backend = LiteLLMBackend("openai/x", api_base=f"{server}/{body}", timeout_s=30)
    request = Request([{"role": "user", "content": "hi"}], sampling=SamplingSpec(max_tokens=4))
    with pytest.raises(BackendError) as err:
        asyncio.run(backend.complete([request]))
    message = str(err.value)
    assert message.startswith("litellm openai/x: ") and says in message
    assert "Traceback" not in message and "index out of range" not in message
