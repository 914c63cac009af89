"""A backend that replays canned replies: in order, or chosen by a function of the request (unit tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from masgraph.backends.base import BackendError, Completion, Request

Reply = str | Callable[[Request], str]


class ScriptedBackend:
    """Replays replies; token ids are the UTF-8 bytes of the prompt and reply, logprobs 0.

    Example:
        >>> b = ScriptedBackend(by_policy={"main": "Answer: 4"})
        >>> asyncio.run(b.complete([Request([{"role": "user", "content": "2+2?"}], policy="main")]))[0].text
        'Answer: 4'
    """

    returns_tokens = True

    def __init__(self, replies: Iterable[str] = (), by_policy: dict[str, Reply] | None = None,
                 default: Reply | None = None, delay_s: float = 0.0):
        self._queue = list(replies)
        self._by_policy = by_policy or {}
        self._default = default
        self.delay_s = delay_s
        self.requests: list[Request] = []

    async def complete(self, requests: list[Request]) -> list[Completion]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return [self._one(r) for r in requests]

    def _one(self, req: Request) -> Completion:
        self.requests.append(req)
        reply = self._by_policy.get(req.policy, self._default)
        if reply is None:
            if not self._queue:
                raise BackendError("scripted backend ran out of replies")
            reply = self._queue.pop(0)
        text = reply(req) if callable(reply) else reply
        prompt = "".join(m["content"] for m in req.messages).encode()
        out = text.encode()
        return Completion(text=text, prompt_ids=list(prompt), completion_ids=list(out), logprobs=[0.0] * len(out))

    async def aclose(self) -> None:
        return None
