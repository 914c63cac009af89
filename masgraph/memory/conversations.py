"""ConversationStores: fact stores that outlive an episode, one per conversation (Memory-R1's deployed setting: a
manager curates one memory across the turns of a dialogue, and each turn's reader answers from it).

A memory node with `scope: conversation` opens its episode's conversation (`meta["conversation"]`, e.g. the
`masgraph.conversation` field of a request to `masgraph serve`), applies the episode's new facts to the store the
conversation's earlier episodes left, and reads it. Episodes of one conversation take turns (a lock per
conversation), so two concurrent requests never interleave their operations. A step edits a copy that replaces the
conversation's store only when the step finishes: an episode that fails, times out or is cancelled mid-step leaves
the store as it found it. With a directory, every committed store is also written there (one JSON file per
conversation, atomically), so a restarted server continues each conversation where it stopped; without one they
live in memory, the least recently used dropped beyond `max_open`.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from masgraph.errors import MasgraphError
from masgraph.files import atomic_write
from masgraph.memory.store import FactStore

__all__ = ["ConversationStores"]


class ConversationStores:
    """Conversation id -> its FactStore.

    Example:
        >>> stores = ConversationStores()
        >>> async def turn(fact):
        ...     async with stores.open("c1") as store:
        ...         store.entries[store.next_id] = fact
        ...         store.next_id += 1
        >>> asyncio.run(turn("Kalo Mira lives in Rafeport."))
        >>> stores.peek("c1").render()
        '[1] Kalo Mira lives in Rafeport.'
    """

    def __init__(self, directory: str | Path | None = None, max_open: int = 1024):
        if max_open < 1:
            raise MasgraphError(f"max_open must be at least 1 (got {max_open})")
        self.directory = Path(directory) if directory is not None else None
        self.max_open = max_open
        self._open: OrderedDict[str, FactStore] = OrderedDict()  # least recently used first
        self._locks: dict[str, asyncio.Lock] = {}
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise MasgraphError(f"cannot use {self.directory} for conversation memories: {exc}") from None

    @asynccontextmanager
    async def open(self, conversation: str) -> AsyncIterator[FactStore]:
        """The conversation's store to edit (a copy: committed when the block exits without an exception); waits
        while another episode of the same conversation holds it."""
        lock = self._locks.setdefault(conversation, asyncio.Lock())
        try:
            async with lock:
                work = copy.deepcopy(self.peek(conversation))
                yield work
                self._commit(conversation, work)
        finally:
            if not lock.locked() and conversation not in self._open:
                self._locks.pop(conversation, None)

    def peek(self, conversation: str) -> FactStore:
        """The conversation's committed store (empty when it has none); not a copy: do not edit it."""
        if conversation in self._open:
            self._open.move_to_end(conversation)
            return self._open[conversation]
        store = self._load(conversation) or FactStore()
        self._remember(conversation, store)
        return store

    def path(self, conversation: str) -> Path | None:
        """Where the conversation's store is written (None without a directory): a hash of the id, so any id is a
        safe file name."""
        if self.directory is None:
            return None
        return self.directory / f"{hashlib.sha256(conversation.encode()).hexdigest()[:32]}.json"

    def _commit(self, conversation: str, store: FactStore) -> None:
        self._remember(conversation, store)
        path = self.path(conversation)
        if path is not None:
            body = {"conversation": conversation, "next_id": store.next_id,
                    "entries": [[n, text] for n, text in sorted(store.entries.items())]}
            atomic_write(path, json.dumps(body, ensure_ascii=False))

    def _remember(self, conversation: str, store: FactStore) -> None:
        self._open[conversation] = store
        self._open.move_to_end(conversation)
        while len(self._open) > self.max_open:
            dropped, _ = self._open.popitem(last=False)
            lock = self._locks.get(dropped)
            if lock is not None and not lock.locked():
                del self._locks[dropped]

    def _load(self, conversation: str) -> FactStore | None:
        path = self.path(conversation)
        if path is None or not path.exists():
            return None
        try:
            body = json.loads(path.read_text())
            if body.get("conversation") != conversation:
                raise ValueError(f"it holds conversation {body.get('conversation')!r}")
            return FactStore({int(n): str(text) for n, text in body["entries"]}, int(body["next_id"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MasgraphError(f"conversation memory {path} is unreadable ({exc}); move it away to start that "
                                "conversation afresh") from None
