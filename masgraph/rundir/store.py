"""The run store: a run directory's spec snapshot, resolved config, append-only events.jsonl, episode index and
results summary, written as a run goes (masgraph/rundir/read.py reads them back).

events.jsonl holds one event a line, `{"v": 2, "kind": ..., ...}` (masgraph/events.py), every kind. A step is
written once, as its `step` line; the `episode_finished` line then holds the trace without its steps and, at top
level, `"steps": N`, the number of step lines of that episode that make up `trace.steps` (the readers here put
them back). Where the steps of a finished trace are not exactly the steps sent for that episode (a trace built
by hand, two episodes sharing an id) the line holds the whole trace and no "steps" key, as every v1 line does
(v1: episode lines only); both kinds of line read the same.

Events are serialised when flushed, in one batch: at most `flush_s` (0.1 s) after they were sent, by one timer on
the running event loop, and at once when an episode ends. So a watcher sees a step within ~0.1 s, and the
scheduler may still complete a step it has sent (its `bounded` flag) until it next awaits.

A store never lets one bad record stop it: an event pydantic cannot serialise as is (a lone UTF-16 surrogate in
a text: JSON text must be UTF-8) is written with those characters replaced by U+FFFD, one that cannot be written
at all is dropped, and a failed write is given up; each is counted in `RunStore.errors`, kept in `last_error` and
logged (logger `masgraph.store`), and the events after it are written as usual.
"""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import os
import platform
import re
import sys
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from masgraph.errors import MasgraphError
from masgraph.events import (
    EVENT_SCHEMA_VERSION,
    EpisodeFinished,
    EpisodeStarted,
    Event,
)
from masgraph.files import atomic_write
from masgraph.rundir.layout import CONFIG, EVENTS, INDEX, SPEC, SUMMARY
from masgraph.rundir.read import _ACCOUNTED, Parser, _SentSteps, follow, read_jsonl, read_traces
from masgraph.spec import GraphSpec
from masgraph.trace import EVALUATION, Step, Trace

_log = logging.getLogger("masgraph.store")


__all__ = ["INDEX", "Parser", "RunStore", "follow", "new_run_dir", "package_versions", "read_jsonl", "read_traces",
           "step_flag"]
"""`read`'s readers are importable from here too: a run store and its readers are one format."""

PACKAGES = ("masgraph", "torch", "transformers", "peft", "pydantic", "networkx", "reasoning-gym", "litellm")


@lru_cache(maxsize=1)  # metadata lookups scan site-packages (~50 ms); versions do not change in a process
def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


SECRET_FLAGS = ("--api-key",)
"""Command-line options whose value is a secret: config.json keeps the option, never its value."""


def redacted_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of every secret option replaced by `***`: `--api-key KEY`, `--api-key=KEY`, and the
    abbreviations argparse takes for it (`--ap KEY`)."""
    out: list[str] = []
    hide = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        secret = len(flag) >= 4 and any(f.startswith(flag) for f in SECRET_FLAGS)
        if hide:
            out.append("***")
        elif secret and eq:
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        hide = secret and not eq and not hide
    return out


def new_run_dir(root: str | Path, name: str) -> Path:
    """A fresh, uniquely named directory under root."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(root)
    for i in range(1000):
        path = root / f"{name}-{stamp}{f'-{i}' if i else ''}"
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise MasgraphError(f"cannot create a run directory under {root}: 1000 runs of {name!r} started this second; "
                        "pass another --runs-dir")


class RunStore:
    """A sink that writes one run directory: spec.yaml and config.json when opened, events.jsonl while the run
    goes (the format is in this module's docstring), summary.json when closed. summary.json exists only once the
    run has ended: a store opened on a directory again (a resumed training run) removes the old one, so a
    watcher knows when to stop.

    Example:
        >>> store = RunStore(new_run_dir("/tmp/masgraph-doc", "demo"), spec=None, config={"n": 1})
        >>> store.close({"accuracy": 1.0}); (store.path / "summary.json").exists()
        True
    """

    def __init__(self, path: str | Path, spec: GraphSpec | None, config: dict[str, Any], flush_s: float = 0.1):
        self.path = Path(path)
        self.flush_s = flush_s
        """Longest time an event waits in memory before it reaches events.jsonl (0: none)."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / SUMMARY).unlink(missing_ok=True)  # the run is live (again)
        # not fsynced: events.jsonl is not either, and the 3 fsyncs would cost ~25 ms a run (~8 ms each on ext4)
        if spec is not None:
            atomic_write(self.path / SPEC, yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False),
                         durable=False)
        atomic_write(self.path / CONFIG, json.dumps(
            {"config": config, "versions": package_versions(), "argv": redacted_argv(sys.argv),
             "event_schema_version": EVENT_SCHEMA_VERSION}, indent=2, default=str), durable=False)
        self._events = _append(self.path / EVENTS)
        self._index = _append(self.path / INDEX)
        self._offset = self._events.tell()
        """Bytes in events.jsonl once the pending events are written before it: where the next write starts."""
        self._starts: dict[str, int] = {}
        """Live episode -> an offset in events.jsonl at or before its `episode_started` line."""
        self._pending: list[Event] = []
        """Events sent and not yet written."""
        self._sent = _SentSteps()
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        """The event loop a flush is scheduled on; None when none is."""
        self.errors = 0
        """Records not written as sent (altered or dropped) and writes that failed: 0 while the store is sound."""
        self.last_error: str | None = None
        """What the latest of those was."""

    def emit(self, event: Event) -> None:
        kind = type(event)
        if kind in _ACCOUNTED:
            sent = self._sent.add(event)
            if sent is not None:  # an episode ended: it is on disk when this returns (read_traces sees it)
                self._finish(event, sent)  # type: ignore[arg-type]
                return
            if kind is EpisodeStarted:  # its line goes after everything already written
                self._starts[event.episode_id] = self._offset  # type: ignore[union-attr]
        self._pending.append(event)
        if self._flush_loop is not None and not self._flush_loop.is_closed():
            return  # a flush is already scheduled (the common case: no loop lookup per event)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop: no timer to flush later
            loop = None
        if loop is None or self.flush_s <= 0:
            self._write()
        else:
            self._flush_loop = loop
            loop.call_later(self.flush_s, self._timed_flush)

    def flush(self) -> None:
        """Write the events sent so far to events.jsonl now."""
        if not self._events.closed:
            self._write()

    def close(self, summary: dict[str, Any]) -> None:
        if not self._events.closed:
            self._write()
            self._events.close()
            self._index.close()
        atomic_write(self.path / SUMMARY, json.dumps(summary, indent=2, default=str), durable=False)

    def _finish(self, event: EpisodeFinished, sent: list[Step]) -> None:
        """Write an episode's last line, then its line in the index (so a reader of both finds the first first)."""
        trace = event.trace
        start = self._starts.pop(trace.episode_id, self._offset)
        try:
            last = _finished_line(event, sent)
        except ValueError as exc:  # the whole trace, repaired (a reader takes a line without "steps" as whole)
            last = self._repaired(event, exc)
        self._write(last)
        try:
            self._index.write(index_line(trace, start, self._offset, time.time()))
            self._index.flush()
        except (OSError, ValueError) as exc:
            self._failed(f"writing {INDEX}", exc)

    def _write(self, last: bytes = b"") -> None:
        """Serialise the pending events, then `last`, onto events.jsonl, and push them to the file. A record that
        cannot be serialised or a failed write is recorded (`errors`), never raised: the next write goes on."""
        pending, self._pending = self._pending, []
        try:
            data = b"".join(map(_line, pending))
        except ValueError:  # an event pydantic cannot serialise (PydanticSerializationError): one by one
            data = b"".join(map(self._line_or_repaired, pending))
        self._offset += len(data) + len(last)
        try:
            self._events.write(data)
            self._events.write(last)
            self._events.flush()
        except (OSError, ValueError) as exc:  # a full disk, a closed file: these lines are lost, later ones are not
            self._failed(f"writing {len(data) + len(last)} bytes to events.jsonl", exc)

    def _line_or_repaired(self, event: Event) -> bytes:
        try:
            return _line(event)
        except ValueError as exc:
            return self._repaired(event, exc)

    def _repaired(self, event: Event, exc: ValueError) -> bytes:
        """The line of an event pydantic could not serialise (`exc`): through json, lone surrogates replaced by
        U+FFFD; b"" (the event dropped) when even that fails. Either way counted as an error."""
        kind = getattr(event, "kind", type(event).__name__)
        try:
            text = json.dumps({"v": EVENT_SCHEMA_VERSION, **event.model_dump(mode="json")}, ensure_ascii=False)
            line = _scrub(text).encode() + b"\n"
        except (TypeError, ValueError) as again:
            self._failed(f"dropped event {kind}: it cannot be serialised", again)
            return b""
        self._failed(f"wrote event {kind} with its lone surrogates replaced by U+FFFD", exc)
        return line

    def _failed(self, what: str, cause: BaseException | str) -> None:
        """Count and log a failure (an error line in the log of whatever process runs the store)."""
        self.errors += 1
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        self.last_error = f"{what}: {reason}"
        _log.error("run store %s: %s (%d errors so far)", self.path, self.last_error, self.errors)

    def _timed_flush(self) -> None:
        self._flush_loop = None
        self.flush()


"""The run directory's episode index: one line per finished episode (see `index_line`)."""


def index_line(trace: Trace, start: int, end: int, ended: float) -> bytes:
    """An episode's line in episodes.jsonl: its table row, a digest of its steps and the byte range of events.jsonl
    that holds its lines, so a watcher opens a run of 100k episodes without parsing every step line and reads one
    episode back without scanning the file. `correct` is the task's verdict recorded with the reward
    (`Task.correct`; None when no task scored the episode). `steps` holds [node, route, flag (0 ok, 1 parse error,
    2 error), completion tokens, seconds, source nodes] per step; `eval`, only on a training run's evaluation
    episode, the step it evaluated. A cache: events.jsonl stays the record."""
    steps, tokens = [], 0
    for s in trace.steps:
        tok = sum(c.n_completion for c in s.llm) if s.llm else 0
        tokens += tok
        steps.append((s.node, s.route, step_flag(s.error, s.parse_error), tok, round(s.duration_s, 4), s.sources))
    line = (json.dumps({
        "id": trace.episode_id, "item": trace.item_id, "query": trace.query[:_CLIP], "status": trace.status,
        "reward": trace.reward, "correct": trace.meta.get("correct"),
        "answer": None if trace.answer is None else trace.answer[:_CLIP],
        "error": None if trace.error is None else trace.error[:_CLIP], "tokens": tokens, "turns": trace.turns,
        "duration_s": round(trace.duration_s, 4), "ended": round(ended, 3), "start": start, "end": end,
        "steps": steps, **({"eval": trace.meta[EVALUATION]} if EVALUATION in trace.meta else {})},
        ensure_ascii=False, separators=(",", ":")) + "\n")
    try:
        return line.encode()
    except UnicodeEncodeError:  # a lone surrogate in the query or answer
        return _scrub(line).encode()


def step_flag(error: str | None, parse_error: str | None) -> int:
    """A step's outcome in an index line: 0 ok, 1 parse error (the node used its fallback), 2 failed."""
    return 2 if error is not None else 1 if parse_error is not None else 0


_CLIP = 200
"""Characters of the query, answer and error an index line keeps (the full texts are in events.jsonl)."""


def _finished_line(event: EpisodeFinished, sent: list[Step]) -> bytes:
    """The trace without its steps when they are exactly the steps sent (so already in step lines), else whole."""
    trace = event.trace
    if len(sent) != len(trace.steps) or not all(map(operator.is_, sent, trace.steps)):
        return _line(event)
    body = trace.__pydantic_serializer__.to_json(trace, exclude={"steps"})
    return b'{"v":%d,"kind":"episode_finished","steps":%d,"trace":%s}\n' % (EVENT_SCHEMA_VERSION, len(sent), body)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _scrub(text: str) -> str:
    """`text` with its lone UTF-16 surrogates (which UTF-8, so a JSON file, cannot hold) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def _line(event: Event) -> bytes:
    # bytes straight from pydantic's serializer: model_dump_json() would decode them and the file encode them back
    return b'{"v":%d,%s\n' % (EVENT_SCHEMA_VERSION, event.__pydantic_serializer__.to_json(event)[1:])


def _append(file: Path):
    """`file` opened to append whole lines: a killed run left half a line? end it, or the first new line would be
    glued onto it."""
    cut = _is_cut(file)
    f = open(file, "ab")  # noqa: SIM115 (open for the run's life; closed by RunStore.close())
    if cut:
        f.write(b"\n")
    return f


def _is_cut(file: Path) -> bool:
    """Whether a file ends in half a line (its writer was killed mid-write)."""
    if not file.exists() or file.stat().st_size == 0:
        return False
    with open(file, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
