"""A streamed completion's text, built on the event loop from the tokens the decode thread picks."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from masgraph.streaming import TextSink


class TokenText:
    """One streamed request: each token the decode thread picks is handed to the event loop, which detokenizes
    the tokens so far as the completion's text is (EOS and special tokens left out) and gives it to the sink.
    A text ending in a partial UTF-8 character waits for the next token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer: Any, eos_ids: set[int], sink: TextSink):
        self.loop, self.tokenizer, self.eos_ids, self.sink = loop, tokenizer, eos_ids, sink
        self.ids: list[int] = []
        self.broken = False

    def token(self, tok: int) -> None:
        """On the decode thread: one call into the loop, nothing else (the step's time is the batch's)."""
        if self.broken:
            return
        try:
            self.loop.call_soon_threadsafe(self._add, tok)
        except RuntimeError:  # the loop has closed: nobody reads the stream
            self.broken = True

    def _add(self, tok: int) -> None:
        if self.broken or tok in self.eos_ids:
            return
        self.ids.append(tok)
        try:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                self.sink.update(text)
        except Exception as exc:  # streaming is a view: the completion goes on without it
            self.broken = True
            logging.getLogger(__name__).warning("streaming a completion's text failed (%s: %s); the answer "
                                                "arrives whole", type(exc).__name__, exc)
