"""Conversation memories (masgraph/memory/conversations.py, a memory node's `scope: conversation`): a fact store kept
across the episodes of one conversation — in order, isolated per conversation, unchanged by a failed step, kept on
disk across a restart — and over HTTP with the request's `masgraph.conversation`."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from masgraph.agent import Agent
from masgraph.backends.scripted import ScriptedBackend
from masgraph.engine import Engine
from masgraph.errors import MasgraphError, SpecError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.memory.conversations import ConversationStores
from masgraph.memory.store import FactStore

GRAPH = """\
name: remember
policies:
  main: {backend: scripted, model: none}
nodes:
  memory: {role: memory, mode: append, scope: conversation}
  answer: {role: generator, policy: main, prompt: memory_answer}
edges:
  - {source: memory, target: answer}
entry: memory
exit: answer
"""


def _add(store: FactStore, fact: str) -> None:
    store.entries[store.next_id] = fact
    store.next_id += 1


def test_a_store_is_kept_per_conversation_and_a_failed_edit_leaves_it_as_it_was(run):
    stores = ConversationStores()

    async def turns():
        async with stores.open("a") as s:
            _add(s, "Kalo Mira lives in Rafeport.")
        async with stores.open("b") as s:
            assert s.render() == "(empty)"  # another conversation starts empty
            _add(s, "Vela Dorn lives in Ashmere.")
        with pytest.raises(RuntimeError):
            async with stores.open("a") as s:
                _add(s, "half an episode")
                raise RuntimeError("the step failed")
        async with stores.open("a") as s:
            _add(s, "Kalo Mira moved to Orrinford.")

    run(turns())
    assert stores.peek("a").render() == "[1] Kalo Mira lives in Rafeport.\n[2] Kalo Mira moved to Orrinford."
    assert stores.peek("b").render() == "[1] Vela Dorn lives in Ashmere."


def test_episodes_of_one_conversation_take_turns(run):
    stores, order = ConversationStores(), []

    async def episode(name: str, hold_s: float):
        async with stores.open("c") as s:
            order.append(f"{name} in ({len(s.entries)} entries)")
            await asyncio.sleep(hold_s)
            _add(s, name)
            order.append(f"{name} out")

    async def both():
        await asyncio.gather(episode("first", 0.05), episode("second", 0.0))

    run(both())
    # the second waited for the first and saw its entry; interleaved, it would have seen none
    assert order == ["first in (0 entries)", "first out", "second in (1 entries)", "second out"]


def test_stores_on_disk_survive_a_restart_and_any_id_is_a_safe_file_name(tmp_path, run):
    hostile = ["../../etc/passwd", "a/b\\c", "ü" * 200, " "]

    async def write(stores):
        for i, cid in enumerate(hostile):
            async with stores.open(cid) as s:
                _add(s, f"fact {i}")

    run(write(ConversationStores(tmp_path / "conv")))
    files = sorted(p.name for p in (tmp_path / "conv").iterdir())
    assert len(files) == len(hostile) and all(len(f) == 37 and f.endswith(".json") for f in files)
    again = ConversationStores(tmp_path / "conv")  # a restarted server
    assert [again.peek(cid).render() for cid in hostile] == [f"[1] fact {i}" for i in range(len(hostile))]
    assert json.loads(again.path(hostile[0]).read_text())["conversation"] == hostile[0]


def test_the_least_recently_used_store_is_dropped_from_memory_but_not_from_disk(tmp_path, run):
    memory_only, on_disk = ConversationStores(max_open=2), ConversationStores(tmp_path, max_open=2)

    async def fill(stores):
        for cid in ("a", "b", "c"):
            async with stores.open(cid) as s:
                _add(s, cid)

    run(fill(memory_only))
    run(fill(on_disk))
    assert memory_only.peek("a").render() == "(empty)"  # dropped: the oldest of three with room for two
    assert on_disk.peek("a").render() == "[1] a"  # read back from its file


def test_an_unreadable_store_file_and_an_unusable_directory_are_clear_errors(tmp_path):
    stores = ConversationStores(tmp_path)
    stores.path("x").write_text("{not json")
    with pytest.raises(MasgraphError, match="unreadable .* move it away"):
        stores.peek("x")
    stores.path("y").write_text(json.dumps({"conversation": "someone else", "next_id": 1, "entries": []}))
    with pytest.raises(MasgraphError, match="holds conversation 'someone else'"):
        stores.peek("y")
    (tmp_path / "file").write_text("")
    with pytest.raises(MasgraphError, match="cannot use .* for conversation memories"):
        ConversationStores(tmp_path / "file" / "sub")
    with pytest.raises(MasgraphError, match="max_open"):
        ConversationStores(max_open=0)


def test_scope_conversation_needs_a_fact_store_mode():
    bad = GRAPH.replace("mode: append, scope: conversation", "scope: conversation")
    with pytest.raises(SpecError, match=r"nodes\.memory.*mode: summary keeps none"):
        parse_spec(bad, "g.yaml")


def _engine(text: str = GRAPH) -> Engine:
    graph = compile_spec(parse_spec(text, "g.yaml"))
    backend = ScriptedBackend(default=lambda req: "Answer: " + req.messages[-1]["content"].replace("\n", " | "))
    return Engine(graph, backends={"scripted": backend})


def test_a_conversation_memory_node_continues_its_conversation_and_nothing_else(run):
    engine = _engine()

    async def episodes():
        a1 = await engine.episode("Kalo Mira lives in Rafeport.\nWhere?", meta={"conversation": "a"})
        a2 = await engine.episode("Kalo Mira moved to Orrinford.\nWhere does Kalo Mira live?",
                                  meta={"conversation": "a"})
        b1 = await engine.episode("Vela Dorn lives in Ashmere.\nWhere?", meta={"conversation": "b"})
        none = await engine.episode("Vela Dorn lives in Ashmere.\nWhere?")
        return a1, a2, b1, none

    a1, a2, b1, none = run(episodes())
    memory = [t.steps[0].text for t in (a1, a2, b1, none)]
    assert memory[1] == ("Memory:\n[1] Kalo Mira lives in Rafeport.\n[2] Kalo Mira moved to Orrinford.\n"
                         "Question: Where does Kalo Mira live?")
    assert [op.target for op in a2.steps[0].memory_ops] == [2]  # numbered after the conversation's entries
    assert "Kalo" not in memory[2] and memory[2] == memory[3]  # other conversations, and none, start empty
    episode_scope = _engine(GRAPH.replace(", scope: conversation", ""))
    t = run(episode_scope.episode("Kalo Mira moved.\nWhere?", meta={"conversation": "a"}))
    assert t.steps[0].text == "Memory:\n[1] Kalo Mira moved.\nQuestion: Where?"  # scope: episode ignores it


def test_over_http_requests_that_name_a_conversation_share_its_memory(tmp_path):
    from tests.unit.test_server import serving  # a real uvicorn server in a thread

    engine = _engine()
    engine.conversations = ConversationStores(tmp_path / "conv")
    agent = Agent(engine.graph, engine=engine)
    with serving(agent, model="remember") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")

        def ask(text: str, conversation: str | None) -> str:
            extra = {"masgraph": {"conversation": conversation}} if conversation is not None else {}
            r = client.chat.completions.create(model="remember", messages=[{"role": "user", "content": text}],
                                               extra_body=extra)
            return r.choices[0].message.content

        ask("Kalo Mira lives in Rafeport.\nNoted?", "chat-1")
        assert "[1] Kalo Mira lives in Rafeport. | [2] Kalo Mira moved to Orrinford." in ask(
            "Kalo Mira moved to Orrinford.\nWhere does Kalo Mira live?", "chat-1")
        assert "Rafeport" not in ask("Where does Kalo Mira live?", "chat-2")
        assert "Rafeport" not in ask("Where does Kalo Mira live?", None)
        with pytest.raises(openai.BadRequestError, match="conversation"):
            ask("x\ny", "")  # an empty id is refused, not taken as "no conversation"
    restarted = ConversationStores(tmp_path / "conv")
    assert restarted.peek("chat-1").render().count("Kalo Mira") == 2
