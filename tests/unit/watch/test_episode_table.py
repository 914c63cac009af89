"""The episodes table at a wide terminal shows each episode's question and answer beside a bounded id, training runs'
evaluation episodes can be listed alone, and an episode's prompts say the tokenizer is loading while it is (issue
57 #18, #13); read from the recorded real-model runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from masgraph.watch.index import RunIndex
from masgraph.watch.table import ID_WIDTH, column_widths, header_text, row_text, select

RECORDED = Path(__file__).parents[2] / "data" / "recorded"


def _index(tmp_path) -> RunIndex:
    index = RunIndex(shutil.copytree(RECORDED / "agentflow-run", tmp_path / "run"))
    index.poll()
    return index


def test_a_wide_table_shows_question_and_answer_beside_a_bounded_id(tmp_path):
    index = _index(tmp_path)
    row = index.rows[0]
    ident, question, answer = column_widths(200)
    assert ident == ID_WIDTH and question > 2 * ID_WIDTH and answer > ID_WIDTH  # the id took ~160 of 200
    header, line = header_text(200).plain, row_text(row, 200).plain
    assert header.split()[:3] == ["episode", "question", "answer"] and len(line) == len(header) == 200
    assert line.startswith("…" + row.id[-(ID_WIDTH - 1):] + " ")  # the id's end: item and sample
    assert " ".join(row.query.split())[:question - 1] in line and row.answer.split()[0] in line
    assert column_widths(60)[1:] == (0, 0)  # narrow: the id and the counts only


def test_evaluation_episodes_are_listed_alone(tmp_path):
    index = _index(tmp_path)
    rows = index.rows
    rows[1].evaluation = 2  # as a training run's index line `"eval": 2` reads (test_evaluation_record.py)
    assert select(rows, kind="evaluation") == [rows[1]] and rows[1] not in select(rows, kind="rollouts")
    assert len(select(rows, kind="rollouts")) == len(rows) - 1 and select(rows) == rows


def test_prompts_asked_for_while_the_tokenizer_loads_say_so(tmp_path):
    from masgraph.watch.app import EpisodeScreen
    from masgraph.watch.render import step_text

    index = _index(tmp_path)
    screen = EpisodeScreen(index, index.rows[0])
    step = next(s for s in screen.trace.steps if s.llm)
    assert screen.tokenizer_note == "loading the tokenizer…"
    shown = step_text(step, None, show_prompt=True, no_decode=screen.tokenizer_note).plain
    assert f"{step.llm[0].n_prompt} tokens (loading the tokenizer…)" in shown and "no tokenizer" not in shown
