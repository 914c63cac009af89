"""Conversation memories on the real model and a real server: `masgraph serve graphs/memory.yaml --conversations DIR`
in its own process, the `openai` client naming a conversation. Whatever operations the embedded manager picks, each
turn starts from the store the conversation's previous turn left (replaying the turn's operations on it gives the
stored result), another conversation starts empty, and after kill -9 a restarted server continues from disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from masgraph.memory.conversations import ConversationStores
from masgraph.memory.store import FactStore
from masgraph.trace import MemoryOp

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(port: int, conv, log_path) -> subprocess.Popen:
    log = open(log_path, "a")  # a file, not a pipe: a full pipe would block the server
    return subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", os.path.join(ROOT, "graphs", "memory.yaml"),
                             "--port", str(port), "--no-store", "--conversations", str(conv)],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def _turn(url: str, text: str, conversation: str) -> list[MemoryOp]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="memory", messages=[{"role": "user", "content": text}],
                                       extra_body={"masgraph": {"conversation": conversation, "trace": True}})
    ext = r.model_extra["masgraph"]
    assert ext["status"] == "ok", ext
    [memory] = [s for s in ext["steps"] if s["node"] == "memory"]
    return [MemoryOp.model_validate(op) for op in memory["memory_ops"]]


def _replayed(start: FactStore, ops: list[MemoryOp]) -> FactStore:
    store = FactStore(dict(start.entries), start.next_id)
    for op in ops:  # as applied: targets resolved, fallbacks already ADDs
        if op.op == "ADD":
            assert op.target == store.next_id, (op, store)  # numbered after the entries it started from
            store.entries[op.target] = op.text or op.fact
            store.next_id += 1
        elif op.op == "UPDATE":
            assert op.target in store.entries, (op, store)
            store.entries[op.target] = op.text or op.fact
        elif op.op == "DELETE":
            assert op.target in store.entries, (op, store)
            del store.entries[op.target]
    return store


def _on_disk(conv, conversation: str) -> FactStore:
    return ConversationStores(conv).peek("memory", conversation)


@pytest.mark.slow
def test_a_served_conversation_continues_its_memory_across_turns_and_a_kill_9_restart(tmp_path, free_port,
                                                                                       wait_healthy):
    conv, log = tmp_path / "conv", tmp_path / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, conv, log)
    try:
        wait_healthy(url, proc, 180, log.read_text)
        ops1 = _turn(url, "Kalo Mira lives in Rafeport.\nVela Dorn lives in Ashmere.\nNoted?", "c")
        assert [op.fact for op in ops1] == ["Kalo Mira lives in Rafeport.", "Vela Dorn lives in Ashmere."]
        s1 = _on_disk(conv, "c")
        assert s1 == _replayed(FactStore(), ops1)
        ops2 = _turn(url, "Kalo Mira moved to Orrinford.\nIn which city does Kalo Mira live now?", "c")
        s2 = _on_disk(conv, "c")
        assert s2 == _replayed(s1, ops2)  # turn 2 started from turn 1's store
        other = _turn(url, "Kalo Mira moved to Orrinford.\nIn which city does Kalo Mira live now?", "d")
        assert _on_disk(conv, "d") == _replayed(FactStore(), other)  # another conversation: from empty
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc = _serve(port, conv, log)  # restarted on the same directory
        wait_healthy(url, proc, 180, log.read_text)
        ops3 = _turn(url, "Vela Dorn moved to Kelburg.\nIn which city does Vela Dorn live now?", "c")
        assert _on_disk(conv, "c") == _replayed(s2, ops3)  # continued from what was on disk before the kill
    finally:
        proc.terminate()
        proc.wait(60)
