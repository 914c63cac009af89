"""The final answer of an episode as it decodes: what `masgraph serve` sends for `stream: true`.

Only the answer node's LLM calls stream: the exit node when it is the built-in generator (`answer_node`). Its
answer is not its raw text but the `Answer: ...` line of it (the generator's format, parsed by
`masgraph.agents.formats.parse_answer`), so what streams is that line's value as far as it is certain: the text
after `Answer:` on that line, without the leading and trailing spaces, quotes, backticks and asterisks the parser
strips. A text with no such line streams nothing; its answer arrives whole when the episode ends, as does every
answer of a graph whose exit node is not the generator, or of a backend that does not stream.

The plumbing: the caller gives `Engine.episode` an `AnswerStream`, which is set in the episode's own context; a
backend that streams calls `sink_for(request)` in `complete` before it first awaits, and feeds the sink it gets
(None for every other node's calls) the call's text so far, on the event loop's thread. The stream never takes
text back: if the text the answer node ends with disagrees with what was sent (it wrote a second answer that the
parser prefers: `<answer>...</answer>`, `\\boxed{...}` or a `Final answer:` line; or its step was retried after
part of an answer had streamed), the stream stops growing there (`AnswerStream.rest` then says so)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from masgraph.backends.base import Request
    from masgraph.spec import GraphSpec

__all__ = ["AnswerStream", "TextSink", "answer_node", "answer_prefix", "sink_for"]

CURRENT: ContextVar[AnswerStream | None] = ContextVar("masgraph_answer_stream", default=None)
"""The stream of the episode running in this context (set by `Engine.episode` in the episode's own task)."""


class TextSink(Protocol):
    """Where a backend sends one LLM call's text as it decodes."""

    def update(self, text: str) -> None:
        """The call's whole text so far (each call a longer one); called on the event loop's thread."""
        ...


def answer_node(spec: GraphSpec) -> str | None:
    """The node whose tokens stream: the exit node when it runs the built-in generator agent, else None."""
    node = spec.nodes[spec.exit]
    return spec.exit if node.role == "generator" and node.agent in (None, "generator") else None


def sink_for(request: Request) -> TextSink | None:
    """The sink for `request`'s text when it is a call of the answer node of a streaming episode, else None. Call
    it from a backend's `complete` before its first await (the episode's context is current there)."""
    stream = CURRENT.get()
    if stream is None or stream.node is None or request.key[1:2] != (stream.node,):  # key: (episode, node, ...)
        return None
    return _Call(stream)


_FIELD = r"(?im)^\s*(?:\*\*|#+\s*)?{name}\s*(?:\*\*)?\s*[:=]\s*(?:\*\*)?\s*(.+?)\s*$"
"""The `Name: value` line of masgraph/agents/formats.py (kept equal to it: tests/unit/core/test_streaming.py checks)."""
_FINAL, _ANSWER = re.compile(_FIELD.format(name="final answer")), re.compile(_FIELD.format(name="answer"))
_PREFERRED = ("<answer>", "\\boxed{")
"""Answer forms the parser prefers to an `Answer:` line."""
_QUOTES = "`*\"'"


def answer_prefix(text: str) -> str | None:
    """What the generator's answer is sure to start with, given the first part `text` of its output: the value
    of its `Answer:` line so far, stripped as the parser strips it, less any trailing characters that the parser
    would strip if the line ended there. "" when no `Answer:` line has begun; None when the text holds a form the
    parser prefers (the answer is known only at the end)."""
    if any(form in text for form in _PREFERRED):
        return None
    m = _FINAL.search(text) or _ANSWER.search(text)
    if m is None:
        return ""
    value = m.group(1).lstrip().lstrip(_QUOTES).lstrip()  # as the parser's strip().strip(quotes).strip() does
    end = len(value)
    while end and (value[end - 1].isspace() or value[end - 1] in _QUOTES):
        end -= 1
    return value[:end]


class AnswerStream:
    """The answer of one episode as far as it has streamed: iterate it for the new text (pieces joined while the
    reader was away) until `close`; then `rest(answer)` is what completes it to the episode's answer."""

    def __init__(self, node: str | None):
        self.node = node
        """The node whose calls stream (`answer_node`); None: nothing streams."""
        self.sent = ""
        """The text given out so far."""
        self.frozen = False
        """Set when the answer node's text disagreed with what was sent: nothing more streams."""
        self._pending: list[str] = []
        self._wake = asyncio.Event()
        self._closed = False

    def offer(self, candidate: str | None) -> None:
        """A new sure prefix of the answer (see `answer_prefix`); what extends the text sent is passed on."""
        if self.frozen or self._closed:
            return
        if candidate is None or not (candidate.startswith(self.sent) or self.sent.startswith(candidate)):
            self.frozen = True
            return
        if len(candidate) > len(self.sent):
            self._pending.append(candidate[len(self.sent):])
            self.sent = candidate
            self._wake.set()

    def close(self) -> None:
        """The episode has ended: iteration stops once the pending text is taken."""
        self._closed = True
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            if self._pending:
                text, self._pending = "".join(self._pending), []
                yield text
                continue
            if self._closed:
                return
            self._wake.clear()
            await self._wake.wait()

    def rest(self, answer: str) -> str | None:
        """The text that completes what was sent to `answer`; None when what was sent is not its beginning."""
        return answer[len(self.sent):] if answer.startswith(self.sent) else None


class _Call:
    """One LLM call of the answer node: its text so far turned into a sure prefix of the answer."""

    __slots__ = ("stream",)

    def __init__(self, stream: AnswerStream):
        self.stream = stream

    def update(self, text: str) -> None:
        self.stream.offer(answer_prefix(text))
