"""An LLM judge as a reward and an evaluation scorer: does a response mean the same as the reference answer?

Open questions ("Who founded the company that makes X?") have answers that string checks misjudge both ways:
"contains" passes a response that lists three guesses and fails "Sept. 2, 1945" against "2 September 1945".
AgentFlow and most agent papers score them with an LLM judge; this module is that judge, for any policy: the
local model (hf), a vLLM server, or an API through litellm (`JudgeSpec.policy`).

- Its prompt is a judge prompt registered by the agents plugin (`agents/prompts/judge.txt`, the registry's
  `judge_prompts`): question, reference answers and response in, one word out ("yes" / "no").
- Its calls go into the episode's trace (`Trace.judge_calls`), apart from the graph's steps, so the episode's
  tokens and turns stay the graph's own; its verdict (text, parsed score, whether cached) in `trace.meta["judge"]`.
- Verdicts are cached on disk (SQLite, safe across processes), keyed by the judge's model and the exact messages
  it would be sent: re-scoring the same answer (a second evaluation, a repeated rollout) costs no call. With a
  sampling temperature above 0 the first verdict is kept.
- A verdict that is neither yes nor no scores 0 and says so (`meta["judge"]["unparsed"]`); a judge whose backend
  fails fails that episode's scoring (recorded as the episode's error), never the run.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from masgraph.backends.base import Request, llm_call
from masgraph.errors import MasgraphError
from masgraph.model import cache_dir
from masgraph.spec import PolicySpec, SamplingSpec
from masgraph.trace import LLMCall, Trace

__all__ = ["Judge", "JudgeSpec", "Verdict", "VerdictCache", "parse_verdict"]


def _greedy_policy() -> PolicySpec:
    return PolicySpec(sampling=SamplingSpec(temperature=0.0, max_tokens=4))


class JudgeSpec(BaseModel):
    """A task's `judge:`: which model judges, with which prompt, cached where."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    policy: PolicySpec = Field(default_factory=_greedy_policy)
    """The judging model, as a graph's policies are written (default: the embedded model, greedy, 4 tokens). An
    API: `{backend: litellm, model: openai/gpt-4o-mini}`; a server: add `api_base:`."""
    prompt: str = "judge"
    """A registered judge prompt (`agents/prompts/judge.txt` is `judge`)."""
    cache: bool = True
    """Keep verdicts on disk and reuse them for the same model and messages."""
    cache_path: str | None = None
    """The verdict cache file (default: judge-verdicts.sqlite in masgraph's cache folder, `masgraph.model.cache_dir`:
    $MASGRAPH_CACHE, else $XDG_CACHE_HOME/masgraph)."""


_VERDICT = re.compile(r"\b(yes|no|correct|incorrect|true|false|right|wrong)\b", re.I)
_POSITIVE = {"yes", "correct", "true", "right"}


def parse_verdict(text: str) -> float | None:
    """1.0 for a yes, 0.0 for a no (the first such word of the reply), None when the reply has neither."""
    m = _VERDICT.search(text)
    return None if m is None else float(m.group(1).lower() in _POSITIVE)


@dataclass(frozen=True)
class Verdict:
    """A judge's verdict on one response."""

    score: float
    """1.0: the response means the same as a reference; 0.0: it does not (or the reply said neither)."""
    text: str
    """The judge's reply."""
    cached: bool
    """Taken from the cache: no call was made."""
    call: LLMCall | None = None
    """The call made (None when cached, or when there was no response to judge)."""

    @property
    def unparsed(self) -> bool:
        return parse_verdict(self.text) is None


class VerdictCache:
    """Verdict texts by key in a SQLite file: safe for concurrent processes (SQLite's locking), written as each
    verdict arrives (a killed run keeps the verdicts it had)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
            self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, text TEXT NOT NULL, "
                             "created REAL NOT NULL)")
        except (OSError, sqlite3.Error) as exc:
            raise MasgraphError(f"judge cache {self.path}: {exc}; set the judge's cache_path: to a writable file, "
                                "or cache: false") from None

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT text FROM verdicts WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, text: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?)", (key, text, time.time()))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Judge:
    """Scores responses with a model (`policy`: a bound `masgraph.runtime.scheduler.Policy`, e.g. `Engine.policy`).

    Example:
        >>> judge = Judge(engine.policy("judge", spec.policy), spec, registry)
        >>> verdict = asyncio.run(judge.verdict("Capital of France?", ["Paris"], "It is Paris."))
        >>> verdict.score
        1.0
    """

    def __init__(self, policy: Any, spec: JudgeSpec, registry: Any):
        prompts = registry.judge_prompts
        if spec.prompt not in prompts:
            raise MasgraphError(f"judge prompt {spec.prompt!r} is not registered (known: {sorted(prompts)})")
        self.policy, self.spec, self._messages = policy, spec, prompts[spec.prompt]
        self.cache = VerdictCache(spec.cache_path or cache_dir() / "judge-verdicts.sqlite") if spec.cache else None
        p = spec.policy
        self._identity = [p.backend, p.model, p.api_base, p.adapter, p.sampling.max_tokens, p.sampling.temperature]

    def key(self, messages: list[dict[str, str]]) -> str:
        """The cache key: the judge's model and decoding, and the exact messages."""
        blob = json.dumps([self._identity, messages], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    async def verdict(self, question: str, references: list[str], response: str) -> Verdict:
        """Whether `response` means the same as one of `references` (from the cache when it holds it)."""
        messages = self._messages(question, references, response)
        key = self.key(messages)
        if self.cache is not None and (text := self.cache.get(key)) is not None:
            return Verdict(parse_verdict(text) or 0.0, text, cached=True)
        spec = self.policy.spec
        req = Request(messages, self.policy.name, spec.adapter, spec.sampling, zlib.crc32(key.encode()),
                      key=("judge", key))
        t0 = time.perf_counter()
        [c] = await self.policy.backend.complete([req])
        call = llm_call(req, c, time.perf_counter() - t0)
        if self.cache is not None:
            self.cache.put(key, c.text)
        return Verdict(parse_verdict(c.text) or 0.0, c.text, cached=False, call=call)

    async def score(self, question: str, references: list[str], trace: Trace) -> float:
        """The episode's reward by the judge, its call and verdict recorded in the trace (0 with no call when the
        episode gave no answer)."""
        if trace.answer is None or not trace.answer.strip():
            trace.meta["judge"] = {"verdict": None, "score": 0.0, "cached": False, "why": "no answer"}
            return 0.0
        v = await self.verdict(question, references, trace.answer)
        if v.call is not None:
            trace.judge_calls.append(v.call)
        trace.meta["judge"] = {"verdict": v.text, "score": v.score, "cached": v.cached} | (
            {"unparsed": True} if v.unparsed else {})
        return v.score

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
