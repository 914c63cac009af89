"""Conversation memories (masgraph/memory/conversations.py, a memory node's `scope: conversation`): a fact store kept
across the episodes of one conversation — in order, isolated per conversation, unchanged by a failed step, kept on
disk across a restart — and over HTTP with the request's `masgraph.conversation`."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from masgraph.backends.scripted import ScriptedBackend
from masgraph.errors import MasgraphError, SpecError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.memory.conversations import ConversationStores
from masgraph.memory.store import FactStore
from masgraph.runtime.engine import Engine
from masgraph.serve.agent import Agent

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
        async with stores.open("m", "a") as s:
            _add(s, "Kalo Mira lives in Rafeport.")
        async with stores.open("m", "b") as s:
            assert s.render() == "(empty)"  # another conversation starts empty
            _add(s, "Vela Dorn lives in Ashmere.")
        with pytest.raises(RuntimeError):
            async with stores.open("m", "a") as s:
                _add(s, "half an episode")
                raise RuntimeError("the step failed")
        async with stores.open("m", "a") as s:
            _add(s, "Kalo Mira moved to Orrinford.")

    run(turns())
    assert stores.peek("m", "a").render() == "[1] Kalo Mira lives in Rafeport.\n[2] Kalo Mira moved to Orrinford."
    assert stores.peek("m", "b").render() == "[1] Vela Dorn lives in Ashmere."


def test_episodes_of_one_conversation_take_turns(run):
    stores, order = ConversationStores(), []

    async def episode(name: str, hold_s: float):
        async with stores.open("m", "c") as s:
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
    hostile = ["../../etc/passwd", "a/b\\c", "ü" * 200, " ", "\ud800"]

    async def write(stores):
        for i, cid in enumerate(hostile):
            async with stores.open("m", cid) as s:
                _add(s, f"fact {i}")

    run(write(ConversationStores(tmp_path / "conv")))
    files = sorted(p.name for p in (tmp_path / "conv").iterdir())
    assert len(files) == len(hostile) and all(len(f) == 37 and f.endswith(".json") for f in files)
    again = ConversationStores(tmp_path / "conv")  # a restarted server
    assert [again.peek("m", cid).render() for cid in hostile] == [f"[1] fact {i}" for i in range(len(hostile))]
    assert json.loads(again.path("m", hostile[0]).read_text())["conversation"] == hostile[0]


def test_the_least_recently_used_store_is_dropped_from_memory_but_not_from_disk(tmp_path, run):
    memory_only, on_disk = ConversationStores(max_open=2), ConversationStores(tmp_path, max_open=2)

    async def fill(stores):
        for cid in ("a", "b", "c"):
            async with stores.open("m", cid) as s:
                _add(s, cid)

    run(fill(memory_only))
    run(fill(on_disk))
    assert memory_only.peek("m", "a").render() == "(empty)"  # dropped: the oldest of three with room for two
    assert on_disk.peek("m", "a").render() == "[1] a"  # read back from its file


def test_an_unreadable_store_file_and_an_unusable_directory_are_clear_errors(tmp_path):
    stores = ConversationStores(tmp_path)
    stores.path("m", "x").write_text("{not json")
    with pytest.raises(MasgraphError, match="unreadable .* move it away"):
        stores.peek("m", "x")
    stores.path("m", "y").write_text(json.dumps({"node": "m", "conversation": "else", "next_id": 1, "entries": []}))
    with pytest.raises(MasgraphError, match="conversation 'else'"):
        stores.peek("m", "y")
    for body, what in (("[]", "a JSON list, not an object"), ("null", "a JSON NoneType"),
                       ('{"node": "m", "conversation": "z", "next_id": 1, "entries": [[1, "a"]]}', "would reuse")):
        stores.path("m", "z").write_text(body)
        with pytest.raises(MasgraphError, match=what):
            stores.peek("m", "z")
    with pytest.raises(MasgraphError, match="non-empty string"):
        stores.peek("m", "")
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
    from tests.unit.serve.serving import serving  # a real uvicorn server in a thread

    engine = _engine()
    engine.conversations = ConversationStores(tmp_path / "conv")
    agent = Agent(engine.graph, engine=engine)
    with serving(agent, model="remember") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")

        def ask(text: str, conversation: str | None) -> str:
            extra = {"masgraph": {"conversation": conversation, "trace": True}} if conversation is not None else {}
            r = client.chat.completions.create(model="remember", messages=[{"role": "user", "content": text}],
                                               extra_body=extra)
            if conversation and "\n" in text:  # the trace extension lists the memory step's operations
                ops = r.model_extra["masgraph"]["steps"][0]["memory_ops"]
                assert [op["fact"] for op in ops] == text.splitlines()[:-1] and ops[0]["op"] == "ADD"
            return r.choices[0].message.content

        ask("Kalo Mira lives in Rafeport.\nNoted?", "chat-1")
        assert "[1] Kalo Mira lives in Rafeport. | [2] Kalo Mira moved to Orrinford." in ask(
            "Kalo Mira moved to Orrinford.\nWhere does Kalo Mira live?", "chat-1")
        assert "Rafeport" not in ask("Where does Kalo Mira live?", "chat-2")
        assert "Rafeport" not in ask("Where does Kalo Mira live?", None)
        with pytest.raises(openai.BadRequestError, match="conversation"):
            ask("x\ny", "")  # an empty id is refused, not taken as "no conversation"
    restarted = ConversationStores(tmp_path / "conv")
    assert restarted.peek("memory", "chat-1").render().count("Kalo Mira") == 2


def test_a_lock_outlives_a_failed_holder_while_others_wait_for_it(run):
    """The holder fails while its store has been pushed out of memory and one episode waits: the next one to come
    must still queue behind that waiter (a dropped lock let two edit at once, and the last commit won)."""
    stores, order = ConversationStores(max_open=1), []

    async def failing():
        with pytest.raises(RuntimeError):
            async with stores.open("m", "a"):
                await asyncio.sleep(0.05)
                stores.peek("m", "b")  # another conversation pushes "a" out of memory
                raise RuntimeError("the step failed")

    async def adding(name: str, delay: float):
        await asyncio.sleep(delay)
        async with stores.open("m", "a") as s:
            order.append(f"{name} sees {sorted(s.entries.values())}")
            await asyncio.sleep(0.05)
            _add(s, name)

    async def all_three():
        await asyncio.gather(failing(), adding("B", 0.01), adding("C", 0.08))

    run(all_three())
    assert order == ["B sees []", "C sees ['B']"] and sorted(stores.peek("m", "a").entries.values()) == ["B", "C"]
    assert not stores._locks  # nothing left behind once nobody holds or waits


def test_a_failed_write_keeps_memory_and_disk_alike(tmp_path, run, monkeypatch):
    import masgraph.memory.conversations as conversations

    stores = ConversationStores(tmp_path)

    async def turn(fact: str):
        async with stores.open("m", "a") as s:
            _add(s, fact)

    run(turn("fact 1"))
    real = conversations.atomic_write

    def full(path, data, durable=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conversations, "atomic_write", full)
    with pytest.raises(OSError, match="No space"):
        run(turn("fact 2"))
    monkeypatch.setattr(conversations, "atomic_write", real)
    assert stores.peek("m", "a").render() == "[1] fact 1"  # not ahead of the disk
    run(turn("fact 2"))  # a retry adds it once
    assert ConversationStores(tmp_path).peek("m", "a").render() == "[1] fact 1\n[2] fact 2"


def test_dropping_a_memory_only_conversation_says_so(caplog, run):
    stores = ConversationStores(max_open=1)
    with caplog.at_level("WARNING", logger="masgraph.memory.conversations"):
        stores.peek("m", "a")
        stores.peek("m", "b")
    assert "conversation memory of 'a' (node 'm') dropped" in caplog.text and "--conversations" in caplog.text


TWO = """\
name: two-memories
policies:
  main: {backend: scripted, model: none}
nodes:
  short: {role: memory, mode: last_k, keep: 1, scope: conversation}
  long: {role: memory, mode: append, scope: conversation}
  answer: {role: generator, policy: main, prompt: memory_answer}
edges:
  - {source: short, target: long}
  - {source: long, target: answer}
entry: short
exit: answer
"""


def test_two_memory_nodes_keep_two_stores_of_one_conversation(run):
    engine = _engine(TWO)
    run(engine.episode("A lives in X.\nB lives in Y.\nWhere?", meta={"conversation": "c"}))
    t = run(engine.episode("C lives in Z.\nWhere?", meta={"conversation": "c"}))
    assert engine.conversations.peek("short", "c").render() == "[3] C lives in Z."
    assert engine.conversations.peek("long", "c").render() == "[1] A lives in X.\n[2] B lives in Y.\n[3] C lives in Z."
    assert [op.target for op in t.steps[1].memory_ops] == [3]


LOOP = """\
name: loop
policies:
  main: {backend: scripted, model: none}
nodes:
  memory: {role: memory, mode: append, scope: conversation, timeout_s: 0.5}
  check: {role: verifier, policy: main}
  answer: {role: generator, policy: main, prompt: memory_answer}
edges:
  - {source: memory, target: check}
  - {source: check, target: memory, when: continue}
  - {source: check, target: answer, when: stop}
entry: memory
exit: answer
limits: {max_turns: 2}
"""


def _looping() -> Engine:
    graph = compile_spec(parse_spec(LOOP, "g.yaml"))

    def reply(req):
        if req.key[1] == "check":
            return "Conclusion: CONTINUE" if req.key[2] == 1 else "Conclusion: STOP"
        return "Answer: ok"

    return Engine(graph, backends={"scripted": ScriptedBackend(default=reply)})


def test_a_memory_node_visited_again_in_a_loop_reads_its_conversation_without_adding_again(run):
    engine = _looping()
    t = run(engine.episode("A lives in X.\nWhere?", meta={"conversation": "c"}))
    memory = [s for s in t.steps if s.node == "memory"]
    assert [s.turn for s in memory] == [1, 2] and [len(s.memory_ops) for s in memory] == [1, 0]
    assert engine.conversations.peek("memory", "c").render() == "[1] A lives in X."


def test_waiting_for_the_conversation_is_not_the_nodes_work(run):
    """The memory node's limit is 0.5 s of work; it waits 1.5 s for another step that holds its conversation,
    and does not time out (a wait at something shared is not the node's work, as an LLM queue's is not)."""
    engine = _looping()

    async def busy_then_episode():
        async def hold():
            async with engine.conversations.open("memory", "c"):
                await asyncio.sleep(1.5)

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0.05)
        trace = await engine.episode("A lives in X.\nWhere?", meta={"conversation": "c"})
        await holder
        return trace

    t = run(busy_then_episode())
    assert t.status == "ok" and t.steps[0].error is None, (t.status, t.error, t.steps[0].error)
    assert t.steps[0].duration_s >= 1.4 and t.steps[0].work_s < 0.5
