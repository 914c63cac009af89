"""The episodes table of `masgraph watch`: its columns, rows, filters and sorting, as Rich text (no Textual here)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.text import Text

from masgraph.watch.index import Row
from masgraph.watch.render import STATUS_STYLE, human

COLUMNS: list[tuple[str, int]] = [("#", 7), ("status", 9), ("reward", 7), ("turns", 6), ("tokens", 7), ("time", 8)]
"""Fixed-width columns after the episode id, question and answer."""

ID_WIDTH = 24
"""Widest the episode id column gets (ids are long: `eval4-000012-basic_arithmetic-test-81-0`); the question and
answer take the rest of the width."""


def row_cells(row: Row) -> list[tuple[str, str]]:
    """(text, style) of each fixed column."""
    outcome = row.outcome
    status = row.status if row.status != "ok" else outcome
    style = {"correct": "green", "wrong": "yellow"}.get(status, STATUS_STYLE.get(row.status, ""))
    reward = "-" if row.reward is None else f"{row.reward:.2f}"
    return [(str(row.seq + 1), "dim"), (status, style), (reward, ""), (str(row.turns), ""), (human(row.tokens), ""),
            (f"{row.duration_s:.2f}s", "")]


def column_widths(width: int) -> tuple[int, int, int]:
    """(id, question, answer) widths for a table `width` cells wide: the id at most ID_WIDTH, the question two
    thirds of the rest and the answer one third; on a narrow screen the id alone (question and answer 0)."""
    flex = max(8, width - sum(w for _, w in COLUMNS) - 3)
    ident = min(ID_WIDTH, max(10, flex // 4))
    rest = flex - ident
    if rest < 16:
        return flex, 0, 0
    answer = rest // 3
    return ident, rest - answer, answer


def _cell(text: str, width: int, keep_end: bool = False) -> str:
    """`text` on one line, cut to `width` cells with an ellipsis (its start kept, or its end: an id's item and
    sample), padded to it."""
    line = " ".join(text.split())
    if len(line) > width:
        line = "…" + line[len(line) - width + 1:] if keep_end else line[: width - 1] + "…"
    return line.ljust(width)


def header_text(width: int) -> Text:
    text = Text(style="bold")
    ident, question, answer = column_widths(width)
    text.append(f"{'episode':<{ident}} ")
    if question:
        text.append(f"{'question':<{question}} {'answer':<{answer}} ")
    for name, w in COLUMNS:
        text.append(f"{name:>{w}}")
    return text


def row_text(row: Row, width: int) -> Text:
    text = Text(no_wrap=True)
    ident, question, answer = column_widths(width)
    text.append(_cell(row.id, ident, keep_end=True) + " ", style="cyan" if row.evaluation is not None else "")
    if question:
        text.append(_cell(row.query, question) + " ")
        text.append(_cell("-" if row.answer is None else row.answer, answer) + " ", style="bold")
    for (cell, style), (_, w) in zip(row_cells(row), COLUMNS, strict=True):
        text.append(f"{cell:>{w}}", style=style)
    return text


FILTERS = ("all", "failed", "correct", "wrong")
KINDS = ("all", "rollouts", "evaluation")
"""Which episodes of a training run a table shows: all, the training rollouts, or the held-out evaluations."""
SORTS = ("finished", "reward", "tokens", "turns", "time")


def after(options: Sequence[str], current: str) -> str:
    """The option after `current` (a key cycles through a filter's options)."""
    return options[(options.index(current) + 1) % len(options)]


def select(rows: Sequence[Row], outcome: str = "all", node_error: str | None = None, search: str = "",
           sort: str = "finished", reverse: bool = False, kind: str = "all") -> list[Row]:
    """The rows a table shows: filtered by kind (KINDS), by outcome, by a node that failed in them, by a search
    string (in the id, item, query or answer; case-insensitive), then sorted."""
    out: list[Row] = list(rows) if outcome == "all" else [r for r in rows if r.outcome == outcome]
    if kind != "all":
        out = [r for r in out if (r.evaluation is not None) == (kind == "evaluation")]
    if node_error:
        out = [r for r in out if node_error in r.failed_nodes]
    if search:
        needle = search.lower()
        out = [r for r in out if needle in r.id.lower() or needle in r.item.lower() or needle in r.query.lower()
               or (r.answer is not None and needle in r.answer.lower())]
    if sort != "finished":
        key = {"reward": lambda r: -math.inf if r.reward is None else r.reward, "tokens": lambda r: r.tokens,
               "turns": lambda r: r.turns, "time": lambda r: r.duration_s}[sort]
        out.sort(key=key, reverse=reverse)
    elif reverse:
        out.reverse()
    return out
