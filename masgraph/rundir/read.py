"""Readers of a run directory: finished traces (`read_traces`), a run followed live from another process
(`follow`), and bounded, crash-tolerant reading for a viewer that polls a run (`Lines`: new whole lines of a
growing file in bounded chunks; `read_small` / `read_json` / `read_spec_outline`: small files, size-capped;
`open_regular`: never blocks on a FIFO). A cut last line is left out everywhere, and every JSON line or file of a
run directory is parsed by `parse_json`."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

from masgraph.errors import MasgraphError, SpecError
from masgraph.events import (
    EVENT,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    StepFinished,
)
from masgraph.rundir.layout import EVENTS, SUMMARY
from masgraph.trace import Step, Trace
from masgraph.yaml_read import read_yaml


def parse_json(raw: bytes | str) -> Any:
    """json.loads for what a run directory holds (anything may have written it): a value nested deeper than the
    parser recurses (a line of 100k `[`: RecursionError) is a ValueError like any other bad JSON, so each reader
    treats it as it treats a cut line."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None


def follow(path: str | Path, poll_s: float = 0.1, stop: threading.Event | None = None,
           bad_lines: list[int] | None = None) -> Iterator[Event]:
    """The events of a run directory as they are appended, from its first line, until the run ends (its
    summary.json appears; every line written before it is yielded first) or `stop` is set (breaking out of the
    loop also ends it). For a watcher in another process than the run's. A line is yielded once its newline is
    written; an `episode_finished` event carries the whole trace; a line that is not a valid event is skipped
    and its 1-based number appended to `bad_lines`, as is a last line the run ended without finishing.

    Example:
        >>> for event in follow("runs/agentflow-20261122-104500"):
        ...     if isinstance(event, StepFinished):
        ...         print(event.step.episode_id, event.step.node, event.step.text[:40])
    """
    run_dir = Path(path)
    if run_dir.is_file():  # the events.jsonl itself
        run_dir = run_dir.parent
    if not run_dir.is_dir():
        raise MasgraphError(f"no run directory at {run_dir}: pass the directory a run prints when it starts "
                            "(runs/<graph>-<date>-<time>, which holds events.jsonl)")
    events, summary = run_dir / EVENTS, run_dir / SUMMARY
    stop = stop or threading.Event()
    parse = Parser()
    file = None
    partial, number = b"", 0
    try:
        while not stop.is_set():
            ended = summary.exists()  # checked first, so every line written before summary.json is read below
            if file is None and events.exists():
                file = open(events, "rb")  # noqa: SIM115 (open while the generator lives; closed below)
            while file is not None and (chunk := file.read(_CHUNK)):
                *lines, partial = (partial + chunk).split(b"\n")
                for raw in lines:
                    number += 1
                    event = parse(raw)
                    if event is not None:
                        yield event
                    elif bad_lines is not None:
                        bad_lines.append(number)
                if stop.is_set():
                    return
            if ended:
                if partial and bad_lines is not None:
                    bad_lines.append(number + 1)
                return
            stop.wait(poll_s)
    finally:
        if file is not None:
            file.close()


def read_traces(path: str | Path, bad_lines: list[int] | None = None) -> Iterator[Trace]:
    """Finished episodes of a run directory (or an events.jsonl file), in the order they ended. A line that is
    not a valid event (one cut by a killed run) is skipped and its 1-based number appended to `bad_lines`.
    A run directory whose events.jsonl does not exist yet (the run is starting) has no traces."""
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS
        if not path.exists():
            return
    parse = Parser()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return  # a line still being written
            event = parse(raw)
            if isinstance(event, EpisodeFinished):
                yield event.trace
            elif event is None and bad_lines is not None:
                bad_lines.append(number)


def read_jsonl(path: str | Path, bad_lines: list[int] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file (metrics.jsonl, events.jsonl). Bad lines are skipped and their numbers
    appended to `bad_lines`; a last line without its newline is still being written (or was cut) and is left out."""
    out = []
    for number, rec in _numbered_records(Path(path)):
        if rec is not None:
            out.append(rec)
        elif bad_lines is not None:
            bad_lines.append(number)
    return out


_ACCOUNTED = frozenset({EpisodeStarted, StepFinished, EpisodeFinished})
"""The event kinds `_SentSteps` keeps account of."""


class _SentSteps:
    """The steps sent per episode since it started: the writer and the readers keep the same account of the
    same lines, so where the writer leaves a trace's steps to the step lines the reader holds exactly those."""

    def __init__(self) -> None:
        self._steps: dict[str, list[Step]] = {}

    def add(self, event: Event) -> list[Step] | None:
        """Account for one event; for an `episode_finished`, the steps sent for its episode."""
        kind = type(event)
        if kind is StepFinished:
            self._steps.setdefault(event.step.episode_id, []).append(event.step)  # type: ignore[union-attr]
        elif kind is EpisodeStarted:
            self._steps[event.episode_id] = []  # type: ignore[union-attr]  # an id reused by a later run
        elif kind is EpisodeFinished:
            return self._steps.pop(event.trace.episode_id, [])  # type: ignore[union-attr]
        return None


class Parser:
    """Turns lines back into events (any schema version), giving each finished trace its steps back."""

    def __init__(self) -> None:
        self._sent = _SentSteps()

    def __call__(self, raw: bytes) -> Event | None:
        """The event of one line, or None when the line is not one (or its trace's steps were lost)."""
        try:
            rec = parse_json(raw)
            if not isinstance(rec, dict):
                return None
            rec.pop("v", None)
            n_steps = rec.pop("steps", None) if rec.get("kind") == "episode_finished" else None
            event = EVENT.validate_python(rec)
        except ValueError:  # bad JSON, bad UTF-8, or pydantic's ValidationError
            return None
        steps = self._sent.add(event)
        if n_steps is not None:
            if len(steps) != n_steps:  # a step line was cut or lost
                return None
            event.trace.steps = steps  # type: ignore[union-attr]
        return event


def _numbered_records(file: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, JSON object or None when the line is not one), splitting on b"\\n" only: model text may hold
    U+2028 or U+0085, which str.splitlines also splits on."""
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return  # a line still being written
            try:
                rec = parse_json(raw)
            except ValueError:  # also UnicodeDecodeError
                rec = None
            yield number, rec if isinstance(rec, dict) else None


_CHUNK = 1 << 20
"""Bytes `follow` reads at a time."""



CHUNK = 4 << 20
"""Bytes read from a file at a time."""


MAX_LINE = 64 << 20
"""A longer line is skipped (counted as bad) instead of being held in memory whole."""


MAX_SMALL_FILE = 16 << 20
"""config.json, spec.yaml and summary.json past this size are not read (a run writes a few KB)."""


class Lines:
    """New whole lines of a growing file, read in bounded chunks: each read returns the (offset, line) pairs of
    at most `max_bytes` more bytes. A line longer than MAX_LINE is dropped as it is read (counted in `too_long`)."""

    def __init__(self, path: Path):
        self.path = path
        self.pos = 0
        """The next byte to read."""
        self.behind = False
        """Whether the file held more bytes than the last read took."""
        self.too_long = 0
        self._partial = bytearray()
        """The bytes of the line being read, up to `pos` (empty while skipping a line that is too long)."""
        self._skipping = False

    def seek(self, offset: int) -> None:
        """Read on from `offset` (the start of a line)."""
        self.pos, self._partial, self._skipping = offset, bytearray(), False

    def read(self, max_bytes: int = CHUNK) -> list[tuple[int, bytes]]:
        f = open_regular(self.path)
        if f is None:
            self.behind = False
            return []
        with f:
            size = os.fstat(f.fileno()).st_size
            f.seek(self.pos)
            data = f.read(max(0, min(max_bytes, size - self.pos)))  # read(n) allocates n bytes first
            self.behind = size > self.pos + len(data)
        start, self.pos = self.pos, self.pos + len(data)  # `start`: the offset of data[0]
        if self._skipping:
            nl = data.find(b"\n")
            if nl < 0:
                return []
            data, start, self._skipping = data[nl + 1:], start + nl + 1, False
        nl = data.find(b"\n")
        if nl < 0:
            self._keep(data)
            return []
        out = []
        line_start = start - len(self._partial)
        self._partial += data[:nl]
        if len(self._partial) > MAX_LINE:
            self.too_long += 1
        else:
            out.append((line_start, bytes(self._partial)))
        at = nl + 1
        while (nl := data.find(b"\n", at)) >= 0:
            if nl - at > MAX_LINE:  # (only when a chunk is larger than MAX_LINE)
                self.too_long += 1
            else:
                out.append((start + at, data[at:nl]))
            at = nl + 1
        self._partial = bytearray()
        self._keep(data[at:])
        return out

    def _keep(self, piece: bytes) -> None:
        """Add the start of a line to the line being read, or drop the line when that makes it too long."""
        if len(self._partial) + len(piece) > MAX_LINE:
            self._partial, self._skipping = bytearray(), True
            self.too_long += 1
        else:
            self._partial += piece

    @property
    def cut(self) -> bool:
        """Whether bytes without a newline follow the last line read (a line being written, or cut)."""
        return bool(self._partial) or self._skipping


class Budget:
    """Bytes a poll may still read (None: no limit)."""

    def __init__(self, max_bytes: int | None):
        self.left = max_bytes

    def chunk(self) -> int:
        return CHUNK if self.left is None else min(CHUNK, self.left)

    def spend(self, lines: Lines, before: int) -> None:
        if self.left is not None:
            self.left -= lines.pos - before


def open_regular(path: Path) -> BinaryIO | None:
    """`path` opened for binary reading if it is a regular file; None when it does not exist (yet); a MasgraphError
    for anything else: a FIFO (opened without blocking, never read), a directory, a device, a symlink loop, a file
    that cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise MasgraphError(f"cannot read {path}: {exc.strerror or exc}") from None
    kind = _not_regular(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        raise MasgraphError(f"{path} is {kind}, not a regular file: a run writes its files as regular files; "
                            "move it away or watch another run directory")
    return os.fdopen(fd, "rb")


def check_regular(path: Path) -> None:
    """open_regular's check without opening: nothing when `path` is a regular file or does not exist."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise MasgraphError(f"cannot read {path}: {exc.strerror or exc}") from None
    kind = _not_regular(mode)
    if kind:
        raise MasgraphError(f"{path} is {kind}, not a regular file: a run writes its files as regular files; "
                            "move it away or watch another run directory")


def _not_regular(mode: int) -> str:
    """What a file of this mode is when it is not a regular file ('' when it is)."""
    if stat.S_ISREG(mode):
        return ""
    kinds = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISDIR: "a directory", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def read_small(path: Path) -> bytes | None:
    """A small file's bytes (None when missing or past MAX_SMALL_FILE); MasgraphError when not a regular file."""
    f = open_regular(path)
    if f is None:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        return f.read(size) if size <= MAX_SMALL_FILE else None  # read(n) allocates n bytes first: n = its size


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        rec = parse_json(read_small(path) or b"")
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def read_spec_outline(path: Path) -> tuple[SimpleNamespace | None, str]:
    """The graph of a run's spec.yaml, as much of it as the views draw (name, nodes, edges, entry, exit, policies),
    and '', or None and why not when it is unreadable (missing: no reason), the views then showing the nodes that
    steps name. Read with the graph loader's bounded YAML reader (aliases, depth, UTF-8 checked)."""
    try:
        data = read_small(path)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    if data is None:
        return None, f"larger than {MAX_SMALL_FILE >> 20} MiB" if path.exists() else ""
    try:
        raw = read_yaml(data, path.name)
        nodes = {str(k): SimpleNamespace(role=str((v or {}).get("role", "?")),
                                         policy=_or_none((v or {}).get("policy"), str))
                 for k, v in raw["nodes"].items()}
        edges = [SimpleNamespace(source=str(e["source"]), target=str(e["target"]), when=e.get("when"))
                 for e in raw.get("edges") or []]
        edges = [e for e in edges if e.source in nodes and e.target in nodes]
        entry = str(raw.get("entry"))
        return SimpleNamespace(name=str(raw.get("name", "?")), nodes=nodes, edges=edges,
                               entry=entry if entry in nodes else next(iter(nodes)), exit=str(raw.get("exit") or ""),
                               policies=_or_none(raw.get("policies"), dict) or {},
                               topology=raw.get("topology")), ""
    except SpecError as exc:
        first = exc.problems[0]
        return None, first.message + (f", line {first.line}" if first.line else "")
    except (KeyError, TypeError, AttributeError, StopIteration):
        return None, "not a graph spec with `nodes:`"


def _or_none(v: Any, kind: type) -> Any:
    return v if isinstance(v, kind) else None
