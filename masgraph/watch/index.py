"""What a watcher knows of a run directory, read incrementally from its files (no Textual here).

Rows come from the episode index (episodes.jsonl, one line per finished episode; masgraph/store.py), so a run of
100k episodes opens without parsing its step lines; events.jsonl is read only from where the index ends, for the
episodes still running (their steps so far, the nodes active now). A run dir written before the index existed
(event schema < 3) is read from events.jsonl alone. metrics.jsonl gives the training curves and
checkpoints/step-N/state.json the checkpoints. Every file may be cut or half-written: bad lines are counted
and reported in `warnings`, never raised.

Memory stays bounded whatever the files' sizes: files are read in chunks of at most CHUNK bytes (a line over
MAX_LINE is skipped as bad), the table keeps the last MAX_ROWS episodes (counts cover all of them), and an
episode's trace is read back from its byte range only when it is opened. Only regular files are read: a FIFO,
a directory or a symlink loop where a run file should be is a MasgraphError (a FIFO would block the reader).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

from masgraph.errors import MasgraphError
from masgraph.metric_keys import canonical, topology_key
from masgraph.rundir.checkpoint import checkpoint_states
from masgraph.rundir.layout import CHECKPOINTS, CONFIG, EVENTS, METRICS, SPEC, SUMMARY, is_run_dir
from masgraph.rundir.read import (
    CHUNK,
    MAX_LINE,
    Budget,
    Lines,
    check_regular,
    open_regular,
    parse_json,
    read_json,
    read_spec_outline,
)
from masgraph.rundir.store import INDEX, Parser, step_flag
from masgraph.trace import Trace, full_reward

RUN_FILES = (EVENTS, INDEX, METRICS, CONFIG, SPEC, SUMMARY)
"""The files of a run directory a watcher reads (each must be a regular file when it exists)."""


MAX_ROWS = 100_000


MAX_CREDITED = 20_000
"""Training runs: how many episodes' per-call advantages the index keeps (the newest)."""
"""Episodes the table keeps (the last ones); older rows are dropped, their counts kept."""


ROW_TEXT = 200
"""Characters of an episode's item, query, answer and error a row keeps (as index lines do; the trace has all)."""


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
    verdict: bool | None = None
    """The task's verdict recorded with the reward (`Task.correct`); None in runs from before it was recorded."""
    failure: str | None = None
    """How the episode failed (runner.FAILURE_KINDS), None when it finished cleanly."""
    evaluation: int | None = None
    """A training run's held-out evaluation episode: the step it evaluated (None: a rollout or a run's episode)."""

    @property
    def correct(self) -> bool:
        """The task's verdict, as `masgraph run` counts it (tasks.is_correct): the recorded one, else full reward."""
        if self.status != "ok":
            return False
        return self.verdict if self.verdict is not None else full_reward(self.reward)

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


class RunIndex:
    """A run directory as a watcher sees it; `poll()` reads what was appended since the last call.

    Example:
        >>> index = RunIndex("runs/agentflow-20261123-104500"); index.poll()
        >>> len(index.rows), index.node_stats()["planner"].calls
    """

    def __init__(self, run_dir: str | Path):
        path = Path(run_dir)
        if path.is_file() and path.name in (EVENTS, INDEX, METRICS):
            path = path.parent
        if not path.is_dir():
            raise MasgraphError(f"no run directory at {path}: pass the directory a run prints when it starts "
                                "(runs/<graph>-<date>-<time>, which holds events.jsonl)")
        for name in RUN_FILES:  # up front: a FIFO would block the reader, a directory or a loop fail it later
            check_regular(path / name)
        if not is_run_dir(path):
            raise MasgraphError(f"{path} is not a run directory: it has no events.jsonl, config.json or metrics.jsonl")
        self.path = path
        self.notes: list[str] = []
        """Problems with whole files (an unreadable spec.yaml or config.json), shown with the warnings."""
        self.config = self._read_config()
        self.spec = self.read_spec_outline()
        version = self.config.get("event_schema_version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise MasgraphError(f"{path / 'config.json'}: event_schema_version is {_short(version)}, not a whole "
                                "number, so the format of the run's files is unknown; is this a masgraph run "
                                "directory (its config.json edited or damaged)?")
        self.indexed = version >= 3 or (path / INDEX).exists()
        """Rows come from episodes.jsonl (else from events.jsonl's episode lines)."""
        self.rows: list[Row] = []
        """The last MAX_ROWS (up to 10 % more) finished episodes, in finishing order."""
        self.credits: dict[str, dict[tuple[int, int], float]] = {}
        """Training runs: episode id -> (step index, call index) -> the advantage its update used (`credit` lines;
        the newest MAX_CREDITED episodes' kept)."""
        self.counterfactuals: dict[str, dict[tuple[int, int], list[tuple[str, float]]]] = {}
        """Training runs with counterfactual credit: episode id -> (step index, call index) -> each alternative
        scored in that call's place and the episode's score with it (`credit` lines; kept like `credits`)."""
        self.n_done = 0
        """Finished episodes, those dropped from `rows` included."""
        self.n_correct = 0
        self.failures: Counter[str] = Counter()
        """Failure kind (timeout, error, cancelled, parse: as summary.json's `failures`) -> finished episodes."""
        self.nodes: dict[str, NodeStats] = {n: NodeStats() for n in (self.spec.nodes if self.spec else {})}
        """Counts over finished episodes (node_stats() adds the running ones)."""
        self.edges: Counter[tuple[str, str]] = Counter()
        """(source, target) -> times a step of target received source's output, over finished episodes."""
        self.live: dict[str, _Live] = {}
        self.metrics: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self.bad_lines: Counter[str] = Counter()
        """File name -> lines that were not valid JSON objects of the expected shape (a cut or corrupt file)."""
        self._index = Lines(path / INDEX)
        self._events = Lines(path / EVENTS)
        self._metrics = Lines(path / METRICS)
        self._events_started = False
        self._indexed_end = 0
        """Where the last indexed episode's lines end in events.jsonl, evaluation episodes left out: a training
        run's evaluation follows its step's credit lines, which the episode view shows."""
        self._ckpt_mtime = 0.0

    # -- reading -----------------------------------------------------------------------------------------------

    def poll(self, max_bytes: int | None = None) -> bool:
        """Read what the run appended since the last poll, at most about `max_bytes` of it (None: all, in chunks;
        a watcher passes a budget so that it stays responsive while it catches up with a large run: see
        `caught_up`); whether anything changed."""
        before = self._state()
        budget = Budget(max_bytes)
        summary_exists = (self.path / SUMMARY).exists()  # first: every line written before it is read below
        if self.indexed and not self._events_started:
            self._drain(self._index, self._index_lines, budget)
            if self._index.behind:
                return self._state() != before
            self._events.seek(self._indexed_end)  # where the index ends, the events of the running episodes begin
        self._events_started = True
        self._drain(self._events, self._event_lines, budget)
        if self.indexed:  # after the events: an episode_finished line read above has its index line by now
            self._drain(self._index, self._index_lines, budget)
        self._drain(self._metrics, self._metric_lines, budget)
        self._read_checkpoints()
        if summary_exists and self.summary is None and self.caught_up:
            self.summary = read_json(self.path / SUMMARY) or {}
        return self._state() != before

    @property
    def caught_up(self) -> bool:
        """Whether the last poll read every file to its end."""
        return self._events_started and not any(f.behind for f in (self._index, self._events, self._metrics))

    def _drain(self, lines: Lines, handle: Any, budget: Budget) -> None:
        """Hand `lines`' new lines to `handle` a chunk at a time, until its end or the budget is spent."""
        while budget.left is None or budget.left > 0:
            before, too_long = lines.pos, lines.too_long
            handle(lines.read(budget.chunk()))
            budget.spend(lines, before)
            if lines.too_long > too_long:
                self.bad_lines[lines.path.name] += lines.too_long - too_long
            if not lines.behind:
                break

    def _index_lines(self, lines: list[tuple[int, bytes]]) -> None:
        for _, raw in lines:
            try:
                self._add_row(_loads(raw))
            except (TypeError, KeyError, IndexError, ValueError, OverflowError):
                self.bad_lines[INDEX] += 1

    def _event_lines(self, lines: list[tuple[int, bytes]]) -> None:
        done, done_ends = _done_within(lines) if self.indexed else (set(), set())
        for off, raw in lines:
            if done and (off in done_ends or _episode_of(raw) in done):
                continue  # started and finished within this read: its index line has all a view needs
            rec = _loads(raw)
            if rec is None:
                self.bad_lines[EVENTS] += 1
                continue
            try:
                self._event(rec, off, off + len(raw) + 1)
            except (TypeError, KeyError, IndexError, ValueError, AttributeError, OverflowError):
                self.bad_lines[EVENTS] += 1

    def _metric_lines(self, lines: list[tuple[int, bytes]]) -> None:
        for _, raw in lines:
            rec = _metric(_loads(raw))
            if rec is None:
                self.bad_lines[METRICS] += 1
            else:
                self.metrics.append(canonical(rec))  # a run written under the former metric names too

    def _event(self, rec: dict[str, Any], off: int, end: int) -> None:
        kind = rec.get("kind")
        if kind == "episode_started":
            self.live[_str(rec["episode_id"])] = _Live(start=off)
        elif kind == "step_started":
            self._live(_str(rec["episode_id"]), off).active[(_str(rec["node"]), rec["turn"])] = rec.get("started", 0.0)
        elif kind == "step":
            step = rec["step"]
            digest = _digest(step)
            live = self._live(_str(step["episode_id"]), off)
            live.active.pop((step["node"], step["turn"]), None)
            live.digest.append(digest)
        elif kind == "credit":
            episode = _str(rec["episode_id"])
            self.credits[episode] = {(int(s), int(c)): float(a) for s, c, a in rec["calls"]}
            scored: dict[tuple[int, int], list[tuple[str, float]]] = {}
            for s, c, alternative, score in rec.get("counterfactual", []):
                scored.setdefault((int(s), int(c)), []).append((str(alternative), float(score)))
            if scored:
                self.counterfactuals[episode] = scored
            if len(self.credits) > MAX_CREDITED:
                oldest = next(iter(self.credits))
                del self.credits[oldest]
                self.counterfactuals.pop(oldest, None)
        elif kind == "episode_finished":
            trace = rec["trace"]
            live = self.live.pop(_str(trace["episode_id"]), None)
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

    def _add_row(self, rec: Any) -> None:
        """Count one finished episode (its index line's fields) and keep its row; ValueError (nothing counted)
        when a field is missing or of the wrong type."""
        row, steps = _row(rec, self.n_done)
        for s in steps:
            stats = self.nodes.get(s[0])
            if stats is None:
                stats = self.nodes[s[0]] = NodeStats()
            stats.add(s)
            for src in s[5]:
                self.edges[(src, s[0])] += 1
        self.rows.append(row)
        self.n_done += 1
        self.n_correct += row.correct
        if row.failure:
            self.failures[row.failure] += 1
        if row.evaluation is None:
            self._indexed_end = max(self._indexed_end, row.end)
        if len(self.rows) > MAX_ROWS + MAX_ROWS // 10:  # dropped in batches: amortised O(1) a row
            del self.rows[:len(self.rows) - MAX_ROWS]

    def _read_checkpoints(self) -> None:
        try:
            mtime = (self.path / CHECKPOINTS).stat().st_mtime
        except OSError:  # none yet (or not readable: none listed)
            return
        if mtime != self._ckpt_mtime:
            self._ckpt_mtime = mtime
            self.checkpoints = checkpoint_states(self.path)

    def _read_config(self) -> dict[str, Any]:
        """config.json as a mapping ({} when missing or unreadable, with a note)."""
        path = self.path / CONFIG
        config = read_json(path)
        if config is None and path.exists():
            self.notes.append("config.json is not a readable JSON object: read as empty")
        return config or {}

    def read_spec_outline(self) -> SimpleNamespace | None:
        spec, problem = read_spec_outline(self.path / SPEC)
        if problem:
            self.notes.append(f"spec.yaml not used ({problem}): nodes as the steps name them")
        return spec

    def _state(self) -> tuple[Any, ...]:
        """What a poll may change that the views show."""
        live = len(self.live), sum(len(v.digest) + len(v.active) for v in self.live.values())
        return self.n_done, len(self.metrics), live, self.summary is not None

    # -- views -------------------------------------------------------------------------------------------------

    @property
    def is_training(self) -> bool:
        return bool(self.metrics) or isinstance(self.train_config, dict)

    @property
    def train_config(self) -> dict[str, Any] | None:
        """The `train` section of the run's config.json (None for a plain run, or one not written as a mapping)."""
        run = self.config.get("config")
        train = run.get("train") if isinstance(run, dict) else None
        return train if isinstance(train, dict) else None

    @property
    def ended(self) -> bool:
        return self.summary is not None

    @property
    def n_scored(self) -> int:
        """Episodes that ended (not cancelled): the denominator of accuracy, as summary.json's `episodes`."""
        return self.n_done - self.failures["cancelled"]

    @property
    def n_finished(self) -> int:
        """Episodes that ended with an answer (no timeout, error or cancel): the denominator of
        `accuracy_finished`, so an infrastructure failure is not read as a wrong answer."""
        return self.n_done - sum(self.failures[k] for k in ("timeout", "error", "cancelled"))

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
                parsed = topology_key(key)
                if parsed is not None and parsed.kind is None:
                    probs.setdefault(parsed.decision, {})[parsed.option] = float(value)
            if probs:
                return probs
        return {}

    @property
    def warnings(self) -> list[str]:
        out = [f"{name}: {n:,} bad line{'s' if n > 1 else ''} skipped (cut or corrupt)"
               for name, n in sorted(self.bad_lines.items())] + self.notes
        if self.ended and self._events.cut:
            out.append("events.jsonl ends in half a line (the run was killed while writing it)")
        if not (self.path / EVENTS).exists() and not self.metrics:
            out.append("no events.jsonl yet: waiting for the run to write")
        return out

    def trace(self, row: Row) -> Trace | None:
        """The whole trace of one finished episode, read back from its byte range of events.jsonl (streamed: only
        the episode's own lines are held)."""
        tag = b'"episode_id":' + json.dumps(row.id, ensure_ascii=False).encode()  # as the store writes it (UTF-8)
        try:
            f = open_regular(self.path / EVENTS)
            if f is None:
                return None
            with f:
                return (_trace_in(_lines_in(f, row.start, row.end, tag), row.id)
                        or _trace_in(_lines_in(f, row.start, row.end), row.id))  # else: an id written with escapes
        except (OSError, MasgraphError):
            return None


def _lines_in(f: BinaryIO, start: int, end: int, tag: bytes | None = None) -> Iterator[bytes]:
    """The lines of `f` that start within [start, end) (those holding `tag`, when given), a line at a time; a line
    over MAX_LINE is skipped."""
    f.seek(start)
    while f.tell() < end:
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE:  # skip the rest of it
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(CHUNK)
            continue
        if tag is None or tag in raw:
            yield raw.rstrip(b"\n")


def _trace_in(lines: Iterator[bytes], episode_id: str) -> Trace | None:
    """The last trace of `episode_id` that these lines rebuild."""
    parse, found = Parser(), None
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
    """A step's digest from its JSON (as store.index_line writes it from a Step); ValueError when malformed."""
    tokens = sum(len(c.get("completion_ids") or ()) if c.get("completion_tokens") is None else c["completion_tokens"]
                 for c in step.get("llm") or ())  # as LLMCall.n_completion counts
    digest = [step["node"], step.get("route"), step_flag(step.get("error"), step.get("parse_error")), tokens,
              round(float(step.get("duration_s") or 0.0), 4), list(step.get("sources") or ())]
    if not _is_digest(digest):
        raise ValueError("a malformed step")
    return digest


def _is_digest(s: Any) -> bool:
    """Whether `s` is a step digest: [node, route, flag 0|1|2, tokens, seconds, [source nodes]]."""
    return (isinstance(s, list) and len(s) == 6 and isinstance(s[0], str) and s[2] in (0, 1, 2)
            and _is_number(s[3]) and _is_number(s[4]) and isinstance(s[5], list)
            and all(isinstance(x, str) for x in s[5]))


def _row(rec: Any, seq: int) -> tuple[Row, list[list[Any]]]:
    """The row and step digests of an index line's fields; ValueError (or KeyError) when they are not as
    store.index_line writes them (a view would fail on them later)."""
    steps = rec["steps"]
    if not (isinstance(steps, list) and all(_is_digest(s) for s in steps)):
        raise ValueError("malformed steps")
    failed = tuple(dict.fromkeys(s[0] for s in steps if s[2]))
    verdict = rec.get("correct")
    row = Row(_str(rec["id"]), _text(rec["item"]), _text(rec["query"]), _str(rec["status"]),
              _number(rec["reward"], none=True), _text(rec["answer"], none=True), _text(rec["error"], none=True),
              int(_number(rec["tokens"])), int(_number(rec["turns"])), float(_number(rec["duration_s"])),
              float(_number(rec.get("ended"), none=True) or 0.0), int(_number(rec["start"])),
              int(_number(rec["end"])), failed, seq, verdict if isinstance(verdict, bool) else None)
    row.failure = _failure(row.status, row.error, steps)
    step = rec.get("eval")
    row.evaluation = step if isinstance(step, int) and not isinstance(step, bool) else None
    return row, steps


def _failure(status: str, error: str | None, steps: list[list[Any]]) -> str | None:
    """How an episode failed, as runner.failure_kind reads it from a trace, from its row's fields."""
    if status != "ok":
        return status
    if error is not None:
        return "error"
    return "parse" if steps and steps[-1][2] == 1 else None


def _summary(trace: dict[str, Any], digest: list[list[Any]], start: int, end: int) -> dict[str, Any]:
    """An index line's fields for an episode line of a run from before the index."""
    turns: Counter[str] = Counter(s[0] for s in digest)
    return {"id": trace["episode_id"], "item": trace["item_id"], "query": trace["query"], "status": trace["status"],
            "reward": trace.get("reward"), "correct": (trace.get("meta") or {}).get("correct"),
            "answer": trace.get("answer"), "error": trace.get("error"),
            "tokens": sum(s[3] for s in digest), "turns": max(turns.values(), default=0),
            "duration_s": trace.get("duration_s", 0.0), "ended": 0.0, "start": start, "end": end, "steps": digest}


def _loads(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = parse_json(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _metric(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A metrics line as the views read it (a whole-number `step` >= 0 and number values; nulls dropped), or None
    when it is not one (a cut line, or a value that is not a number)."""
    if rec is None or type(rec.get("step")) is not int or rec["step"] < 0:
        return None
    rec = {k: v for k, v in rec.items() if v is not None}
    return rec if all(_is_number(v) for v in rec.values()) else None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(v: Any, none: bool = False) -> Any:
    """`v` if it is a number (or None, when `none`), else ValueError; whole-number fields are int() of it
    (OverflowError for an infinite one)."""
    if _is_number(v) or (none and v is None):
        return v
    raise ValueError(f"not a number: {_short(v)}")


def _str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise ValueError(f"not a string: {_short(v)}")


def _text(v: Any, none: bool = False) -> Any:
    """A text field of a row, clipped to ROW_TEXT characters (None allowed when `none`)."""
    if none and v is None:
        return None
    return _str(v)[:ROW_TEXT]


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
