"""What a watcher knows of a run directory, read incrementally from its files (no Textual here).

Rows come from the episode index (episodes.jsonl, one line per finished episode; masgraph/store.py), so a run of
100k episodes opens without parsing its step lines; events.jsonl is read only from where the index ends, for the
episodes still running (their steps so far, the nodes active now). A run dir written before the index existed
(event schema < 3) is read from events.jsonl alone. metrics.jsonl gives the training curves and
checkpoints/step-N/state.json the checkpoints. Every file may be cut or half-written: bad lines are counted
and reported in `warnings`, never raised.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from masgraph.checkpoint import read_state
from masgraph.errors import MasgraphError
from masgraph.store import INDEX, _Parser, step_flag
from masgraph.trace import Trace


@dataclass(slots=True)
class Row:
    """One finished episode as the table shows it."""

    id: str
    item: str
    query: str
    status: str
    reward: float | None
    answer: str | None
    error: str | None
    tokens: int
    turns: int
    duration_s: float
    ended: float
    """Wall-clock time.time() when it was written (0 when unknown: runs from before the index)."""
    start: int
    end: int
    """Byte range of events.jsonl that holds every line of the episode."""
    failed_nodes: tuple[str, ...]
    """Nodes whose step failed or could not be parsed."""
    seq: int = 0
    """Position in the order episodes finished."""

    @property
    def correct(self) -> bool:
        return self.status == "ok" and self.reward is not None and self.reward >= 1.0

    @property
    def outcome(self) -> str:
        """failed (did not finish ok), correct (full reward) or wrong."""
        return "failed" if self.status != "ok" else "correct" if self.correct else "wrong"


@dataclass(slots=True)
class NodeStats:
    """Counts of one node over the steps seen so far."""

    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    parse_failures: int = 0
    errors: int = 0
    active: int = 0
    """Steps of this node started and not yet finished."""

    @property
    def mean_s(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0

    def add(self, step: list[Any] | tuple[Any, ...]) -> None:
        """Count one digest step: [node, route, flag, tokens, seconds, sources]."""
        self.calls += 1
        self.tokens += step[3]
        self.seconds += step[4]
        self.parse_failures += step[2] == 1
        self.errors += step[2] == 2


@dataclass
class _Live:
    """An episode still running: its steps so far and those started, not finished."""

    start: int
    digest: list[list[Any]] = field(default_factory=list)
    active: dict[tuple[str, int], float] = field(default_factory=dict)


class _Lines:
    """New whole lines of a growing file: each read returns (offset, line) pairs appended since the last read."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset, self._partial = path, offset, b""

    def read(self, limit: int = 1 << 30) -> list[tuple[int, bytes]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset + len(self._partial))
                data = f.read(limit)
        except FileNotFoundError:
            return []
        if not data:
            return []
        data = self._partial + data
        out, pos = [], 0
        while (nl := data.find(b"\n", pos)) >= 0:
            out.append((self.offset + pos, data[pos:nl]))
            pos = nl + 1
        self._partial = data[pos:]
        self.offset += pos
        return out

    @property
    def cut(self) -> bool:
        """Whether bytes without a newline follow the last line read (a line being written, or cut)."""
        return bool(self._partial)


class RunIndex:
    """A run directory as a watcher sees it; `poll()` reads what was appended since the last call.

    Example:
        >>> index = RunIndex("runs/agentflow-20261123-104500"); index.poll()
        >>> len(index.rows), index.node_stats()["planner"].calls
    """

    def __init__(self, run_dir: str | Path):
        path = Path(run_dir)
        if path.is_file() and path.name in ("events.jsonl", INDEX, "metrics.jsonl"):
            path = path.parent
        if not path.is_dir():
            raise MasgraphError(f"no run directory at {path}: pass the directory a run prints when it starts "
                                "(runs/<graph>-<date>-<time>, which holds events.jsonl)")
        if not any((path / f).exists() for f in ("events.jsonl", "config.json", "metrics.jsonl")):
            raise MasgraphError(f"{path} is not a run directory: it has no events.jsonl, config.json or metrics.jsonl")
        self.path = path
        self.config = _read_json(path / "config.json") or {}
        self.spec = _read_spec(path / "spec.yaml")
        version = self.config.get("event_schema_version", 0)
        self.indexed = version >= 3 or (path / INDEX).exists()
        """Rows come from episodes.jsonl (else from events.jsonl's episode lines)."""
        self.rows: list[Row] = []
        self.nodes: dict[str, NodeStats] = {n: NodeStats() for n in (self.spec.nodes if self.spec else {})}
        """Counts over finished episodes (node_stats() adds the running ones)."""
        self.edges: Counter[tuple[str, str]] = Counter()
        """(source, target) -> times a step of target received source's output, over finished episodes."""
        self.live: dict[str, _Live] = {}
        self.metrics: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self.bad_lines: Counter[str] = Counter()
        """File name -> lines that were not valid JSON objects (a cut or corrupt file)."""
        self._index = _Lines(path / INDEX)
        self._events = _Lines(path / "events.jsonl")
        self._metrics = _Lines(path / "metrics.jsonl")
        self._events_started = False
        self._ckpt_mtime = 0.0

    # -- reading -----------------------------------------------------------------------------------------------

    def poll(self) -> bool:
        """Read what the run appended since the last poll; whether anything changed."""
        n_rows, n_metrics, n_live = len(self.rows), len(self.metrics), self._live_size()
        ended = self.summary is not None
        summary_exists = (self.path / "summary.json").exists()  # first: every line written before it is read below
        if self.indexed and not self._events_started:
            self._read_index()  # where the index ends, the events of the running episodes begin
            self._events.offset = max((r.end for r in self.rows), default=0)
        self._events_started = True
        self._read_events()
        if self.indexed:
            self._read_index()  # after the events: an episode_finished line read above has its index line by now
        for _, raw in self._metrics.read():
            rec = _loads(raw)
            if rec is None or "step" not in rec:
                self.bad_lines["metrics.jsonl"] += 1
            else:
                self.metrics.append(rec)
        self._read_checkpoints()
        if summary_exists and not ended:
            self.summary = _read_json(self.path / "summary.json") or {}
        return (len(self.rows), len(self.metrics), self._live_size(), self.summary is not None) != (
            n_rows, n_metrics, n_live, ended)

    def _read_index(self) -> None:
        for _, raw in self._index.read():
            rec = _loads(raw)
            try:
                self._add_row(rec)  # type: ignore[arg-type]
            except (TypeError, KeyError, IndexError, ValueError):
                self.bad_lines[INDEX] += 1

    def _read_events(self) -> None:
        lines = self._events.read()
        done, done_ends = _done_within(lines) if self.indexed else (set(), set())
        for off, raw in lines:
            if done and (off in done_ends or _episode_of(raw) in done):
                continue  # started and finished within this read: its index line has all a view needs
            rec = _loads(raw)
            if rec is None:
                self.bad_lines["events.jsonl"] += 1
                continue
            try:
                self._event(rec, off, off + len(raw) + 1)
            except (TypeError, KeyError, IndexError, ValueError, AttributeError):
                self.bad_lines["events.jsonl"] += 1

    def _event(self, rec: dict[str, Any], off: int, end: int) -> None:
        kind = rec.get("kind")
        if kind == "episode_started":
            self.live[rec["episode_id"]] = _Live(start=off)
        elif kind == "step_started":
            self._live(rec["episode_id"], off).active[(rec["node"], rec["turn"])] = rec.get("started", 0.0)
        elif kind == "step":
            step = rec["step"]
            live = self._live(step["episode_id"], off)
            live.active.pop((step["node"], step["turn"]), None)
            live.digest.append(_digest(step))
        elif kind == "episode_finished":
            trace = rec["trace"]
            live = self.live.pop(trace["episode_id"], None)
            if not self.indexed:  # a run from before the index: the row comes from this line
                if "steps" in rec:  # the steps are the step lines sent (store.py's format)
                    digest = live.digest[len(live.digest) - rec["steps"]:] if live else []
                else:  # the whole trace
                    digest = [_digest(s) for s in trace.get("steps", [])]
                self._add_row(_summary(trace, digest, live.start if live else off, end))

    def _live(self, episode_id: str, off: int) -> _Live:
        live = self.live.get(episode_id)
        if live is None:  # its episode_started line lies before where this reader began
            live = self.live[episode_id] = _Live(start=off)
        return live

    def _add_row(self, rec: dict[str, Any]) -> None:
        steps = rec["steps"]
        failed = tuple(dict.fromkeys(s[0] for s in steps if s[2])) if any(s[2] for s in steps) else ()
        row = Row(rec["id"], rec["item"], rec["query"], rec["status"], rec["reward"], rec["answer"], rec["error"],
                  int(rec["tokens"]), int(rec["turns"]), float(rec["duration_s"]), float(rec.get("ended") or 0.0),
                  int(rec["start"]), int(rec["end"]), failed, len(self.rows))
        for s in steps:
            stats = self.nodes.get(s[0])
            if stats is None:
                stats = self.nodes[s[0]] = NodeStats()
            stats.add(s)
            for src in s[5]:
                self.edges[(src, s[0])] += 1
        self.rows.append(row)

    def _read_checkpoints(self) -> None:
        folder = self.path / "checkpoints"
        try:
            mtime = folder.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._ckpt_mtime:
            return
        self._ckpt_mtime = mtime
        found = []
        for d in folder.glob("step-*"):
            try:
                state = read_state(d)
            except MasgraphError:  # being written, or broken: not listed
                continue
            if isinstance(state.get("step"), int):
                found.append(state | {"path": str(d)})
        self.checkpoints = sorted(found, key=lambda s: s["step"])

    def _live_size(self) -> tuple[int, int]:
        return len(self.live), sum(len(v.digest) + len(v.active) for v in self.live.values())

    # -- views -------------------------------------------------------------------------------------------------

    @property
    def is_training(self) -> bool:
        return bool(self.metrics) or "train" in (self.config.get("config") or {})

    @property
    def ended(self) -> bool:
        return self.summary is not None

    def node_stats(self) -> dict[str, NodeStats]:
        """Per node: finished episodes plus the steps of running ones, and how many of its steps run now."""
        out = {n: replace(s) for n, s in self.nodes.items()}
        for live in self.live.values():
            for s in live.digest:
                out.setdefault(s[0], NodeStats()).add(s)
            for node, _ in live.active:
                out.setdefault(node, NodeStats()).active += 1
        return out

    def edge_counts(self) -> Counter[tuple[str, str]]:
        """Edge traversals over finished and running episodes."""
        out = Counter(self.edges)
        for live in self.live.values():
            for s in live.digest:
                for src in s[5]:
                    out[(src, s[0])] += 1
        return out

    def decision_probs(self) -> dict[str, dict[str, float]]:
        """A topology-learning run's current decision distributions (its last metrics row): decision -> option -> p."""
        for rec in reversed(self.metrics):
            probs: dict[str, dict[str, float]] = {}
            for key, value in rec.items():
                if key.startswith("topology/p/"):
                    decision, _, option = key[len("topology/p/"):].rpartition("/")
                    probs.setdefault(decision, {})[option] = float(value)
            if probs:
                return probs
        return {}

    @property
    def warnings(self) -> list[str]:
        out = [f"{name}: {n} bad line{'s' if n > 1 else ''} skipped (cut or corrupt)"
               for name, n in sorted(self.bad_lines.items())]
        if self.ended and self._events.cut:
            out.append("events.jsonl ends in half a line (the run was killed while writing it)")
        if not (self.path / "events.jsonl").exists() and not self.metrics:
            out.append("no events.jsonl yet: waiting for the run to write")
        return out

    def trace(self, row: Row) -> Trace | None:
        """The whole trace of one finished episode, read back from its byte range of events.jsonl."""
        try:
            with open(self.path / "events.jsonl", "rb") as f:
                f.seek(row.start)
                data = f.read(max(0, row.end - row.start))
        except OSError:
            return None
        lines = data.split(b"\n")
        tag = b'"episode_id":' + json.dumps(row.id, ensure_ascii=False).encode()  # as the store writes it (UTF-8)
        return _trace_in([raw for raw in lines if tag in raw], row.id) or _trace_in(lines, row.id)  # else: any escape


def _trace_in(lines: list[bytes], episode_id: str) -> Trace | None:
    """The last trace of `episode_id` that these lines rebuild."""
    parse, found = _Parser(), None
    for raw in lines:
        trace = getattr(parse(raw), "trace", None)
        if trace is not None and trace.episode_id == episode_id:
            found = trace
    return found


_ID_PREFIXES = tuple(b'{"v":%d,%s"episode_id":"' % (v, kind) for v in (2, 3)
                     for kind in (b"", b'"kind":"step","step":{', b'"kind":"episode_started",'))
_FINISHED = b'"kind":"episode_finished"'


def _episode_of(raw: bytes) -> bytes | None:
    """The episode id of an episode, step or call line, read off its fixed prefix without parsing the line (None
    when the line does not start as the store writes them)."""
    for prefix in _ID_PREFIXES:
        if raw.startswith(prefix):
            end = raw.find(b'"', len(prefix))
            return raw[len(prefix):end] if end > 0 and raw[end - 1:end] != b"\\" else None
    return None


def _done_within(lines: list[tuple[int, bytes]]) -> tuple[set[bytes], set[int]]:
    """Ids of the episodes that start and finish within these lines, and the offsets of their finishing lines
    (parsed here once, so the reader skips them too)."""
    started = {_episode_of(raw) for _, raw in lines if raw.startswith(_ID_PREFIXES[2]) or raw.startswith(
        _ID_PREFIXES[5])}
    finished: dict[bytes, int] = {}
    for off, raw in lines:
        if _FINISHED in raw[:40]:
            rec = _loads(raw)
            trace = rec.get("trace") if rec else None
            if isinstance(trace, dict) and isinstance(trace.get("episode_id"), str):
                finished[json.dumps(trace["episode_id"], ensure_ascii=False)[1:-1].encode()] = off
    done = started.intersection(finished)
    return done, {finished[e] for e in done}  # type: ignore[index]


def _digest(step: dict[str, Any]) -> list[Any]:
    """A step's digest from its JSON (as store.index_line writes it from a Step)."""
    tokens = sum(len(c.get("completion_ids") or ()) if c.get("completion_tokens") is None else c["completion_tokens"]
                 for c in step.get("llm") or ())  # as LLMCall.n_completion counts
    return [step["node"], step.get("route"), step_flag(step.get("error"), step.get("parse_error")), tokens,
            round(float(step.get("duration_s") or 0.0), 4), list(step.get("sources") or ())]


def _summary(trace: dict[str, Any], digest: list[list[Any]], start: int, end: int) -> dict[str, Any]:
    """An index line's fields for an episode line of a run from before the index."""
    turns: Counter[str] = Counter(s[0] for s in digest)
    return {"id": trace["episode_id"], "item": trace["item_id"], "query": trace["query"], "status": trace["status"],
            "reward": trace.get("reward"), "answer": trace.get("answer"), "error": trace.get("error"),
            "tokens": sum(s[3] for s in digest), "turns": max(turns.values(), default=0),
            "duration_s": trace.get("duration_s", 0.0), "ended": 0.0, "start": start, "end": end, "steps": digest}


def _loads(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _read_spec(path: Path) -> SimpleNamespace | None:
    """The graph of a run's spec.yaml, as much of it as the views draw (name, nodes, edges, entry, exit);
    None when it is missing or unreadable (the views then show the nodes that steps name)."""
    try:
        raw = yaml.safe_load(path.read_text())
        nodes = {str(k): SimpleNamespace(role=str((v or {}).get("role", "?")), policy=(v or {}).get("policy"))
                 for k, v in raw["nodes"].items()}
        edges = [SimpleNamespace(source=str(e["source"]), target=str(e["target"]), when=e.get("when"))
                 for e in raw.get("edges") or []]
        edges = [e for e in edges if e.source in nodes and e.target in nodes]
        entry = str(raw.get("entry") or next(iter(nodes)))
        return SimpleNamespace(name=str(raw.get("name", "?")), nodes=nodes, edges=edges, entry=entry,
                               exit=str(raw.get("exit") or ""), policies=raw.get("policies") or {},
                               topology=raw.get("topology"))
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError, StopIteration):
        return None

