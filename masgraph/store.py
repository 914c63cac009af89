"""The run directory: spec snapshot, resolved config, append-only events.jsonl and a results summary."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import yaml

from masgraph.spec import GraphSpec
from masgraph.trace import EVENT_SCHEMA_VERSION, EpisodeFinished, Event, StepFinished, Trace

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
    raise RuntimeError(f"cannot create a run directory under {root}")


class RunStore:
    """A sink that writes one run directory. Episode start and end events are appended to events.jsonl
    and the file is flushed when an episode ends, so it is readable while the run is going; the
    `episode_finished` line holds the whole trace (every step), which is what readers take.

    Example:
        >>> store = RunStore(new_run_dir("/tmp/masgraph-doc", "demo"), spec=None, config={"n": 1})
        >>> store.close({"accuracy": 1.0}); (store.path / "summary.json").exists()
        True
    """

    def __init__(self, path: str | Path, spec: GraphSpec | None, config: dict[str, Any]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if spec is not None:
            _atomic_write(self.path / "spec.yaml", yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        _atomic_write(self.path / "config.json", json.dumps(
            {"config": config, "versions": package_versions(), "argv": sys.argv,
             "event_schema_version": EVENT_SCHEMA_VERSION}, indent=2, default=str))
        events = self.path / "events.jsonl"
        cut = _is_cut(events)
        self._events = open(events, "a", encoding="utf-8", newline="\n")
        if cut:  # a killed run left half a line: end it, or the first new event would be glued onto it
            self._events.write("\n")

    def emit(self, event: Event) -> None:
        if isinstance(event, StepFinished):
            return  # steps are in the finished episode's trace; writing them twice costs ~25% of a step
        self._events.write(_line(event))
        if isinstance(event, EpisodeFinished):
            self._events.flush()

    def close(self, summary: dict[str, Any]) -> None:
        if not self._events.closed:
            self._events.close()
        _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2, default=str))


def read_traces(path: str | Path, bad_lines: list[int] | None = None) -> Iterator[Trace]:
    """Finished episodes of a run directory (or an events.jsonl file), in the order they ended. A line that is
    not a valid event (one cut by a killed run) is skipped and its 1-based number appended to `bad_lines`.
    A run directory whose events.jsonl does not exist yet (the run is starting) has no traces."""
    path = Path(path)
    if path.is_dir():
        path = path / "events.jsonl"
        if not path.exists():
            return
    for number, rec in _numbered_records(path):
        if rec is not None and rec.get("kind") != "episode_finished":
            continue
        trace = _trace(rec)
        if trace is not None:
            yield trace
        elif bad_lines is not None:
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


def _numbered_records(file: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, JSON object or None when the line is not one), splitting on b"\\n" only: model text may hold
    U+2028 or U+0085, which str.splitlines also splits on."""
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return  # a line still being written
            try:
                rec = json.loads(raw)
            except ValueError:  # also UnicodeDecodeError
                rec = None
            yield number, rec if isinstance(rec, dict) else None


def _trace(rec: dict[str, Any] | None) -> Trace | None:
    try:
        return Trace.model_validate(rec["trace"]) if rec is not None else None
    except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def _is_cut(file: Path) -> bool:
    """Whether a file ends in half a line (its writer was killed mid-write)."""
    if not file.exists() or file.stat().st_size == 0:
        return False
    with open(file, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _line(event: Event) -> str:
    return '{"v":%d,%s\n' % (EVENT_SCHEMA_VERSION, event.model_dump_json()[1:])


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
