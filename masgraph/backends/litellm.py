"""litellm backend: any hosted API or local OpenAI-compatible server. Text only: no token ids or logprobs,
so its policies cannot be trainable (checked at compile); the token counts the server reports (`usage`) are
recorded instead, so summaries, cost rewards and the TUI count its tokens."""

from __future__ import annotations

import asyncio
import os

from masgraph.backends.base import BackendError, Completion, Request
from masgraph.errors import shorten


class LiteLLMBackend:
    """Calls `litellm.acompletion` for each request, concurrently.

    Example:
        >>> b = LiteLLMBackend("openai/smol", api_base="http://127.0.0.1:8000/v1")
    """

    returns_tokens = False

    def __init__(self, model: str, api_base: str | None = None, api_key: str | None = None, timeout_s: float = 120):
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price map at import
        self.model, self.api_base, self.timeout_s = model, api_base, timeout_s
        self.api_key = api_key or os.environ.get("MASGRAPH_API_KEY") or ("none" if api_base else None)

    async def complete(self, requests: list[Request]) -> list[Completion]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, req: Request) -> Completion:
        import litellm

        try:
            resp = await litellm.acompletion(
                model=self.model, messages=req.messages, api_base=self.api_base, api_key=self.api_key,
                temperature=req.sampling.temperature, top_p=req.sampling.top_p,
                max_tokens=req.sampling.max_tokens, timeout=self.timeout_s, seed=req.seed)
        except Exception as exc:
            raise BackendError(f"litellm {self.model}: {type(exc).__name__}: {_said(exc)}") from None
        choices = getattr(resp, "choices", None)
        message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices else None
        if message is None or not isinstance(getattr(message, "content", None) or "", str):
            raise BackendError(f"litellm {self.model}: the server{f' at {self.api_base}' if self.api_base else ''} "
                               f"returned no completion message (choices: {shorten(repr(choices), 200)})")
        prompt, completion = _usage(getattr(resp, "usage", None))
        return Completion(text=message.content or "", prompt_ids=[], completion_ids=[], logprobs=[],
                          finish_reason="length" if choices[0].finish_reason == "length" else "stop",
                          prompt_tokens=prompt, completion_tokens=completion)

    async def aclose(self) -> None:
        return None


def _said(exc: Exception) -> str:
    """What litellm's error says, without the traceback some of its messages carry (an invalid response from the
    server: `Invalid response object Traceback ...`), shortened."""
    text = str(exc).split("Traceback (most recent call last)")[0].strip()
    return shorten(text or type(exc).__name__, 400)


def _usage(usage: object) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens as the server counted them: the only counts a text-only backend has. (None, None)
    when it reported none: litellm then fills in zeros, and no real prompt has zero tokens."""
    counts = tuple(getattr(usage, f, None) for f in ("prompt_tokens", "completion_tokens"))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or not counts[0]:
        return None, None
    return counts  # type: ignore[return-value]
