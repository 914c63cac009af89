"""Tasks from data files (`--task data:PATH`, masgraph/datatask.py) and their scorers (masgraph/scorers.py):
hand-computed scores, the split rule, and a located error for every bad file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from masgraph.errors import MasgraphError
from masgraph.tasks import resolve_task
from masgraph.tasks.scorers import alternatives, choice, contains, exact, game24, number

AGENTFLOW = Path(os.environ.get("MASGRAPH_AGENTFLOW_DATA")
                 or Path(__file__).resolve().parents[4] / "shared" / "benchmarks" / "agentflow")
"""AgentFlow's released sets: beside the checkout (../shared), or where $MASGRAPH_AGENTFLOW_DATA says."""


@pytest.mark.parametrize("gold,expected", [
    ("['james madison']", ["james madison"]), (["a", "b"], ["a", "b"]), ("Paris", ["Paris"]), (42, ["42"]),
    ("[not a list", ["[not a list"]), ("[]", ["[]"]), ("[__import__('os')]", ["[__import__('os')]"]),
])
def test_gold_alternatives_are_read_as_literals_only(gold, expected):
    assert alternatives(gold) == expected


@pytest.mark.parametrize("scorer,answer,gold,item,score", [
    (exact, " Paris ", ["paris"], {}, 1.0), (exact, "Paris, France", ["paris"], {}, 0.0),
    (contains, "It was James Madison.", ["james madison"], {}, 1.0),
    (contains, "The answer: the Beatles!", ["Beatles"], {}, 1.0),
    (contains, "madisonian", ["madison"], {}, 0.0),  # whole words only
    (contains, "anything", [""], {}, 0.0),  # an empty gold answer matches nothing
    (number, "so it is 1,234.", ["1234"], {}, 1.0), (number, "8.0", ["8"], {}, 1.0), (number, "3/4", ["0.75"], {}, 1.0),
    (number, "12 then 13", ["12"], {}, 0.0),  # the last number counts
    (number, "no digits", ["1"], {}, 0.0),
    (choice, "The answer is (B).", ["B. 0.7"], {"choices": "['A. 0.9', 'B. 0.7']"}, 1.0),
    (choice, "A", ["B. 0.7"], {"choices": "['A. 0.9', 'B. 0.7']"}, 0.0),
    (choice, "0.7", ["B. 0.7"], {"choices": "['A. 0.9', 'B. 0.7']"}, 1.0),  # the option's text, no letter
    (choice, "C", ["Colorectal cancer"], {"options": "['A. Oral ulcers', 'B. Fever', 'C. Colorectal cancer']"}, 1.0),
    (choice, "Oral ulcers", ["Colorectal cancer"], {"options": ["A. Oral ulcers", "C. Colorectal cancer"]}, 0.0),
    (game24, "(1+1+1)×8", [], {"question": "[1, 1, 1, 8]"}, 1.0),
    (game24, "Answer: (10 * 10 - 4) / 4 = 24", [], {"question": "[4, 4, 10, 10]"}, 1.0),
    (game24, "8 / (3 - 8 / 3)", [], {"question": "[3, 3, 8, 8]"}, 1.0),  # exact fractions: 8/3 is not 2.67
    (game24, "8 * 3", [], {"question": "[1, 1, 1, 8]"}, 0.0),  # not the four numbers
    (game24, "(1+1+1)*8 + 1 - 1", [], {"question": "[1, 1, 1, 8]"}, 0.0),  # a number used twice
    (game24, "(1+1+1)*8*1", [], {"question": "[1, 1, 2, 8]"}, 0.0),  # 2 missing, 1 extra
    (game24, "__import__('os').system('x')", [], {"question": "[1, 1, 1, 8]"}, 0.0),
    (game24, "(1+1+1)**8", [], {"question": "[1, 1, 1, 8]"}, 0.0),  # only + - * /
])
def test_scorers_by_hand(scorer, answer, gold, item, score):
    assert scorer(answer, gold, item) == score


def _write(path: Path, records: list, jsonl: bool = False) -> Path:
    path.write_text("\n".join(map(json.dumps, records)) if jsonl else json.dumps(records))
    return path


def test_a_jsonl_file_with_defaults_splits_by_question_hash(tmp_path):
    records = [{"id": i, "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(200)]
    task = resolve_task(f"data:{_write(tmp_path / 'sums.jsonl', records, jsonl=True)}")
    assert task.name == "sums"
    train, test = task.items("train", 500, 0), task.items("test", 500, 0)
    assert len(train) + len(test) == 200 and 20 <= len(test) <= 60  # ~20 % held out
    assert not {i.question for i in train} & {i.question for i in test}
    order = [int(i.id.rsplit("-", 1)[1]) for i in test]
    assert order == sorted(order) and task.items("test", 5, 7) == test[:5]  # file order, whatever the seed
    other = task.items("train", 500, 1)
    assert other != train and sorted(other, key=str) == sorted(train, key=str)  # the seed shuffles train only
    item = test[0]  # the default scorer: contains, as whole words
    assert task.score(item, f"It is {item.answer}.") == 1.0 and task.score(item, f"It is 1{item.answer}.") == 0.0


def test_a_task_file_names_fields_scorer_and_split(tmp_path):
    _write(tmp_path / "train.json", [{"q": "[1, 1, 1, 8]", "a": "x"}, {"q": "[4, 4, 10, 10]", "a": "y"}])
    _write(tmp_path / "held.json", [{"q": "[3, 3, 8, 8]", "a": "z", "kind": "hard"}])
    (tmp_path / "t.yaml").write_text("name: g24\nfile: train.json\ntest_file: held.json\nsplit: file\nquestion: q\n"
                                     "answer: a\nscorer: game24\ntype: kind\n")
    task = resolve_task(f"data:{tmp_path / 't.yaml'}")
    [held] = task.items("test", 10, 0)
    assert task.name == "g24" and held.question == "[3, 3, 8, 8]" and held.meta["type"] == "hard"
    assert len(task.items("train", 10, 0)) == 2
    assert task.score(held, "8/(3-8/3)") == 1.0 and task.score(held, "24") == 0.0


@pytest.mark.parametrize("content,task_file,message", [
    ("[1, 2]", None, "item 1 is a int, not an object"),
    ('[{"question": "q"}]', None, "has no field 'answer' (its fields: question)"),
    ('{"question": "q"}', None, "holds a JSON dict, not a list"),
    ("[]", None, "holds no items"),
    ("[{", None, "not JSON"),
    ('[{"question": "  ", "answer": "a"}]', None, "the question field 'question' is empty"),
    ('[{"question": "q", "answer": "a"}]', "file: d.json\nscorer: judge-me\n", "scorer: Input should be"),
    ('[{"question": "q", "answer": "a"}]', "file: d.json\nsplit: file\n", "split: file needs test_file"),
    ('[{"question": "q", "answer": "a"}]', "file: d.json\nquestoin: q\n", "questoin: Extra inputs"),
    ('[{"question": "q", "answer": "a"}]', "file: missing.json\n", "does not exist"),
    ('[{"question": "q", "answer": "a"}]', "- a list\n", "is not a mapping"),
])
def test_bad_files_are_one_located_error(tmp_path, content, task_file, message):
    (tmp_path / "d.json").write_text(content)
    ref = tmp_path / "d.json"
    if task_file is not None:
        ref = tmp_path / "t.yaml"
        ref.write_text(task_file)
    with pytest.raises(MasgraphError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_task(f"data:{ref}")


def test_a_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"question": "q", "answer": "a"}\n\n{"question": \n')
    with pytest.raises(MasgraphError, match=r"d.jsonl:3: not a JSON object"):
        resolve_task(f"data:{tmp_path / 'd.jsonl'}")
    with pytest.raises(MasgraphError, match="give a .json or .jsonl data file"):
        resolve_task(f"data:{tmp_path / 'd.csv'}")


@pytest.mark.skipif(not AGENTFLOW.is_dir(), reason="no AgentFlow sets (../shared or $MASGRAPH_AGENTFLOW_DATA)")
def test_agentflows_game_of_24_set_reads_and_its_own_reference_answers_score_1(tmp_path):
    (tmp_path / "g.yaml").write_text(f"file: {AGENTFLOW / 'gameof24' / 'data.json'}\nsplit: test\nscorer: game24\n")
    task = resolve_task(f"data:{tmp_path / 'g.yaml'}")
    items = task.items("test", 300, 0)
    assert task.name == "gameof24" and len(items) == 300 and items[0].question == "[1, 1, 1, 8]"
    scores = [task.score(it, it.answer) for it in items]  # the set's own solutions
    assert sum(scores) == 300, [it.answer for it, s in zip(items, scores) if not s][:5]
    with pytest.raises(MasgraphError, match="it is an evaluation set for `masgraph run`"):  # split: test
        task.items("train", 10, 0)


def test_the_task_file_schema_is_printed_with_the_judge(capsys):
    from masgraph.cli import main

    assert main(["schema", "--task-file"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "judge" in schema["properties"]["scorer"]["enum"] and "JudgeSpec" in schema["$defs"]
    assert schema["additionalProperties"] is False


def _unhashed(n: int) -> list[dict]:
    """n items none of whose questions falls in the 20 % hash share (the case of issue 57 #9: a 12-line file)."""
    from masgraph.tasks import _digest

    for offset in range(10_000):
        qs = [f"What is {i + offset} + {2 * i}?" for i in range(n)]
        if all(_digest(q) % 10_000 >= 2_000 for q in qs):
            return [{"question": q, "answer": str(3 * i + offset)} for i, q in enumerate(qs)]
    raise AssertionError("no such file")


def test_a_small_file_holds_out_one_item_in_five_even_when_no_hash_falls_in_the_share(tmp_path):
    task = resolve_task(f"data:{_write(tmp_path / 'arith.jsonl', _unhashed(12), jsonl=True)}")
    train, test = task.items("train", 100, 0), task.items("test", 6, 0)  # `--n 6`: the 2 there are
    assert len(test) == 2 and len(train) == 10 and not {i.question for i in train} & {i.question for i in test}
    assert [int(i.id.rsplit("-", 1)[1]) for i in test] == sorted(int(i.id.rsplit("-", 1)[1]) for i in test)
    assert task.items("test", 6, 3) == test  # whatever the seed
    assert task.split_note.startswith("2 of 12 items held out (split: hash")
    one = resolve_task(f"data:{_write(tmp_path / 'one.jsonl', _unhashed(1), jsonl=True)}")
    assert len(one.items("test", 5, 0)) == 1  # `masgraph run` has its item
    with pytest.raises(MasgraphError, match=r"task 'one' has no train items: 1 of 1 items held out .*add items"):
        one.items("train", 5, 0)


def test_a_hash_split_keeps_every_item_the_share_holds_out(tmp_path):
    """The minimum only adds items: a file whose share already holds out enough keeps exactly the hash rule."""
    from masgraph.tasks import _digest

    records = [{"id": i, "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(200)]
    task = resolve_task(f"data:{_write(tmp_path / 'sums.jsonl', records, jsonl=True)}")
    hashed = {r["question"] for r in records if _digest(r["question"]) % 10_000 < 2_000}
    test = {i.question for i in task.items("test", 500, 0)}
    assert hashed <= test and len(test) == max(len(hashed), 40)


def test_a_split_test_file_says_it_cannot_train(tmp_path):
    _write(tmp_path / "eval.jsonl", _unhashed(3), jsonl=True)
    (tmp_path / "eval.yaml").write_text("file: eval.jsonl\nsplit: test\n")
    task = resolve_task(f"data:{tmp_path / 'eval.yaml'}")
    assert len(task.items("test", 10, 0)) == 3
    with pytest.raises(MasgraphError, match=r"no train items: 3 of 3 items held out \(split: test, all of them: an "
                                            r"evaluation set\); it is an evaluation set for `masgraph run`; to train"):
        task.items("train", 1, 0)


def test_a_loaded_task_remembers_the_reference_that_loads_it_again(tmp_path, monkeypatch):
    """config.json records `task_ref` (issue 57 #11): a data task's absolute path, not its name 'arith'."""
    from masgraph.tasks import get_task, task_ref

    _write(tmp_path / "arith.jsonl", _unhashed(6), jsonl=True)
    monkeypatch.chdir(tmp_path)
    task = resolve_task("data:arith.jsonl")
    assert task.name == "arith" and task_ref(task) == f"data:{tmp_path / 'arith.jsonl'}"
    monkeypatch.chdir(tmp_path.parent)  # another directory: the reference still loads the same items
    again = resolve_task(task_ref(task))
    assert again.items("test", 5, 0) == task.items("test", 5, 0)
    assert task_ref(get_task("basic_arithmetic")) == "basic_arithmetic"
