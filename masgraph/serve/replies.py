"""The reply to a chat request from its finished episodes, one per choice: a `chat.completion` body, or the SSE
events of a stream (each choice's answer as its answering node decodes it, the choices interleaved; with
`masgraph.stream_steps`, each node's step as it finishes)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from masgraph.serve.agent import Agent, Answer
from masgraph.serve.fields import Plan, StopCut, answer_logprobs, answer_tokenizer, cut_at, finish_reason
from masgraph.serve.guards import ApiError
from masgraph.serve.openai_api import ChatRequest, choice, chunk, completion, error_body, extension, step_view, usage
from masgraph.streaming import AnswerStream
from masgraph.trace import Step

__all__ = ["Reply"]

_log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class Reply:
    """What a reply needs to know of its request."""

    request: ChatRequest
    plan: Plan
    rid: str
    model: str
    agent: Agent
    store_path: str | None
    events: asyncio.Queue[tuple[int, str, Any]] = field(default_factory=asyncio.Queue)
    """What a stream sends, in order: (choice, "text" | "step" | "end", the text, Step, or Answer or error)."""

    def step_sink(self, index: int) -> Callable[[Step], None]:
        """Where choice `index`'s episode reports each step as it finishes (`masgraph.stream_steps`)."""
        return lambda step: self.events.put_nowait((index, "step", step))

    def choice_of(self, index: int, ans: Answer) -> tuple[str, str, dict[str, Any] | None]:
        """(content, finish_reason, logprobs) of one choice's answer: cut at a stop sequence, `length` when the
        answering node ran out of max_tokens."""
        node = self.agent.graph.spec.exit
        content, cut = cut_at(ans.answer or "", self.plan.stop)
        logprobs = (answer_logprobs(ans.trace, node, ans.answer or "", content, answer_tokenizer(self.agent))
                    if self.plan.logprobs else None)
        return content, finish_reason(ans.trace, node, cut), logprobs

    def body(self, answers: list[Answer]) -> dict[str, Any]:
        """The `chat.completion` of finished answers."""
        choices = [choice(i, *self.choice_of(i, a)) for i, a in enumerate(answers)]
        return completion(self.rid, [a.trace for a in answers], choices, self.model, self.request.masgraph.trace,
                          self.store_path)

    async def stream(self, episodes: list[asyncio.Task], streams: list[AnswerStream],
                     settle: Callable[[asyncio.Task], Awaitable[Answer]]) -> AsyncIterator[str]:
        """The SSE events of a streaming request: each choice's role, its answer's text as the answering node
        decodes it (cut at a stop sequence), the rest of it when its episode ends (all of it when nothing
        streamed), its finish chunk (with its logprobs when asked); then usage if asked, and [DONE]. With
        `stream_steps`, each step's chunk as it finishes (the answering node's after its text). A failure after
        the first event is an OpenAI-style error event, then [DONE]."""
        queue = self.events

        async def pump(i: int) -> None:
            async for text in streams[i]:  # ends when the episode does
                queue.put_nowait((i, "text", text))
            try:
                queue.put_nowait((i, "end", await settle(episodes[i])))
            except Exception as exc:
                queue.put_nowait((i, "end", exc))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(episodes))]
        cuts = [StopCut(self.plan.stop) for _ in episodes]
        held: list[list[Step]] = [[] for _ in episodes]
        answers: list[Answer] = []
        try:
            for i in range(len(episodes)):
                yield _sse(chunk(self.rid, self.model, {"role": "assistant", "content": ""}, index=i))
            while len(answers) < len(episodes):  # a disconnect cancels this generator (Starlette listens for it)
                i, kind, item = await queue.get()
                if kind == "text":
                    if piece := cuts[i].feed(item):
                        yield _sse(chunk(self.rid, self.model, {"content": piece}, index=i))
                elif kind == "step":  # the answering node's step waits for the rest of its text
                    if item.node == self.agent.graph.spec.exit:
                        held[i].append(item)
                    else:
                        yield _sse(self._step(i, item))
                elif isinstance(item, Exception):
                    yield _sse(_error_event(item))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    answers.append(item)
                    for event in self._ending(i, item, cuts[i], held[i]):
                        yield _sse(event)
            if self.request.stream_options is not None and self.request.stream_options.include_usage:
                yield _sse(chunk(self.rid, self.model, {}, usage_=usage(*(a.trace for a in answers)), choices=False))
            yield "data: [DONE]\n\n"
        finally:
            for task in (*pumps, *episodes):
                task.cancel()  # a client gone: its episodes are cancelled
            with suppress(asyncio.CancelledError):
                await asyncio.gather(*pumps, return_exceptions=True)

    def _step(self, i: int, step: Step) -> dict[str, Any]:
        """A `stream_steps` chunk: an empty delta of choice `i`, the step under `masgraph.step`."""
        body = chunk(self.rid, self.model, {}, index=i)
        body["masgraph"] = {"step": step_view(step)}
        return body

    def _ending(self, i: int, ans: Answer, sent: StopCut, held: list[Step]) -> list[dict[str, Any]]:
        """The last chunks of choice `i`: the rest of its answer, its answering node's held steps, and its finish
        chunk."""
        content, reason, logprobs = self.choice_of(i, ans)
        events = []
        if not content.startswith(sent.sent):
            _log.warning("stream %s (trace %s): the answer node's final answer does not continue the text "
                         "streamed (it wrote a second answer, or its step was retried); the stream kept what "
                         "it had sent", self.rid, ans.trace.episode_id)
        elif rest := content[len(sent.sent):]:
            events.append(chunk(self.rid, self.model, {"content": rest}, index=i))
        events += [self._step(i, step) for step in held]
        final = chunk(self.rid, self.model, {}, reason, index=i, logprobs=logprobs)
        if self.request.masgraph.trace:
            final["masgraph"] = extension(ans.trace, self.store_path)
        return [*events, final]


def _error_event(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, ApiError):
        return exc.body
    # a bug: its traceback in the log, an error event to the client
    _log.error("POST /v1/chat/completions (stream): unexpected error", exc_info=exc)
    return error_body(f"internal server error ({type(exc).__name__}); the server log has the details",
                      "server_error", code="internal_error")


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
