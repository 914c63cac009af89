"""Memory rendering, the run store's file contract, and the tasks' splits."""

from __future__ import annotations

import json

from masgraph.memory.action_log import Action, ActionLog
from masgraph.store import RunStore, read_traces
from masgraph.tasks import TASKS, get_task, load_kb, make_kb
from masgraph.trace import EpisodeFinished, EpisodeStarted, Step, StepFinished, Trace


def test_action_log_truncates_old_actions_and_long_results():
    log = ActionLog(max_actions=2, max_result_chars=40)
    for i in range(4):
        log.append(Action("executor", f"goal {i}", "calculator", f"{i}+1", "x" * 100 if i == 3 else str(i + 1)))
    text = log.render()
    assert "(2 earlier steps not shown)" in text and "goal 0" not in text and "Step 4: goal 3" in text
    assert "[...]" in text and max(len(line) for line in text.splitlines()) < 70
    log.compact(1, "found 1, 2, 3")
    assert log.render().startswith("Summary: found 1, 2, 3") and len(log.actions) == 1


def test_store_is_readable_while_written(tmp_path):
    store = RunStore(tmp_path / "run", spec=None, config={})
    done = Trace(episode_id="e1", item_id="i1", query="q", answer="a", reward=1.0)
    store.emit(EpisodeStarted(episode_id="e1", item_id="i1", query="q"))
    store.emit(StepFinished(step=Step(episode_id="e1", index=0, node="n", role="generator", turn=1)))
    store.emit(EpisodeFinished(trace=done))
    store.emit(EpisodeStarted(episode_id="e2", item_id="i2", query="q2"))  # not flushed yet: still readable
    assert [t.episode_id for t in read_traces(tmp_path / "run")] == ["e1"]
    with open(tmp_path / "run" / "events.jsonl", "a") as f:  # a line cut mid-write is ignored
        f.write('{"v":1,"kind":"episode_fin')
    assert [t.reward for t in read_traces(tmp_path / "run")] == [1.0]
    store.close({"accuracy": 1.0})
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"accuracy": 1.0}


def test_splits_are_deterministic_and_disjoint():
    for name in ("basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic", "lookup"):
        task = get_task(name)
        train, test = task.items("train", 40), task.items("test", 20)
        assert task.items("test", 20) == test and len(test) == 20, name
        assert not {t.question for t in train} & {t.question for t in test}, name
        assert task.score(test[0], test[0].answer) == 1.0, name
        assert task.score(test[0], "definitely wrong") < 0.05, name  # reasoning-gym gives 0.01 for bad form
    assert set(TASKS) >= {"basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic", "lookup"}


def test_lookup_kb_is_the_generated_one_and_answerable():
    shipped = load_kb()["docs"]
    assert shipped == make_kb()
    people = load_kb()["people"]
    cities = {d["facts"]["city"]: d["facts"]["country"] for d in shipped if d["id"].startswith("city-")}
    assert all(cities[p["city"]] == p["country"] for p in people)
